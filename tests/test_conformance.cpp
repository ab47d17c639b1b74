// The conformance suite (tests/conformance/conformance.hpp) on the CPU backend, with its copies on
// the cache's worker thread (the default) and in the calling thread (CpuOptions::copy_thread =
// false; shorter random runs: the same code but for where the copies run).
#include "conformance/conformance.hpp"

namespace {

template <bool CopyThread, int RandomSteps, int SequenceOps>
struct BasicCpuHarness {
  static constexpr bool reads_values = true;
  static constexpr int random_steps = RandomSteps;
  static constexpr int sequence_ops = SequenceOps;
  template <class T>
  using CacheOf = oasiskv::Cache<oasiskv::cpu, T>;
  template <class T>
  std::unique_ptr<CacheOf<T>> make(const oasiskv::CacheConfig& c) {
    return std::make_unique<CacheOf<T>>(c, oasiskv::CpuOptions{.copy_thread = CopyThread});
  }
  // Host memory is what the CPU backend reads: keep a copy alive for the harness's lifetime.
  template <class V>
  oasiskv::RowsView input(const std::vector<V>& host, std::int64_t rows) {
    auto copy = std::make_shared<std::vector<V>>(host);
    keep.push_back(copy);
    return oasiskv::RowsView{copy->data(), oasiskv::dtype_of_v<V>, rows};
  }
  template <class T>
  oasiskv::test::HostView<T> read(CacheOf<T>& cache, const oasiskv::LayerView<T>& v) {
    return oasiskv::test::copy_host_view(v, cache.layout().block_elems);
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

}  // namespace

TEST_SUITE("pipeline") {
OASISKV_CONFORMANCE_CASES(CpuHarness, TEST_CASE, "cpu ")
OASISKV_CONFORMANCE_CASES(CpuInlineHarness, TEST_CASE, "cpu copies in the caller ")
}
