#include "thread_pool.hpp"

#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SMOLLM2_PAUSE() _mm_pause()
#else
#define SMOLLM2_PAUSE() std::this_thread::yield()
#endif

namespace smollm2 {
namespace {

thread_local bool inside_task = false;

// How long a worker spins for the next region before it sleeps: regions of one decode step follow
// each other within microseconds; between steps (sampling, the cache's planning) it sleeps.
constexpr auto kSpin = std::chrono::microseconds(200);

std::unique_ptr<ThreadPool>& pool_slot() {
  static std::unique_ptr<ThreadPool> pool = std::make_unique<ThreadPool>(1);
  return pool;
}

}  // namespace

ThreadPool::ThreadPool(int threads) {
  if (threads < 1 || threads > 256) throw std::invalid_argument("thread count " + std::to_string(threads) + ": use 1..256");
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  stop_.store(true);
  {
    std::lock_guard lock(sleep_mutex_);
    generation_.fetch_add(1);
  }
  wake_.notify_all();
  for (auto& w : workers_) w.join();
}

void ThreadPool::take_tasks() {
  inside_task = true;
  for (int t = next_.fetch_add(1, std::memory_order_relaxed); t < tasks_; t = next_.fetch_add(1, std::memory_order_relaxed)) {
    fn_(body_, t);
  }
  inside_task = false;
}

void ThreadPool::worker_loop() {
  // Not a load: a region published before this thread first ran must still count as new.
  std::uint32_t seen = 0;
  for (;;) {
    // Spin a while for the next region, then sleep until one starts.
    const auto until = std::chrono::steady_clock::now() + kSpin;
    int spins = 0;
    std::uint32_t now = generation_.load(std::memory_order_acquire);
    while (now == seen) {
      // Pause-spin first; after that yield between checks, so that another runnable thread (the
      // OasisKV copy worker, with every core in use) gets the core while this one waits.
      if (spins < 4096) {
        SMOLLM2_PAUSE();
      } else {
        std::this_thread::yield();
      }
      if (++spins % 64 == 0 && std::chrono::steady_clock::now() > until) {
        // Sleep. The count is raised before the generation is checked under the lock, and the
        // caller bumps the generation before it reads the count (both sequentially consistent),
        // so either the caller sees a sleeper and notifies under the lock, or this thread sees
        // the new generation and does not sleep.
        std::unique_lock lock(sleep_mutex_);
        sleepers_.fetch_add(1);
        wake_.wait(lock, [&] { return generation_.load() != seen; });
        sleepers_.fetch_sub(1);
      }
      now = generation_.load(std::memory_order_acquire);
    }
    seen = now;
    if (stop_.load()) return;
    take_tasks();
    checked_in_.fetch_add(1, std::memory_order_acq_rel);
  }
}

void ThreadPool::run_erased(int tasks, TaskFn fn, void* body) {
  if (tasks <= 0) return;
  if (workers_.empty() || inside_task || tasks == 1) {
    const bool outer = inside_task;
    inside_task = true;
    for (int t = 0; t < tasks; ++t) fn(body, t);
    inside_task = outer;
    return;
  }
  // Every worker takes part in every region and checks in when it leaves it, so once all have
  // checked in none reads these fields any more and the next region may overwrite them.
  tasks_ = tasks;
  fn_ = fn;
  body_ = body;
  next_.store(0, std::memory_order_relaxed);
  checked_in_.store(0, std::memory_order_relaxed);
  generation_.fetch_add(1);
  if (sleepers_.load() > 0) {
    { std::lock_guard lock(sleep_mutex_); }
    wake_.notify_all();
  }
  take_tasks();
  const int workers = static_cast<int>(workers_.size());
  while (checked_in_.load(std::memory_order_acquire) < workers) SMOLLM2_PAUSE();
}

ThreadPool& engine_pool() { return *pool_slot(); }

void set_engine_threads(int threads) {
  if (threads == engine_threads()) return;
  auto fresh = std::make_unique<ThreadPool>(threads);
  pool_slot() = std::move(fresh);
}

int engine_threads() { return pool_slot()->threads(); }

}  // namespace smollm2
