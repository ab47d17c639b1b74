// The engine's threads: one pool, the calling thread plus `threads - 1` workers, for the matrix
// products and attention of decode and prefill.
//
// Why not OpenMP: a decode step has ~250 parallel regions of 20-200 us each. Workers that go to
// sleep between them pay a wake-up per region, and OpenMP's barriers were measured 20x slower
// than one thread when the other core was busy. These workers spin for a short while after a
// region (regions come back-to-back within a step), then sleep on a condition variable, so an idle
// engine costs nothing and a busy step pays no wake-up. A worker joins a region only while the
// caller is still handing out its tasks, so a worker whose core another thread holds (another
// process, the OasisKV copy worker) delays nobody: the caller takes its tasks.
#pragma once

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <cstdint>
#include <thread>
#include <vector>

#include <oasiskv/cpu/parallel_for.hpp>

namespace smollm2 {

class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Where the pool's threads spent their time while profiling was on (step_profile.hpp), summed
  // over threads: running tasks (the caller's included), spinning for the next region, asleep, and
  // the caller's wait for the workers to leave a region.
  struct Times {
    std::int64_t regions = 0;
    std::int64_t busy_ns = 0, spin_ns = 0, sleep_ns = 0, caller_wait_ns = 0;
  };
  // Off by default: profiling reads the clock a few times per region.
  void set_profiling(bool on) { profiling_.store(on, std::memory_order_relaxed); }
  Times times() const;
  void reset_times();

  // Runs body(task) for every task in [0, tasks) and returns when all are done; the calling thread
  // takes tasks too. Tasks are handed out one at a time, in order. A call from inside a task (or
  // with one thread) runs the tasks inline.
  template <class Body>
  void run(int tasks, Body&& body) {
    run_erased(tasks, [](void* b, int t) { (*static_cast<Body*>(b))(t); }, &body);
  }

 private:
  using TaskFn = void (*)(void*, int);
  void run_erased(int tasks, TaskFn fn, void* body);
  void worker_loop();
  void take_tasks();

  std::vector<std::thread> workers_;
  // The region: its generation (bumped per region; workers wait on it), whether the caller has
  // closed it (every task taken), and the workers inside it (thread_pool.cpp).
  std::atomic<std::uint64_t> state_{std::uint64_t{1} << 31};
  std::atomic<int> next_{0};  // next task to hand out
  int tasks_ = 0;
  TaskFn fn_ = nullptr;
  void* body_ = nullptr;
  std::atomic<bool> stop_{false};
  std::mutex sleep_mutex_;
  std::condition_variable wake_;
  std::atomic<int> sleepers_{0};
  std::atomic<bool> profiling_{false};
  std::atomic<std::int64_t> regions_{0}, busy_ns_{0}, spin_ns_{0}, sleep_ns_{0}, caller_wait_ns_{0};
};

// The pool every kernel of the engine uses. Starts with one thread (no workers);
// set_engine_threads(n) replaces it (not while a forward pass runs).
ThreadPool& engine_pool();
void set_engine_threads(int threads);
int engine_threads();

// The engine's pool as the library takes threads (oasiskv/cpu/parallel_for.hpp): the cache's
// planning and in-caller copies (CpuOptions::parallel_for) and the library's attention
// (oasiskv/cpu/attention.hpp) run on the engine's threads. Sized by engine_threads() now; runs on
// whatever pool engine_pool() is when called.
oasiskv::ParallelFor engine_parallel_for();

// Splits [0, n) into `parts` contiguous ranges; range i is [first, last).
inline void split_range(std::int64_t n, int parts, int i, std::int64_t& first, std::int64_t& last) {
  first = n * i / parts;
  last = n * (i + 1) / parts;
}

}  // namespace smollm2
