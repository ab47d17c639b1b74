// ParallelFor: an engine's thread pool, lent to the CPU backend (CpuOptions::parallel_for). A
// decode step of an engine on the CPU keeps every core busy with its own threads; the cache's work
// inside a call (prefetch's scoring, top-K and planning of each (sequence, kv head), and the block
// copies when they run in the caller) would otherwise run on the calling thread alone while the
// engine's other threads wait. With a ParallelFor the cache splits that work into independent
// tasks and runs them on the engine's threads. The results are the same bits either way.
//
//   oasiskv::CpuOptions options;
//   options.parallel_for = {&pool, pool.size(), [](void* pool, int tasks, oasiskv::ParallelFor::Task task, void* arg) {
//     static_cast<MyPool*>(pool)->run(tasks, [&](int t) { task(arg, t); });
//   }};
#pragma once

#include <atomic>
#include <exception>
#include <type_traits>

namespace oasiskv {
inline namespace v0 {

struct ParallelFor {
  using Task = void (*)(void* arg, int task);
  // run(context, tasks, task, arg) calls task(arg, t) once for every t in [0, tasks), in any order
  // and on any of the pool's threads (the caller's included), and returns when all have returned.
  // The tasks do not throw and do not call back into the cache. Null: every task in order on the
  // calling thread.
  void* context = nullptr;
  int threads = 1;  // how many tasks the pool runs at once: the cache splits its work into no more
  void (*run)(void* context, int tasks, Task task, void* arg) = nullptr;

  explicit operator bool() const noexcept { return run != nullptr && threads > 1; }

  // Runs f(t) for t in [0, tasks) through the pool (inline without one, or for a single task).
  // An exception a task throws is rethrown here (the first one), after every task has ended.
  template <class F>
  void operator()(int tasks, F&& f) const {
    if (tasks <= 0) return;
    if (!*this || tasks == 1) {
      for (int t = 0; t < tasks; ++t) f(t);
      return;
    }
    struct Call {
      std::remove_reference_t<F>* f;
      std::atomic<bool> failed{false};  // set by the first task that throws
      std::exception_ptr error;         // that task's exception: read once run has returned
    } call;
    call.f = &f;
    run(
        context, tasks,
        [](void* arg, int t) {
          auto* c = static_cast<Call*>(arg);
          try {
            (*c->f)(t);
          } catch (...) {
            // Tasks run concurrently: only the first failure is kept (others are dropped).
            if (!c->failed.exchange(true)) c->error = std::current_exception();
          }
        },
        &call);
    if (call.error) std::rethrow_exception(call.error);
  }
};

}  // namespace v0
}  // namespace oasiskv
