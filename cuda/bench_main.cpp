// GPU microbenchmarks of the CUDA backend (scripts/gpu-check runs this; cudaEvent timing, median
// of several runs). Prints a table last:
//   scoring      summary bytes/s of score_blocks vs a device-to-device cudaMemcpy of those bytes
//   top-K        segmented_top_k, 8,192 blocks per (sequence, kv head)
//   gather       8 KB blocks host -> device: zero-copy kernel, DMA batch, one large pinned cudaMemcpy
//   Cache<cuda>  one decode step (append, prefetch, acquire, reference attention, release per
//                layer): GPU time, and the host time of the cache calls alone (enqueue overhead)
// Without a device it prints a message and exits 77.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "oasiskv/error.hpp"
#include "oasiskv/cuda/cache.cuh"
#include "oasiskv/cuda/components.cuh"
#include "oasiskv/cuda/ops.cuh"

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

}  // namespace

int main() {
  if (!gpu::device_available()) {
    std::printf("oasiskv_cuda_bench: no CUDA device\n");
    return 77;
  }
  try {
    gpu::Stream stream;
    std::vector<Row> rows;

    // ---- scoring: 8 sequences x 8 kv heads x 8,192 blocks, head_dim 128, group 8, 2 lookahead rows
    CacheConfig c;
    c.shape = ModelShape{1, 64, 8, 128};
    c.max_sequences = 8;
    c.max_tokens_per_sequence = 8192 * 16 + 64;
    c.budget_tokens = 2048;
    for (GroupReduction red : {GroupReduction::max, GroupReduction::softmax_sum}) {
      c.reduction = red;
      const CacheLayout L = CacheLayout::from(c);
      const gpu::Geometry g = gpu::Geometry::from(L);
      const int B = 8, H = 8, pairs = B * H, rowsq = 2, stride = static_cast<int>(L.max_blocks);
      const std::size_t summ_n = static_cast<std::size_t>(pairs) * static_cast<std::size_t>(L.max_blocks) * 2 * 128;
      gpu::DeviceBuffer<float> summ(summ_n), copy(summ_n);
      gpu::DeviceBuffer<float> q(static_cast<std::size_t>(B * rowsq * 64 * 128));
      std::vector<std::int32_t> slots(B);
      std::iota(slots.begin(), slots.end(), 0);
      std::vector<std::int64_t> lens(B, c.max_tokens_per_sequence);
      gpu::DeviceBuffer<std::int32_t> dslots(B, false);
      gpu::DeviceBuffer<std::int64_t> dlens(B, false);
      OASISKV_CUDA_CHECK(cudaMemcpy(dslots.data(), slots.data(), B * sizeof(std::int32_t), cudaMemcpyHostToDevice));
      OASISKV_CUDA_CHECK(cudaMemcpy(dlens.data(), lens.data(), B * sizeof(std::int64_t), cudaMemcpyHostToDevice));
      gpu::DeviceBuffer<float> scores(static_cast<std::size_t>(pairs) * stride);
      gpu::DeviceBuffer<float> bounds(red == GroupReduction::softmax_sum ? static_cast<std::size_t>(pairs) * rowsq * 8 * stride : 1);
      gpu::DeviceBuffer<std::int32_t> count(pairs), first(pairs);
      const gpu::DeviceBatch batch{B, dslots.data(), dlens.data()};
      const gpu::ScoreBuffers out{scores.data(), count.data(), first.data(), bounds.data(), stride};
      const double bytes = static_cast<double>(summ_n * sizeof(float));
      rows.push_back({std::string("scoring (") + std::string(reduction_name(red)) + ", 64 heads x 8192 blocks)",
                      time_ms(stream, [&] { gpu::score_blocks<float>(g, 0, batch, q.data(), rowsq, summ.data(), out, stream); }),
                      bytes});
      if (red == GroupReduction::max) {
        rows.push_back({"d2d cudaMemcpy of the summaries (read+write)",
                        time_ms(stream, [&] {
                          OASISKV_CUDA_CHECK(cudaMemcpyAsync(copy.data(), summ.data(), summ_n * sizeof(float),
                                                             cudaMemcpyDeviceToDevice, stream));
                        }),
                        bytes});
        // ---- top-K over the scores just computed: 64 segments x 8,192 blocks
        gpu::DeviceBuffer<std::int32_t> sel(static_cast<std::size_t>(pairs) * L.selectable_blocks), sel_count(pairs);
        rows.push_back({"top-K (K=" + std::to_string(L.selectable_blocks) + ", 64 segments x 8192 blocks)",
                        time_ms(stream, [&] {
                          gpu::segmented_top_k(scores.data(), stride, count.data(), first.data(), pairs,
                                               L.selectable_blocks, sel.data(), sel_count.data(), stream);
                        }),
                        static_cast<double>(pairs) * stride * sizeof(float)});
      }
    }

    // ---- gather: 4,096 blocks of 8 KB, scattered, host (pinned) -> device
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
    for (gpu::GatherMethod m : {gpu::GatherMethod::zero_copy_kernel, gpu::GatherMethod::dma_batch}) {
      gpu::BlockGather gather(static_cast<int>(kBlocks), m);
      rows.push_back({m == gpu::GatherMethod::zero_copy_kernel ? "gather 4096 x 8 KB h2d: zero-copy kernel"
                                                                : "gather 4096 x 8 KB h2d: DMA cudaMemcpyBatchAsync",
                      time_ms(stream, [&] { gather.run(copies, stream); }), gbytes});
    }
    rows.push_back({"one pinned cudaMemcpy h2d of the same 32 MB",
                    time_ms(stream, [&] {
                      OASISKV_CUDA_CHECK(cudaMemcpyAsync(dst.data(), host.data(), kBlocks * kBlock, cudaMemcpyHostToDevice, stream));
                    }),
                    gbytes});

    // ---- Cache<cuda>: decode steps of 8 sequences x 8 kv heads, 4 layers, 3,000-token contexts
    {
      CacheConfig cc;
      cc.shape = ModelShape{4, 32, 8, 128};
      cc.max_sequences = 8;
      cc.max_tokens_per_sequence = 4096;
      cc.budget_tokens = 1024;
      cc.fetch_ratio = 0.25;
      const int B = 8, L = cc.shape.num_layers, H = 8, nq = 32, d = 128;
      Cache<cuda, fp16_t> cache(cc, stream);
      std::vector<SeqId> batch(B);
      std::iota(batch.begin(), batch.end(), SeqId{1});
      for (SeqId id : batch) cache.add_sequence(id);
      const std::int64_t prompt = 3000;
      std::normal_distribution<float> dist(0.0f, 1.0f);
      std::vector<fp16_t> kv_host(static_cast<std::size_t>(B * prompt * H * d));
      for (auto& x : kv_host) x = to_fp16(dist(rng));
      gpu::DeviceBuffer<fp16_t> kv(kv_host.size(), false);
      OASISKV_CUDA_CHECK(cudaMemcpy(kv.data(), kv_host.data(), kv_host.size() * sizeof(fp16_t), cudaMemcpyHostToDevice));
      std::vector<float> q_host(static_cast<std::size_t>(2 * B * nq * d));
      for (auto& x : q_host) x = dist(rng);
      gpu::DeviceBuffer<float> q(q_host.size(), false), out(static_cast<std::size_t>(B * nq * d));
      OASISKV_CUDA_CHECK(cudaMemcpy(q.data(), q_host.data(), q_host.size() * sizeof(float), cudaMemcpyHostToDevice));
      const std::vector<std::int32_t> rows_prompt(B, static_cast<std::int32_t>(prompt));
      std::vector<Ticket> prev(static_cast<std::size_t>(L));
      for (int l = 0; l < L; ++l) {
        cache.append(batch, l, rows_prompt, rows_view(kv.data(), B * prompt), rows_view(kv.data(), B * prompt));
        prev[static_cast<std::size_t>(l)] = cache.prefetch(batch, l, rows_view(q.data(), B));
      }
      const float scale = 1.0f / std::sqrt(static_cast<float>(d));
      double host_ms = 0.0;
      int steps = 0;
      auto step = [&] {
        const auto t0 = std::chrono::steady_clock::now();
        for (int l = 0; l < L; ++l) {
          const auto ul = static_cast<std::size_t>(l);
          cache.append(batch, l, rows_view(kv.data(), B), rows_view(kv.data(), B));
          const Ticket next = cache.prefetch(batch, l, rows_view(q.data(), 2 * B));
          const LayerView<fp16_t> view = cache.acquire(prev[ul]);
          gpu::sparse_attention<fp16_t>(view, nq, scale, q.data(), out.data(), stream);
          cache.release(prev[ul]);
          prev[ul] = next;
        }
        cache.join();
        host_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        ++steps;
      };
      rows.push_back({"Cache<cuda> decode step (4 layers, 8 seqs x 8 kv heads), GPU", time_ms(stream, step, 9), 0.0});
      rows.push_back({"Cache<cuda> decode step: host time of the calls", host_ms / steps, 0.0});
    }

    std::printf("\n%-58s %10s %12s\n", "benchmark", "ms", "GB/s");
    for (const Row& r : rows) std::printf("%-58s %10.3f %12.1f\n", r.name.c_str(), r.ms, r.bytes / (r.ms * 1e6));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "oasiskv_cuda_bench: %s\n", e.what());
    return 1;
  }
}
