// The engine's threads: one pool, the calling thread plus `threads - 1` workers, for the matrix
// products and attention of decode and prefill.
//
// Why not OpenMP: a decode step has ~250 parallel regions of 20-200 us each. Workers that go to
// sleep between them pay a wake-up per region, and OpenMP's barriers were measured 20x slower
// than one thread when the other core was busy. These workers spin for a short while after a
// region (regions come back-to-back within a step), then sleep on a condition variable, so an idle
// engine costs nothing and a busy step pays no wake-up.
#pragma once

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <cstdint>
#include <thread>
#include <vector>

namespace smollm2 {

class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

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
  std::atomic<std::uint32_t> generation_{0};  // bumped per region; workers wait on it
  std::atomic<int> next_{0};                  // next task to hand out
  std::atomic<int> checked_in_{0};            // workers that left this region
  int tasks_ = 0;
  TaskFn fn_ = nullptr;
  void* body_ = nullptr;
  std::atomic<bool> stop_{false};
  std::mutex sleep_mutex_;
  std::condition_variable wake_;
  std::atomic<int> sleepers_{0};
};

// The pool every kernel of the engine uses. Starts with one thread (no workers);
// set_engine_threads(n) replaces it (not while a forward pass runs).
ThreadPool& engine_pool();
void set_engine_threads(int threads);
int engine_threads();

// Splits [0, n) into `parts` contiguous ranges; range i is [first, last).
inline void split_range(std::int64_t n, int parts, int i, std::int64_t& first, std::int64_t& last) {
  first = n * i / parts;
  last = n * (i + 1) / parts;
}

}  // namespace smollm2
