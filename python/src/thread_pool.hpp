// ThreadPool: the module's threads for the CPU cache's work inside one call (CpuOptions::
// parallel_for: prefetch's planning, copies run in the caller; LayerView.attention's cpu_attend).
//
// OpenMP, so that a call runs on the same team of threads as torch's CPU kernels (a process loads
// one libgomp.so.1, torch's or the system's, whichever of torch and this module comes first). An engine on torch runs its layers' kernels in OpenMP
// regions back to back, and after each region torch's workers spin for the next; threads of our
// own would compete with them for the cores (measured inside vLLM on 2 vCPUs: the decode attention
// took 1.4x as long on a pool of the module's own threads as on this).
#pragma once

#include "oasiskv/cpu/parallel_for.hpp"

namespace oasiskv::python {

class ThreadPool {
 public:
  // threads >= 1: the calling thread plus threads - 1 of OpenMP's.
  explicit ThreadPool(int threads);

  int threads() const { return threads_; }
  // This pool as the library takes threads; valid while the pool lives.
  ParallelFor parallel_for();

 private:
  // Runs every task in one OpenMP region of min(tasks, threads) threads, each taking tasks in turn
  // (inline where already inside a region).
  void run(int tasks, ParallelFor::Task task, void* arg);

  int threads_;
};

}  // namespace oasiskv::python
