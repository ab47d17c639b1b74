// GPU microbenchmarks of the CUDA backend (scripts/gpu-check runs this; cudaEvent timing, median
// of several runs). Prints a table last:
//   scoring      summary bytes/s of score_blocks (each block scorer) vs a device-to-device cudaMemcpy
//                of those bytes
//   top-K        segmented_top_k, 8,192 blocks per (sequence, kv head)
//   gather       8 KB blocks host -> device: zero-copy kernel, DMA batch, one large pinned cudaMemcpy
//   Cache<cuda>  one decode step (append, prefetch, acquire, reference attention, release per
//                layer): GPU time, and the host time of the cache calls alone (enqueue overhead)
//   remainder    Cache<cuda>::remainder over 32K-token contexts (centroid, variance)
// Without a device it prints a message and exits 77.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "block_gather.hpp"
#include "oasiskv/error.hpp"
#include "oasiskv/cuda/cache.hpp"
#include "oasiskv/cuda/device_memory.hpp"
#include "oasiskv/cuda/ops.hpp"
#include "oasiskv/cuda/pinned_region.hpp"

using namespace oasiskv;

namespace {

struct Row {
  std::string name;
  double ms;
  double bytes;
};

double time_ms(cudaStream_t stream, const std::function<void()>& fn, int reps = 7) {
  gpu::Event start(true), stop(true);
  fn();  // warm up
  OASISKV_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<float> t;
  for (int r = 0; r < reps; ++r) {
    start.record(stream);
    fn();
    stop.record(stream);
    OASISKV_CUDA_CHECK(cudaEventSynchronize(stop.get()));
    float ms = 0;
    OASISKV_CUDA_CHECK(cudaEventElapsedTime(&ms, start.get(), stop.get()));
    t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Stream-ordered upload of a host vector (the stream's later work sees it).
template <class T>
gpu::DeviceBuffer<T> upload(const std::vector<T>& host, cudaStream_t stream) {
  gpu::DeviceBuffer<T> d(std::max<std::size_t>(host.size(), 1));
  if (!host.empty()) {
    OASISKV_CUDA_CHECK(cudaMemcpyAsync(d.data(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, stream));
  }
  return d;
}

// ---- scoring and top-K: 8 sequences x 8 kv heads x 8,192 blocks, head_dim 128, group 8 -----------
void bench_scoring(cudaStream_t stream, std::vector<Row>& rows) {
  CacheConfig c;
  c.shape = ModelShape{1, 64, 8, 128};
  c.max_sequences = 8;
  c.max_tokens_per_sequence = 8192 * 16 + 64;
  c.budget_tokens = 2048;
  for (GroupReduction red : {GroupReduction::max, GroupReduction::softmax_sum}) {
    c.reduction = red;
    const CacheLayout L = CacheLayout::from(c);
    const int B = 8, H = 8, pairs = B * H, rowsq = 2, stride = static_cast<int>(L.max_blocks);
    const auto summ_n = static_cast<std::size_t>(L.summary_floats);
    gpu::DeviceBuffer<float> summ(summ_n), copy(summ_n);
    gpu::DeviceBuffer<float> q(static_cast<std::size_t>(B * rowsq * 64 * 128));
    summ.fill_async(0, stream);
    q.fill_async(0, stream);
    std::vector<std::int32_t> slots(B);
    std::iota(slots.begin(), slots.end(), 0);
    auto dslots = upload(slots, stream);
    auto dlens = upload(std::vector<std::int64_t>(B, c.max_tokens_per_sequence), stream);
    gpu::DeviceBuffer<float> scores(static_cast<std::size_t>(pairs) * stride);
    gpu::DeviceBuffer<float> bounds(
        red == GroupReduction::softmax_sum ? static_cast<std::size_t>(pairs) * rowsq * 8 * stride : 1);
    gpu::DeviceBuffer<std::int32_t> count(pairs), first(pairs);
    const gpu::DeviceBatch batch{B, dslots.data(), dlens.data()};
    const gpu::ScoreBuffers out{scores.data(), count.data(), first.data(), bounds.data(), stride};
    const double bytes = static_cast<double>(summ_n * sizeof(float));
    rows.push_back({std::string("scoring (") + std::string(reduction_name(red)) + ", 64 heads x 8192 blocks)",
                    time_ms(stream, [&] { gpu::score_blocks<float>(L, 0, batch, q.data(), rowsq, summ.data(), out, stream); }),
                    bytes});
    if (red != GroupReduction::max) continue;
    // The other block scorers on the same summaries (CacheConfig::scorer): their cost against Quest's.
    for (BlockScore scorer : {BlockScore::spread}) {
      CacheConfig cs = c;
      cs.scorer = scorer;
      const CacheLayout Ls = CacheLayout::from(cs);
      rows.push_back({std::string("scoring (max, scorer ") + std::string(block_score_name(scorer)) + ")",
                      time_ms(stream, [&] { gpu::score_blocks<float>(Ls, 0, batch, q.data(), rowsq, summ.data(), out, stream); }),
                      bytes});
    }
    {  // runs (run_tokens 4) reads its own summary, the run key sums: its bytes are those.
      CacheConfig cr = c;
      cr.scorer = BlockScore::runs;
      const CacheLayout Lr = CacheLayout::from(cr);
      const auto runs_n = static_cast<std::size_t>(Lr.run_floats);
      gpu::DeviceBuffer<float> run_sums(runs_n);
      run_sums.fill_async(0, stream);
      rows.push_back({"scoring (max, scorer runs:4; bytes: the run sums)",
                      time_ms(stream, [&] { gpu::score_blocks<float>(Lr, 0, batch, q.data(), rowsq, run_sums.data(), out, stream); }),
                      static_cast<double>(runs_n * sizeof(float))});
    }
    rows.push_back({"d2d cudaMemcpy of the summaries (read+write)",
                    time_ms(stream, [&] {
                      OASISKV_CUDA_CHECK(cudaMemcpyAsync(copy.data(), summ.data(), summ_n * sizeof(float),
                                                         cudaMemcpyDeviceToDevice, stream));
                    }),
                    bytes});
    // Top-K over the scores just computed: 64 segments x 8,192 blocks.
    gpu::DeviceBuffer<std::int32_t> sel(static_cast<std::size_t>(pairs) * L.selectable_blocks), sel_count(pairs);
    rows.push_back({"top-K (K=" + std::to_string(L.selectable_blocks) + ", 64 segments x 8192 blocks)",
                    time_ms(stream, [&] {
                      gpu::segmented_top_k(scores.data(), stride, count.data(), first.data(), pairs,
                                           L.selectable_blocks, sel.data(), sel_count.data(), stream);
                    }),
                    static_cast<double>(pairs) * stride * sizeof(float)});
  }
}

// ---- gather: 4,096 blocks of 8 KB, scattered, host (pinned) -> device ---------------------------
void bench_gather(cudaStream_t stream, std::vector<Row>& rows) {
  constexpr std::size_t kBlock = 8192, kBlocks = 4096, kHostBlocks = 16384;
  gpu::PinnedRegion host(kHostBlocks * kBlock, kBlock);
  if (!host.pinned()) throw Error("the host region could not be pinned");
  gpu::DeviceBuffer<unsigned char> dst(kBlocks * kBlock);
  std::mt19937_64 rng(1);
  std::vector<BlockCopy> copies;
  for (std::size_t i = 0; i < kBlocks; ++i) {
    copies.push_back(BlockCopy{host.device_data() + (rng() % kHostBlocks) * kBlock, dst.data() + i * kBlock, kBlock});
  }
  const double gbytes = static_cast<double>(kBlocks * kBlock);
  using gpu_bench::GatherMethod;
  for (GatherMethod m : {GatherMethod::zero_copy_kernel, GatherMethod::dma_batch}) {
    gpu_bench::BlockGather gather(static_cast<int>(kBlocks), m);
    rows.push_back({m == GatherMethod::zero_copy_kernel ? "gather 4096 x 8 KB h2d: zero-copy kernel"
                                                        : "gather 4096 x 8 KB h2d: DMA cudaMemcpyBatchAsync",
                    time_ms(stream, [&] { gather.run(copies, stream); }), gbytes});
  }
  rows.push_back({"one pinned cudaMemcpy h2d of the same 32 MB",
                  time_ms(stream, [&] {
                    OASISKV_CUDA_CHECK(
                        cudaMemcpyAsync(dst.data(), host.data(), kBlocks * kBlock, cudaMemcpyHostToDevice, stream));
                  }),
                  gbytes});
}

// ---- Cache<cuda>: decode steps of 8 sequences x 8 kv heads, 4 layers, 3,000-token contexts ------
void bench_cache(cudaStream_t stream, std::vector<Row>& rows, std::vector<std::string>& notes) {
  CacheConfig cc;
  cc.shape = ModelShape{4, 32, 8, 128};
  cc.max_sequences = 8;
  cc.max_tokens_per_sequence = 4096;
  cc.budget_tokens = 1024;
  cc.fetch_ratio = 0.25;
  const int B = 8, L = cc.shape.num_layers, H = 8, nq = 32, d = 128, lookahead = 2;
  Cache<cuda, fp16_t> cache(cc, CudaOptions{.compute_stream = stream, .max_query_rows = 4, .tickets_per_layer = 2});
  std::vector<SeqId> batch(B);
  std::iota(batch.begin(), batch.end(), SeqId{1});
  for (SeqId id : batch) cache.add_sequence(id);
  const std::int64_t prompt = 3000;
  std::mt19937_64 rng(2);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<fp16_t> kv_host(static_cast<std::size_t>(B * prompt * H * d));
  for (auto& x : kv_host) x = to_fp16(dist(rng));
  const auto kv = upload(kv_host, stream);
  std::vector<float> q_host(static_cast<std::size_t>(lookahead * B * nq * d));
  for (auto& x : q_host) x = dist(rng);
  const auto q = upload(q_host, stream);
  gpu::DeviceBuffer<float> out(static_cast<std::size_t>(B * nq * d));
  const std::vector<std::int32_t> rows_prompt(B, static_cast<std::int32_t>(prompt));
  // Prefill: every layer's prompt, and the first plan of each layer.
  std::vector<Ticket> prev(static_cast<std::size_t>(L));
  for (int l = 0; l < L; ++l) {
    cache.append(batch, l, rows_prompt, rows_view(kv.data(), B * prompt), rows_view(kv.data(), B * prompt));
    prev[static_cast<std::size_t>(l)] = cache.prefetch(batch, l, rows_view(q.data(), lookahead * B));
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  double host_ms = 0.0;
  int steps = 0;
  // The decode protocol: append; next = prefetch(lookahead); attend(prev) (acquire, attention on
  // the compute stream, release); then join the copy stream into the compute stream, so that the
  // events time_ms records on `stream` cover the copy stream's work too.
  auto step = [&] {
    const auto t0 = std::chrono::steady_clock::now();
    for (int l = 0; l < L; ++l) {
      const auto ul = static_cast<std::size_t>(l);
      cache.append(batch, l, rows_view(kv.data(), B), rows_view(kv.data(), B));
      const Ticket next = cache.prefetch(batch, l, rows_view(q.data(), lookahead * B));
      cache.attend(prev[ul], [&](const LayerView<fp16_t>& view) {
        gpu::reference::sparse_attention<fp16_t>(view, nq, scale, q.data(), out.data(), stream);
      });
      prev[ul] = next;
    }
    cache.join();
    host_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    ++steps;
  };
  cache.reset_statistics();
  const double gpu_ms = time_ms(stream, step, 9);
  cache.synchronize();
  const LayerStatistics total = cache.statistics().total();
  rows.push_back({"Cache<cuda> decode step (4 layers, 8 seqs x 8 kv heads), GPU", gpu_ms, 0.0});
  rows.push_back({"Cache<cuda> decode step: host time of the calls", host_ms / steps, 0.0});
  notes.push_back("Cache<cuda> decode step: " + std::to_string(total.blocks_fetched / static_cast<unsigned>(steps)) +
                  " blocks fetched and " + std::to_string(total.admits_capped / static_cast<unsigned>(steps)) +
                  " admits capped per step (" + std::to_string(steps) + " steps)");
}

// ---- Cache<cuda>::remainder: 8 sequences x 8 kv heads x 32K tokens, 2,048 resident --------------
// One call for the step's true queries (1 row, 32 query heads), over the ~1,900 non-resident
// blocks per kv head. GB/s counts what the estimate reads of those blocks once per kv head
// (clusters: the block sums; quantized: the codes and the key min/max); the thread blocks of one
// group re-read them from L2.
void bench_remainder(cudaStream_t stream, std::vector<Row>& rows) {
  for (RemainderEstimate kind : {RemainderEstimate::clusters, RemainderEstimate::quantized}) {
    CacheConfig cc;
    cc.shape = ModelShape{1, 32, 8, 128};
    cc.max_sequences = 8;
    cc.max_tokens_per_sequence = 32768;
    cc.budget_tokens = 2048;
    cc.remainder = kind;
    const int B = 8, H = 8, nq = 32, d = 128;
    const std::int64_t context = 32768 - 64;
    Cache<cuda, fp16_t> cache(cc, CudaOptions{.compute_stream = stream});
    std::vector<SeqId> batch(B);
    std::iota(batch.begin(), batch.end(), SeqId{1});
    for (SeqId id : batch) cache.add_sequence(id);
    std::mt19937_64 rng(3);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    std::vector<fp16_t> kv_host(static_cast<std::size_t>(context * H * d));
    for (auto& x : kv_host) x = to_fp16(dist(rng));
    const auto kv = upload(kv_host, stream);
    for (SeqId id : batch) {
      const SeqId one[] = {id};
      const std::int32_t n[] = {static_cast<std::int32_t>(context)};
      cache.append(one, 0, n, rows_view(kv.data(), context), rows_view(kv.data(), context));
    }
    std::vector<float> q_host(static_cast<std::size_t>(B * nq * d));
    for (auto& x : q_host) x = dist(rng);
    const auto q = upload(q_host, stream);
    gpu::DeviceBuffer<float> out(static_cast<std::size_t>(B * nq * d)), lse(static_cast<std::size_t>(B * nq));
    const Ticket t = cache.prefetch(batch, 0, rows_view(q.data(), B));
    (void)cache.acquire(t);
    const double ms = time_ms(stream, [&] {
      cache.remainder(t, rows_view(q.data(), B), std::span<float>(out.data(), out.size()),
                      std::span<float>(lse.data(), lse.size()));
    });
    cache.release(t);
    const CacheLayout& L = cache.layout();
    const double left = static_cast<double>(L.blocks_for(context) - L.budget_blocks) * B * H;
    const double per_block = kind == RemainderEstimate::clusters
                                 ? L.remainder.moment_vectors * d * 4.0
                                 : static_cast<double>(L.remainder.quantized_block_bytes) + 2.0 * d * 4.0;
    rows.push_back({std::string("remainder (") + std::string(remainder_name(kind)) + ", 8 seqs x 8 kv heads x " +
                        std::to_string(L.blocks_for(context) - L.budget_blocks) + " blocks)",
                    ms, left * per_block});
  }
}

}  // namespace

int main() {
  if (!gpu::device_available()) {
    std::printf("oasiskv_cuda_bench: no CUDA device\n");
    return 77;
  }
  try {
    gpu::Stream stream;
    std::vector<Row> rows;
    std::vector<std::string> notes;
    bench_scoring(stream, rows);
    bench_gather(stream, rows);
    bench_cache(stream, rows, notes);
    bench_remainder(stream, rows);
    std::printf("\n%-64s %10s %12s\n", "benchmark", "ms", "GB/s");
    for (const Row& r : rows) {
      std::printf("%-64s %10.3f %12.1f\n", r.name.c_str(), r.ms, r.bytes > 0 ? r.bytes / (r.ms * 1e6) : 0.0);
    }
    for (const std::string& n : notes) std::printf("%s\n", n.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "oasiskv_cuda_bench: %s\n", e.what());
    return 1;
  }
}
