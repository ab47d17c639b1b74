// Cache<cuda>::remainder against Cache<cpu>::remainder (tests/cuda/cache_twin.hpp): the same
// appends, decode steps, truncate and fork on both caches, then for every estimate (clusters,
// quantized), element type and layer the views are identical, the device block sums (quantized:
// every full block's codes) equal the CPU's bit for bit, and the remainder
// states agree within a tolerance; a covering budget gives exactly zero mass on the device too; the
// CUDA-only refusals.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "conformance/harness.hpp"
#include "cuda/cache_twin.hpp"

namespace oasiskv::gpu_test {
namespace {

CacheConfig remainder_config(RemainderEstimate kind, int budget_tokens = 256) {
  CacheConfig c;
  c.shape = ModelShape{2, 8, 2, 64};
  c.budget_tokens = budget_tokens;  // 256: 1 sink + 3 ring + 12 selectable blocks
  c.sink_tokens = 16;
  c.recent_tokens = 32;
  c.max_sequences = 3;
  c.max_tokens_per_sequence = 2048;
  c.remainder = kind;
  return c;
}

// Tolerance. The block sums are bit-identical (checked below) and the formula is the same, but
// the device uses CUDA's expf/logf (a few ulp from glibc's) and accumulates the blocks in tiles with a running
// max (the CPU: one global max). Each is a relative float rounding of ~1e-7 per operation over
// head_dim = 64 terms and ~100 blocks: 1e-4 relative (against max(1, |x|)) is well above that and
// far below what a wrong block, weight or formula gives (order 1e-2 and more).
constexpr float kTolerance = 1e-4f;

void check_states(const std::vector<float>& got_out, const std::vector<float>& got_lse, const std::vector<float>& out,
                  const std::vector<float>& lse, int d) {
  REQUIRE(got_lse.size() == lse.size());
  for (std::size_t s = 0; s < lse.size(); ++s) {
    INFO("state " << s << ": lse " << got_lse[s] << " (device) vs " << lse[s] << " (CPU)");
    if (std::isinf(lse[s])) {  // nothing left out: exactly zero mass on both
      CHECK(got_lse[s] == lse[s]);
      for (int c = 0; c < d; ++c) CHECK(got_out[s * static_cast<std::size_t>(d) + static_cast<std::size_t>(c)] == 0.0f);
      continue;
    }
    CHECK(std::fabs(got_lse[s] - lse[s]) <= kTolerance * std::max(1.0f, std::fabs(lse[s])));
  }
  check_close(got_out, out, kTolerance);
}

// Both caches' remainder for the acquired tickets, on the same queries (float or T, alternating).
template <KvElement T>
void compare_remainder(Twin<T>& tw, std::mt19937_64& rng, const std::pair<Ticket, Ticket>& t, std::int64_t rows) {
  const auto& L = tw.cpu_cache.layout();
  const std::size_t states = static_cast<std::size_t>(rows) * static_cast<std::size_t>(L.num_q_heads());
  const std::size_t values = states * static_cast<std::size_t>(L.head_dim());
  tw.with_queries(rng, rows, [&](RowsView hq, RowsView dq) {
    std::vector<float> out(values), lse(states);
    tw.cpu_cache.remainder(t.first, hq, out, lse);
    gpu::DeviceBuffer<float> dout = filled<float>(values, 0x7f, tw.s());  // garbage: every value must be written
    gpu::DeviceBuffer<float> dlse = filled<float>(states, 0x7f, tw.s());
    tw.gpu_cache.remainder(t.second, dq, std::span<float>(dout.data(), values), std::span<float>(dlse.data(), states));
    check_states(download(dout, values, tw.s()), download(dlse, states, tw.s()), out, lse, L.head_dim());
    return 0;
  });
}

// Every block's moments on the device equal the CPU's, bit for bit.
template <KvElement T>
void check_same_moments(Twin<T>& tw, const std::vector<SeqId>& ids) {
  const auto& L = tw.cpu_cache.layout();
  if (L.remainder.moment_vectors == 0) return;  // quantized: codes instead (check_same_codes)
  const auto dev = download(gpu_clusters(tw.gpu_cache)->moments(), static_cast<std::size_t>(L.remainder.moment_floats), tw.s());
  const auto& cpu = cpu_clusters(tw.cpu_cache)->moments();
  int mismatches = 0;
  for (SeqId id : ids) {
    const int slot = tw.cpu_cache.block_table().find(id);
    REQUIRE(slot == tw.gpu_cache.block_table().find(id));
    for (int l = 0; l < L.num_layers(); ++l) {
      for (int h = 0; h < L.num_kv_heads(); ++h) {
        for (std::int64_t b = 0; b < L.blocks_for(tw.cpu_cache.sequence_length(id, l)); ++b) {
          const bool same = std::memcmp(dev.data() + L.moment_offset(slot, l, h, b),
                                        cpu.sums(slot, l, h, b),
                                        sizeof(float) * static_cast<std::size_t>(L.remainder.moment_vectors * L.head_dim())) == 0;
          if (!same && ++mismatches <= 5) {
            INFO("sequence " << id << " layer " << l << " kv head " << h << " block " << b);
            CHECK(same);
          }
        }
      }
    }
  }
  CHECK(mismatches == 0);
}

// RemainderEstimate::quantized: every full block's codes on the device equal the CPU's, byte for
// byte (the CPU codes a block when it fills; the device also keeps the partial block's).
// RemainderEstimate::clusters: the same segments clustered, with the same row ids, counts and
// sums, bit for bit (the device's k-means runs the CPU's arithmetic in the CPU's order).
template <KvElement T>
void check_same_clusters(Twin<T>& tw, const std::vector<SeqId>& ids) {
  if (cpu_clusters(tw.cpu_cache) == nullptr) return;
  const auto& cpu = cpu_clusters(tw.cpu_cache)->key_clusters();
  const gpu::DeviceClusters& dev = gpu_clusters(tw.gpu_cache)->key_clusters();
  if (cpu.segments() == 0) return;
  const auto& L = tw.cpu_cache.layout();
  REQUIRE(dev.k == cpu.clusters_per_segment());
  REQUIRE(dev.segment_rows == cpu.segment_rows());
  REQUIRE(dev.segments == cpu.segments());
  const auto units = static_cast<std::size_t>(L.config.max_sequences) * static_cast<std::size_t>(L.num_layers()) *
                     static_cast<std::size_t>(L.num_kv_heads()) * static_cast<std::size_t>(dev.segments);
  const auto k = static_cast<std::size_t>(dev.k), d = static_cast<std::size_t>(L.head_dim());
  const auto flags = download(dev.clustered, units, tw.s());
  const auto sums = download(dev.sums, units * k * 2 * d, tw.s());
  const auto counts = download(dev.counts, units * k, tw.s());
  const auto rows = download(dev.ids, units * static_cast<std::size_t>(dev.segment_rows), tw.s());
  int clustered = 0, mismatches = 0;
  for (SeqId id : ids) {
    const int slot = tw.cpu_cache.block_table().find(id);
    for (int l = 0; l < L.num_layers(); ++l) {
      for (int h = 0; h < L.num_kv_heads(); ++h) {
        for (std::int64_t s = 0; s < dev.segments; ++s) {
          const auto u = static_cast<std::size_t>(dev.unit(L, slot, l, h, s));
          INFO("sequence " << id << " layer " << l << " kv head " << h << " segment " << s);
          REQUIRE((flags[u] != 0) == cpu.clustered(slot, l, h, s));
          if (flags[u] == 0) continue;
          ++clustered;
          bool same = std::memcmp(rows.data() + u * static_cast<std::size_t>(dev.segment_rows), cpu.ids(slot, l, h, s),
                                  static_cast<std::size_t>(dev.segment_rows)) == 0;
          same = same && std::memcmp(sums.data() + u * k * 2 * d, cpu.sums(slot, l, h, s, 0), k * 2 * d * sizeof(float)) == 0;
          for (int c = 0; c < dev.k; ++c) same = same && counts[u * k + static_cast<std::size_t>(c)] == cpu.count(slot, l, h, s, c);
          if (!same && ++mismatches <= 5) CHECK(same);
        }
      }
    }
  }
  CHECK(clustered > 0);
  CHECK(mismatches == 0);
}

template <KvElement T>
void check_same_codes(Twin<T>& tw, const std::vector<SeqId>& ids) {
  const auto& L = tw.cpu_cache.layout();
  if (L.remainder.quantized_bytes == 0) return;
  const auto dev = download(gpu_quantized(tw.gpu_cache)->codes(), static_cast<std::size_t>(L.remainder.quantized_bytes), tw.s());
  const auto& cpu = cpu_quantized(tw.cpu_cache)->blocks();
  int mismatches = 0, blocks = 0;
  for (SeqId id : ids) {
    const int slot = tw.cpu_cache.block_table().find(id);
    for (int l = 0; l < L.num_layers(); ++l) {
      for (int h = 0; h < L.num_kv_heads(); ++h) {
        for (std::int64_t b = 0; b < tw.cpu_cache.sequence_length(id, l) / L.block_tokens(); ++b, ++blocks) {
          const bool same = std::memcmp(dev.data() + L.quantized_offset(slot, l, h, b),
                                        cpu.codes(slot, l, h, b),
                                        static_cast<std::size_t>(L.remainder.quantized_block_bytes)) == 0;
          if (!same && ++mismatches <= 5) {
            INFO("sequence " << id << " layer " << l << " kv head " << h << " block " << b);
            CHECK(same);
          }
        }
      }
    }
  }
  CHECK(blocks > 0);
  CHECK(mismatches == 0);
}

// prompts: the range of the two prompts' lengths (clusters: past one 1,024-token segment, so it is
// clustered at the prompt, by decode rows, forgotten by the truncate, copied by the fork).
template <KvElement T>
void run_remainder_twin(RemainderEstimate kind, const BudgetProfile* profile = nullptr,
                        std::pair<std::int32_t, std::int32_t> prompts_in = {300, 1100}) {
  OASISKV_SEEDED_RNG(rng);
  INFO("estimate " << remainder_name(kind) << (profile != nullptr ? ", with a budget profile" : ""));
  auto twin = profile != nullptr ? std::make_unique<Twin<T>>(remainder_config(kind), *profile)
                                 : std::make_unique<Twin<T>>(remainder_config(kind));
  Twin<T>& tw = *twin;
  std::vector<SeqId> batch{1, 2};
  tw.add(1);
  tw.add(2);
  const int L = tw.config.shape.num_layers;
  std::uniform_int_distribution<std::int32_t> prompt(prompts_in.first, prompts_in.second);
  const std::vector<std::int32_t> prompts{prompt(rng), prompt(rng)};
  for (int l = 0; l < L; ++l) tw.append(rng, batch, l, prompts);
  auto round = [&](std::int64_t rows) {
    check_same_moments(tw, batch);
    check_same_codes(tw, batch);
    check_same_clusters(tw, batch);
    for (int l = 0; l < L; ++l) {
      INFO("layer " << l << ", " << rows << " query rows per sequence");
      const auto t = tw.prefetch(rng, batch, l, 1);
      const LayerView<T> cv = tw.cpu_cache.acquire(t.first);
      const LayerView<T> gv = tw.gpu_cache.acquire(t.second);
      check_same_view(host_view(cv), fetch_view(gv, tw.s()));
      compare_remainder(tw, rng, t, rows * static_cast<std::int64_t>(batch.size()));
      tw.cpu_cache.release(t.first);
      tw.gpu_cache.release(t.second);
    }
  };
  round(1);
  for (int step = 0; step < 5; ++step) {  // decode rows folded into the tail blocks
    for (int l = 0; l < L; ++l) tw.append(rng, batch, l, {1, 3});
  }
  round(2);
  // A truncate mid-block (the partial block's moments refolded) and a fork mid-block (full blocks'
  // moments copied, the partial one refolded), then more rows on both.
  const std::int64_t keep = tw.cpu_cache.sequence_length(1, 0) - 21;
  tw.cpu_cache.truncate(1, keep);
  tw.gpu_cache.truncate(1, keep);
  const std::int64_t cut = tw.cpu_cache.sequence_length(2, 0) / 2 + 5;
  tw.cpu_cache.fork(2, 3, cut);
  tw.gpu_cache.fork(2, 3, cut);
  batch.push_back(3);
  for (int l = 0; l < L; ++l) tw.append(rng, batch, l, {2, 1, 7});
  round(1);
  round(3);
}

}  // namespace

OASISKV_CUDA_TEST_CASE("cuda Cache<cuda>::remainder equals Cache<cpu>::remainder (float)") {
  for (RemainderEstimate k : {RemainderEstimate::clusters, RemainderEstimate::quantized}) run_remainder_twin<float>(k);
}
OASISKV_CUDA_TEST_CASE("cuda Cache<cuda>::remainder equals Cache<cpu>::remainder (fp16)") {
  for (RemainderEstimate k : {RemainderEstimate::clusters, RemainderEstimate::quantized}) run_remainder_twin<fp16_t>(k);
}
OASISKV_CUDA_TEST_CASE("cuda Cache<cuda>::remainder equals Cache<cpu>::remainder (bf16)") {
  for (RemainderEstimate k : {RemainderEstimate::clusters, RemainderEstimate::quantized}) run_remainder_twin<bf16_t>(k);
}

// Key clusters: segments clustered on the device from their host rows, bit for bit the CPU's
// k-means (ids, sums, counts), and the estimate over clusters and blocks within float rounding.
template <KvElement T>
void run_cluster_twins() {
  for (int trial = 0; trial < 3; ++trial) {
    CAPTURE(trial);
    run_remainder_twin<T>(RemainderEstimate::clusters, nullptr, {1030, 1700});
  }
}
OASISKV_CUDA_TEST_CASE("cuda Cache<cuda>::remainder with key clusters equals Cache<cpu>'s") {
  run_cluster_twins<float>();
  run_cluster_twins<fp16_t>();
  run_cluster_twins<bf16_t>();
}

// Budgets by layer and kv head: each head leaves out a different set of blocks.
OASISKV_CUDA_TEST_CASE("cuda Cache<cuda>::remainder with a budget profile equals Cache<cpu>'s") {
  const BudgetProfile profile(2, 2, 16, {28, 4, 9, 23});  // 16 blocks a head on average: 4 pinned
  for (RemainderEstimate k : {RemainderEstimate::clusters, RemainderEstimate::quantized}) {
    run_remainder_twin<float>(k, &profile);
    run_remainder_twin<fp16_t>(k, &profile);
  }
}

// A budget that covers the sequence: every block resident, exactly zero mass (lse -inf, out 0).
OASISKV_CUDA_TEST_CASE("cuda Cache<cuda>::remainder is exactly zero mass when the budget covers the sequence") {
  OASISKV_SEEDED_RNG(rng);
  Twin<float> tw(remainder_config(RemainderEstimate::clusters, 2048));
  tw.add(1);
  for (int l = 0; l < 2; ++l) tw.append(rng, {1}, l, {700});
  const auto t = tw.prefetch(rng, {1}, 0, 1);
  (void)tw.cpu_cache.acquire(t.first);
  (void)tw.gpu_cache.acquire(t.second);
  const std::size_t states = 8, values = states * 64;
  gpu::DeviceBuffer<float> dout = filled<float>(values, 0x7f, tw.s()), dlse = filled<float>(states, 0x7f, tw.s());
  auto q = tw.rows<float>(rng, 1, tw.q_width());
  tw.gpu_cache.remainder(t.second, q.device_view(), std::span<float>(dout.data(), values), std::span<float>(dlse.data(), states));
  for (float x : download(dlse, states, tw.s())) CHECK(x == -INFINITY);
  for (float x : download(dout, values, tw.s())) CHECK(x == 0.0f);
  tw.cpu_cache.release(t.first);
  tw.gpu_cache.release(t.second);
}

// What the CUDA backend refuses beyond the CPU's checks (pageable outputs), leaving the cache as
// it was; and a cache without the estimate refuses the call on the device too.
OASISKV_CUDA_TEST_CASE("cuda Cache<cuda>::remainder refuses pageable outputs and a cache without the estimate") {
  OASISKV_SEEDED_RNG(rng);
  gpu::Stream stream;
  Cache<cuda, float> cache(remainder_config(RemainderEstimate::clusters), CudaOptions{.compute_stream = stream.get()});
  cache.add_sequence(1);
  auto k = make_rows<float>(rng, 400, 2 * 64, stream.get());
  for (int l = 0; l < 2; ++l) cache.append(std::vector<SeqId>{1}, l, std::vector<std::int32_t>{400}, k.device_view(), k.device_view());
  auto q = make_rows<float>(rng, 1, 8 * 64, stream.get());
  const Ticket t = cache.prefetch(std::vector<SeqId>{1}, 0, q.device_view());
  (void)cache.acquire(t);
  gpu::DeviceBuffer<float> dout(8 * 64), dlse(8);
  std::vector<float> pageable(8 * 64), pageable_lse(8);
  const std::uint64_t before = test::cache_fingerprint(cache, {1});
  CHECK_THROWS_WITH_AS(cache.remainder(t, q.device_view(), pageable, std::span<float>(dlse.data(), 8)),
                       doctest::Contains("remainder: out ("), Error);
  CHECK_THROWS_WITH_AS(cache.remainder(t, q.device_view(), std::span<float>(dout.data(), 8 * 64), pageable_lse),
                       doctest::Contains("remainder: lse ("), Error);
  CHECK(test::cache_fingerprint(cache, {1}) == before);
  cache.remainder(t, q.device_view(), std::span<float>(dout.data(), 8 * 64), std::span<float>(dlse.data(), 8));
  cache.release(t);

  Cache<cuda, float> off(remainder_config(RemainderEstimate::none), CudaOptions{.compute_stream = stream.get()});
  off.add_sequence(1);
  off.append(std::vector<SeqId>{1}, 0, std::vector<std::int32_t>{400}, k.device_view(), k.device_view());
  const Ticket u = off.prefetch(std::vector<SeqId>{1}, 0, q.device_view());
  (void)off.acquire(u);
  CHECK_THROWS_WITH_AS(off.remainder(u, q.device_view(), std::span<float>(dout.data(), 8 * 64), std::span<float>(dlse.data(), 8)),
                       doctest::Contains("CacheConfig::remainder is none"), Error);
  off.release(u);
}

}  // namespace oasiskv::gpu_test
