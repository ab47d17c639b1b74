// ThreadPool (thread_pool.hpp).
#include "thread_pool.hpp"

#include <atomic>

#include <omp.h>

#include "oasiskv/error.hpp"

namespace oasiskv::python {

ThreadPool::ThreadPool(int threads) : threads_(threads) {
  if (threads < 1) fail("Cache: threads {} is below 1", threads);
}

ParallelFor ThreadPool::parallel_for() {
  ParallelFor p;
  p.context = this;
  p.threads = threads_;
  p.run = [](void* context, int tasks, ParallelFor::Task task, void* arg) {
    static_cast<ThreadPool*>(context)->run(tasks, task, arg);
  };
  return p;
}

void ThreadPool::run(int tasks, ParallelFor::Task task, void* arg) {
  if (tasks <= 0) return;
  const int team = tasks < threads_ ? tasks : threads_;
  if (team == 1 || omp_in_parallel()) {
    for (int t = 0; t < tasks; ++t) task(arg, t);
    return;
  }
  std::atomic<int> next{0};
#pragma omp parallel num_threads(team)
  {
    for (int t = next.fetch_add(1, std::memory_order_relaxed); t < tasks; t = next.fetch_add(1, std::memory_order_relaxed))
      task(arg, t);
  }
}

}  // namespace oasiskv::python
