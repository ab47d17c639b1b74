// The conformance suite (tests/conformance/conformance.hpp) on the CUDA backend: the same source
// as the CPU's, with inputs in device memory and views read back from the device. Runs where a
// GPU exists; elsewhere main() reports these cases as skipped.
#include <doctest/doctest.h>

#include <memory>
#include <vector>

#include "conformance/conformance.hpp"
#include "cuda/cuda_support.hpp"
#include "oasiskv/cuda/cache.hpp"

namespace {

using namespace oasiskv;

struct CudaHarness {
  static constexpr bool reads_values = false;  // device data is not read on the host
  static constexpr int random_steps = 3000;
  static constexpr int sequence_ops = 100000;
  template <class T>
  using CacheOf = Cache<cuda, T>;

  template <class T>
  std::unique_ptr<CacheOf<T>> make(const CacheConfig& c) {
    // Three live tickets per layer: the ticket rules case holds one acquired and two more (one
    // superseding the other); the random cases hold at most two besides the acquired one.
    return std::make_unique<CacheOf<T>>(c, CudaOptions{.compute_stream = stream.get(), .tickets_per_layer = 3});
  }
  // A device copy, uploaded on the compute stream (stream-ordered before the cache's use of it).
  template <class V>
  RowsView input(const std::vector<V>& host, std::int64_t rows) {
    keep.push_back(std::make_unique<gpu::DeviceBuffer<V>>(gpu_test::upload(host, stream.get())));
    return RowsView{static_cast<gpu::DeviceBuffer<V>*>(keep.back().get())->data(), dtype_of_v<V>, rows};
  }
  template <class T>
  test::HostView<T> read(CacheOf<T>& cache, const LayerView<T>& v) {
    const cudaStream_t s = stream.get();
    const auto B = static_cast<std::size_t>(v.batch_size);
    const auto ids = gpu_test::download(v.seq_ids, B, s);
    const auto len = gpu_test::download(v.seq_len, B, s);
    const auto indptr = gpu_test::download(v.indptr, static_cast<std::size_t>(v.num_pairs()) + 1, s);
    const auto n = static_cast<std::size_t>(indptr.back());
    const auto slot = gpu_test::download(v.slot, n, s);
    const auto block = gpu_test::download(v.block, n, s);
    const auto valid = gpu_test::download(v.valid_tokens, n, s);
    const auto pool = gpu_test::download(v.pool, static_cast<std::size_t>(cache.layout().slots_per_layer * v.slot_stride), s);
    LayerView<T> on_host = v;  // the same geometry over the downloaded arrays
    on_host.seq_ids = ids.data();
    on_host.seq_len = len.data();
    on_host.indptr = indptr.data();
    on_host.slot = slot.data();
    on_host.block = block.data();
    on_host.valid_tokens = valid.data();
    on_host.pool = pool.data();
    return test::copy_host_view(on_host);
  }
  // The block summaries, downloaded (SummaryStore's layout).
  template <class T>
  std::vector<float> summaries(CacheOf<T>& cache) {
    return gpu_test::download(cache.backend().summaries(), static_cast<std::size_t>(cache.layout().summary_floats),
                              stream.get());
  }
  ~CudaHarness() { (void)cudaStreamSynchronize(stream.get()); }

  gpu::Stream stream;
  std::vector<std::shared_ptr<void>> keep;
};

}  // namespace

OASISKV_CONFORMANCE_CASES(CudaHarness, OASISKV_CUDA_TEST_CASE, "cuda ")
