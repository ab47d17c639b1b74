#include "oasiskv/cpu/detail/copy_worker.hpp"

#include "oasiskv/cpu/detail/cpu_kernels.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <utility>

namespace oasiskv {
inline namespace v0 {

CopyWorker::CopyWorker(int max_sequences, int layers, bool threaded, ParallelFor parallel_for)
    : generation_(static_cast<std::size_t>(max_sequences), 0),
      failure_(static_cast<std::size_t>(max_sequences)),
      busy_(std::make_unique<std::atomic<std::int64_t>[]>(static_cast<std::size_t>(layers))),
      layers_(layers),
      parallel_for_(threaded ? ParallelFor{} : parallel_for) {
  reset_busy();
  if (threaded) worker_ = std::thread([this] { run(); });
}

CopyWorker::~CopyWorker() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  if (worker_.joinable()) worker_.join();
}

void CopyWorker::submit(std::uint64_t ticket, std::vector<PlanCopies> plans) {
  if (!worker_.joinable()) {  // no thread: the copies run here, in submission order
    std::unique_lock lock(mutex_);
    for (auto& p : plans) {
      Job job{ticket, std::move(p)};
      execute(job, lock);
    }
    return;
  }
  {
    std::lock_guard lock(mutex_);
    for (auto& p : plans) pending_.push_back(Job{ticket, std::move(p)});
  }
  changed_.notify_all();
}

std::int64_t CopyWorker::busy_ns(int layer) const noexcept {
  return busy_[static_cast<std::size_t>(layer)].load(std::memory_order_relaxed);
}

void CopyWorker::reset_busy() noexcept {
  for (int l = 0; l < layers_; ++l) busy_[static_cast<std::size_t>(l)].store(0, std::memory_order_relaxed);
}

std::int64_t CopyWorker::wait(std::uint64_t ticket) {
  const auto start = std::chrono::steady_clock::now();
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] {
    return running_ != ticket &&
           std::none_of(pending_.begin(), pending_.end(), [&](const Job& j) { return j.ticket == ticket; });
  });
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
}

void CopyWorker::reset_sequence(int seq_slot, std::uint32_t generation) {
  {
    std::unique_lock lock(mutex_);
    generation_[static_cast<std::size_t>(seq_slot)] = generation;
    failure_[static_cast<std::size_t>(seq_slot)].clear();
    std::erase_if(pending_,
                  [&](const Job& j) { return j.plan.seq_slot == seq_slot && j.plan.generation != generation; });
    // A job already copying read the old generation; let it finish before the slots are reused.
    changed_.wait(lock, [&] { return !running_.has_value(); });
  }
  changed_.notify_all();
}

void CopyWorker::drain() {
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] { return pending_.empty() && !running_.has_value(); });
}

std::size_t CopyWorker::in_flight() const {
  std::lock_guard lock(mutex_);
  return pending_.size() + (running_ ? 1 : 0);
}

std::string CopyWorker::failure(int seq_slot) const {
  std::lock_guard lock(mutex_);
  return failure_[static_cast<std::size_t>(seq_slot)];
}

void CopyWorker::run() {
  std::unique_lock lock(mutex_);
  for (;;) {
    changed_.wait(lock, [&] { return stop_ || !pending_.empty(); });
    if (stop_) return;
    Job job = std::move(pending_.front());
    pending_.pop_front();
    execute(job, lock);
    changed_.notify_all();
  }
}

void CopyWorker::execute(Job& job, std::unique_lock<std::mutex>& lock) {
  running_ = job.ticket;
  const auto s = static_cast<std::size_t>(job.plan.seq_slot);
  if (generation_[s] != job.plan.generation) {
    job.plan.copies.clear();  // its sequence was removed: not its slots any more
    job.plan.remote.clear();
  }
  if (!failure_[s].empty()) job.plan.remote.clear();  // one failure per sequence, not one timeout per plan
  lock.unlock();
  const auto start = std::chrono::steady_clock::now();
  // In the caller with the engine's pool: contiguous shares of at least kCopiesPerTask blocks.
  constexpr std::size_t kCopiesPerTask = 8;
  const std::span<const BlockCopy> copies = job.plan.copies;
  const int tasks = static_cast<int>(std::min<std::size_t>(static_cast<std::size_t>(std::max(parallel_for_.threads, 1)),
                                                           copies.size() / kCopiesPerTask));
  if (tasks > 1 && parallel_for_) {
    parallel_for_(tasks, [&](int t) {
      const std::size_t first = copies.size() * static_cast<std::size_t>(t) / static_cast<std::size_t>(tasks);
      const std::size_t last = copies.size() * static_cast<std::size_t>(t + 1) / static_cast<std::size_t>(tasks);
      detail::copy_blocks(copies.subspan(first, last - first));
    });
  } else {
    detail::copy_blocks(copies);
  }
  std::string failed;
  if (!job.plan.remote.empty()) {
    try {
      job.plan.source->read(job.plan.remote);
    } catch (const std::exception& e) {
      failed = e.what();
    }
  }
  busy_[static_cast<std::size_t>(job.plan.layer)].fetch_add(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count(),
      std::memory_order_relaxed);
  lock.lock();
  if (!failed.empty() && generation_[s] == job.plan.generation && failure_[s].empty()) failure_[s] = std::move(failed);
  running_.reset();
}

}  // namespace v0
}  // namespace oasiskv
