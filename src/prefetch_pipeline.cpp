#include "oasiskv/prefetch_pipeline.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <utility>

namespace oasiskv {
inline namespace v0 {

PrefetchPipeline<cpu>::PrefetchPipeline(int max_sequences, int num_layers)
    : num_layers_(num_layers),
      generation_(static_cast<std::size_t>(max_sequences), 0),
      retired_(static_cast<std::size_t>(max_sequences) * static_cast<std::size_t>(num_layers), -1),
      worker_([this] { run(); }) {}

PrefetchPipeline<cpu>::~PrefetchPipeline() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  worker_.join();
}

void PrefetchPipeline<cpu>::submit(std::uint64_t ticket, std::vector<PlanCopies> plans) {
  {
    std::lock_guard lock(mutex_);
    for (auto& p : plans) pending_.push_back(Job{ticket, std::move(p)});
  }
  changed_.notify_all();
}

std::int64_t PrefetchPipeline<cpu>::wait(std::uint64_t ticket) {
  const auto start = std::chrono::steady_clock::now();
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] {
    return running_ != ticket && std::none_of(pending_.begin(), pending_.end(),
                                              [&](const Job& j) { return j.ticket == ticket; });
  });
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
      .count();
}

void PrefetchPipeline<cpu>::retire(int seq_slot, int layer, std::int64_t plan_index) {
  {
    std::lock_guard lock(mutex_);
    auto& r = retired_[static_cast<std::size_t>(seq_slot) * num_layers_ + layer];
    r = std::max(r, plan_index);
  }
  changed_.notify_all();
}

void PrefetchPipeline<cpu>::reset_sequence(int seq_slot, std::uint32_t generation) {
  {
    std::unique_lock lock(mutex_);
    generation_[static_cast<std::size_t>(seq_slot)] = generation;
    for (int l = 0; l < num_layers_; ++l) retired_[static_cast<std::size_t>(seq_slot) * num_layers_ + l] = -1;
    // A job already copying read the old generation; let it finish before the slots are reused.
    changed_.wait(lock, [&] { return !running_.has_value(); });
  }
  changed_.notify_all();
}

std::size_t PrefetchPipeline<cpu>::in_flight() const {
  std::lock_guard lock(mutex_);
  return pending_.size() + (running_ ? 1 : 0);
}

bool PrefetchPipeline<cpu>::stale(const PlanCopies& p) const {
  return generation_[static_cast<std::size_t>(p.seq_slot)] != p.generation;
}

// Gates only open forwards, so the first runnable job in queue order is also the oldest queued
// plan of its (sequence, layer): plans of one (sequence, layer) run in order.
bool PrefetchPipeline<cpu>::runnable(const Job& job) const {
  const PlanCopies& p = job.plan;
  return stale(p) ||
         p.plan_index <= retired_[static_cast<std::size_t>(p.seq_slot) * num_layers_ + p.layer] + 1;
}

void PrefetchPipeline<cpu>::run() {
  std::unique_lock lock(mutex_);
  for (;;) {
    auto next = pending_.end();
    changed_.wait(lock, [&] {
      if (stop_) return true;
      next = std::find_if(pending_.begin(), pending_.end(), [&](const Job& j) { return runnable(j); });
      return next != pending_.end();
    });
    if (stop_) return;
    Job job = std::move(*next);
    pending_.erase(next);
    running_ = job.ticket;
    if (stale(job.plan)) job.plan.copies.clear();  // its sequence was removed: not its slots
    lock.unlock();
    for (const BlockCopy& c : job.plan.copies) std::memcpy(c.dst, c.src, c.bytes);
    lock.lock();
    running_.reset();
    changed_.notify_all();
  }
}

}  // namespace v0
}  // namespace oasiskv
