// The conformance suite (tests/conformance/conformance.hpp) on the CPU backend, with its copies on
// the cache's worker thread (the default), in the calling thread (CpuOptions::copy_thread =
// false), and in the calling thread with a pool lent to the cache (CpuOptions::parallel_for: the
// planning and the copies split into tasks on several threads). The last two run shorter random
// runs: the same code but for where the work runs.
#include <atomic>
#include <thread>
#include <vector>

#include "conformance/conformance.hpp"

namespace {

// A ParallelFor for the tests: each call starts two threads that share the tasks with the caller.
oasiskv::ParallelFor spawning_pool() {
  oasiskv::ParallelFor p;
  p.threads = 3;
  p.run = [](void*, int tasks, oasiskv::ParallelFor::Task task, void* arg) {
    std::atomic<int> next{0};
    auto take = [&] {
      for (int t = next++; t < tasks; t = next++) task(arg, t);
    };
    std::vector<std::thread> helpers;
    for (int i = 0; i < 2; ++i) helpers.emplace_back(take);
    take();
    for (auto& h : helpers) h.join();
  };
  return p;
}

template <bool CopyThread, int RandomSteps, int SequenceOps, bool Pool = false>
struct BasicCpuHarness {
  static constexpr bool reads_values = true;
  static constexpr int random_steps = RandomSteps;
  static constexpr int sequence_ops = SequenceOps;
  template <class T>
  using CacheOf = oasiskv::Cache<oasiskv::cpu, T>;
  template <class T>
  std::unique_ptr<CacheOf<T>> make(const oasiskv::CacheConfig& c) {
    oasiskv::CpuOptions options{.copy_thread = CopyThread};
    if (Pool) options.parallel_for = spawning_pool();
    return std::make_unique<CacheOf<T>>(c, options);
  }
  // Host memory is what the CPU backend reads: keep a copy alive for the harness's lifetime.
  template <class V>
  oasiskv::RowsView input(const std::vector<V>& host, std::int64_t rows) {
    auto copy = std::make_shared<std::vector<V>>(host);
    keep.push_back(copy);
    return oasiskv::RowsView{copy->data(), oasiskv::dtype_of_v<V>, rows};
  }
  template <class T>
  oasiskv::test::HostView<T> read(CacheOf<T>&, const oasiskv::LayerView<T>& v) {
    return oasiskv::test::copy_host_view(v);
  }
  // The block summaries, SummaryStore's layout.
  template <class T>
  std::vector<float> summaries(CacheOf<T>& cache) {
    const float* p = cache.backend().summaries().block(0, 0, 0, 0);
    return std::vector<float>(p, p + cache.layout().summary_floats);
  }
  std::vector<std::shared_ptr<void>> keep;
};
using CpuHarness = BasicCpuHarness<true, 10000, 100000>;
using CpuInlineHarness = BasicCpuHarness<false, 3000, 20000>;
using CpuPoolHarness = BasicCpuHarness<false, 3000, 20000, true>;

}  // namespace

TEST_SUITE("pipeline") {
OASISKV_CONFORMANCE_CASES(CpuHarness, TEST_CASE, "cpu ")
OASISKV_CONFORMANCE_CASES(CpuInlineHarness, TEST_CASE, "cpu copies in the caller ")
OASISKV_CONFORMANCE_CASES(CpuPoolHarness, TEST_CASE, "cpu work on a lent pool ")
}
