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

using Clock = std::chrono::steady_clock;
std::int64_t ns_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(b - a).count();
}

// How long a worker spins for the next region before it sleeps: regions of one decode step follow
// each other within microseconds; between steps (sampling, the cache's planning) it sleeps.
constexpr auto kSpin = std::chrono::microseconds(200);

std::unique_ptr<ThreadPool>& pool_slot() {
  static std::unique_ptr<ThreadPool> pool = std::make_unique<ThreadPool>(1);
  return pool;
}

}  // namespace

// state_: the region's generation (high 32 bits), whether it is closed (bit 31), and how many
// workers are inside it (low bits).
constexpr std::uint64_t kClosed = std::uint64_t{1} << 31;
constexpr std::uint64_t kInsideMask = kClosed - 1;
std::uint32_t generation_of(std::uint64_t state) { return static_cast<std::uint32_t>(state >> 32); }

ThreadPool::ThreadPool(int threads) {
  if (threads < 1 || threads > 256) throw std::invalid_argument("thread count " + std::to_string(threads) + ": use 1..256");
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  stop_.store(true);
  {
    std::lock_guard lock(sleep_mutex_);
    state_.store((static_cast<std::uint64_t>(generation_of(state_.load()) + 1) << 32) | kClosed);
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
    const auto waiting = Clock::now();
    const auto until = waiting + kSpin;
    std::int64_t slept = 0;
    int spins = 0;
    std::uint64_t state = state_.load(std::memory_order_acquire);
    while (generation_of(state) == seen) {
      // Pause-spin first; after that yield between checks, so that another runnable thread (the
      // OasisKV copy worker, with every core in use) gets the core while this one waits.
      if (spins < 4096) {
        SMOLLM2_PAUSE();
      } else {
        std::this_thread::yield();
      }
      if (++spins % 64 == 0 && Clock::now() > until) {
        // Sleep. The count is raised before the generation is checked under the lock, and the
        // caller publishes the generation before it reads the count (both sequentially
        // consistent), so either the caller sees a sleeper and notifies under the lock, or this
        // thread sees the new generation and does not sleep.
        const auto asleep = Clock::now();
        std::unique_lock lock(sleep_mutex_);
        sleepers_.fetch_add(1);
        wake_.wait(lock, [&] { return generation_of(state_.load()) != seen; });
        sleepers_.fetch_sub(1);
        slept += ns_between(asleep, Clock::now());
      }
      state = state_.load(std::memory_order_acquire);
    }
    seen = generation_of(state);
    if (stop_.load()) return;
    // Join the region unless the caller has closed it: a worker that wakes late (its core was
    // taken by another thread) finds the tasks done and goes back to waiting, and the caller
    // never waits for it.
    bool joined = false;
    while (!joined && generation_of(state) == seen && (state & kClosed) == 0) {
      joined = state_.compare_exchange_weak(state, state + 1, std::memory_order_acq_rel);
    }
    if (!joined) continue;
    const bool profiling = profiling_.load(std::memory_order_relaxed);
    const auto woke = profiling ? Clock::now() : Clock::time_point{};
    take_tasks();
    if (profiling) {
      const auto done = Clock::now();
      spin_ns_.fetch_add(ns_between(waiting, woke) - slept, std::memory_order_relaxed);
      sleep_ns_.fetch_add(slept, std::memory_order_relaxed);
      busy_ns_.fetch_add(ns_between(woke, done), std::memory_order_relaxed);
    }
    state_.fetch_sub(1, std::memory_order_acq_rel);
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
  // The last region is closed and empty: no worker reads these fields until it joins the new one.
  tasks_ = tasks;
  fn_ = fn;
  body_ = body;
  next_.store(0, std::memory_order_relaxed);
  state_.store(static_cast<std::uint64_t>(generation_of(state_.load(std::memory_order_relaxed)) + 1) << 32);
  if (sleepers_.load() > 0) {
    { std::lock_guard lock(sleep_mutex_); }
    wake_.notify_all();
  }
  const bool profiling = profiling_.load(std::memory_order_relaxed);
  const auto start = profiling ? Clock::now() : Clock::time_point{};
  take_tasks();
  const auto done = profiling ? Clock::now() : Clock::time_point{};
  // Every task is taken: close the region and wait for the workers inside it to finish theirs.
  state_.fetch_or(kClosed, std::memory_order_acq_rel);
  while ((state_.load(std::memory_order_acquire) & kInsideMask) != 0) SMOLLM2_PAUSE();
  if (profiling) {
    regions_.fetch_add(1, std::memory_order_relaxed);
    busy_ns_.fetch_add(ns_between(start, done), std::memory_order_relaxed);
    caller_wait_ns_.fetch_add(ns_between(done, Clock::now()), std::memory_order_relaxed);
  }
}

ThreadPool::Times ThreadPool::times() const {
  return Times{regions_.load(), busy_ns_.load(), spin_ns_.load(), sleep_ns_.load(), caller_wait_ns_.load()};
}

void ThreadPool::reset_times() {
  for (auto* a : {&regions_, &busy_ns_, &spin_ns_, &sleep_ns_, &caller_wait_ns_}) a->store(0);
}

ThreadPool& engine_pool() { return *pool_slot(); }

void set_engine_threads(int threads) {
  if (threads == engine_threads()) return;
  auto fresh = std::make_unique<ThreadPool>(threads);
  pool_slot() = std::move(fresh);
}

int engine_threads() { return pool_slot()->threads(); }

oasiskv::ParallelFor engine_parallel_for() {
  oasiskv::ParallelFor p;
  p.threads = engine_threads();
  p.run = [](void*, int tasks, oasiskv::ParallelFor::Task task, void* arg) {
    engine_pool().run(tasks, [&](int t) { task(arg, t); });
  };
  return p;
}

}  // namespace smollm2
