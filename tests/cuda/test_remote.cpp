// Cache<cuda>::admit against Cache<cpu>::admit (the remote tier; oasiskv/cuda/detail/remote_reads.hpp):
// the same admission message, blocks read through in-memory sources, the same decode calls: the
// views and their rows are identical at every step, the remote blocks came through the host
// functions' staging, and a source that fails fails its sequence at acquire on both backends.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

#include "cuda/cache_twin.hpp"
#include "oasiskv/cpu/admission_export.hpp"

namespace oasiskv::gpu_test {
namespace {

class MemorySource final : public RemoteBlockSource {
 public:
  explicit MemorySource(std::shared_ptr<const std::vector<std::byte>> region) : region_(std::move(region)) {}
  std::atomic<bool> failing{false};
  std::atomic<int> reads{0};
  void read(std::span<const RemoteBlockRead> reads_) override {
    if (failing) fail("memory source: the peer is gone");
    for (const RemoteBlockRead& r : reads_) std::memcpy(r.local, reinterpret_cast<const void*>(r.remote), r.bytes);
    reads += static_cast<int>(reads_.size());
  }

 private:
  std::shared_ptr<const std::vector<std::byte>> region_;
};

CacheConfig remote_config() {
  CacheConfig c;
  c.shape = ModelShape{2, 8, 2, 64};
  c.budget_tokens = 256;
  c.sink_tokens = 16;
  c.recent_tokens = 32;
  c.fetch_ratio = 0.25;
  c.max_sequences = 2;
  c.max_tokens_per_sequence = 2048;
  return c;
}

// A prefill cache's sequence as an admission message, its blocks exported to one region.
struct Exported {
  AdmissionMessage message;
  std::shared_ptr<std::vector<std::byte>> region;
};
Exported export_sequence(std::mt19937_64& rng, const CacheConfig& config, std::int64_t length) {
  Cache<cpu, float> prefill(config);
  const CacheLayout& L = prefill.layout();
  const SeqId id = 1;
  prefill.add_sequence(id);
  const std::int32_t rows[] = {static_cast<std::int32_t>(length)};
  for (int l = 0; l < L.num_layers(); ++l) {
    const auto k = test::random_rows<float>(rng, static_cast<std::size_t>(length * L.row_elems));
    const auto v = test::random_rows<float>(rng, k.size());
    prefill.append(std::span(&id, 1), l, rows, rows_view(k.data(), length), rows_view(v.data(), length));
  }
  const auto q = test::random_rows<float>(rng, static_cast<std::size_t>(L.num_layers() * L.q_row_elems), 2.0f);
  Exported e;
  e.message = make_admission(prefill, id, q, 1);
  const auto blocks = host_blocks_of(prefill, id);
  const std::size_t bytes = prefill.host_tier().pool_block_bytes();
  e.region = std::make_shared<std::vector<std::byte>>(blocks.size() * bytes);
  for (std::size_t b = 0; b < blocks.size(); ++b) std::memcpy(e.region->data() + b * bytes, blocks[b], bytes);
  e.message.request_id = 7;
  e.message.region_base = reinterpret_cast<std::uint64_t>(e.region->data());
  e.message.region_bytes = e.region->size();
  for (std::size_t b = 0; b < blocks.size(); ++b) e.message.block_addresses.push_back(e.message.region_base + b * bytes);
  e.message.packed_rkey.assign(4, std::byte{1});
  e.message = decode_admission(encode_admission(e.message));
  return e;
}

// Identical views (blocks, slots) and identical rows in their slots.
void check_same(const Cache<cpu, float>& cpu_cache, const LayerView<float>& cv, const LayerView<float>& gv,
                cudaStream_t s) {
  const CacheLayout& L = cpu_cache.layout();
  const HostView want = host_view(cv);
  const HostView got = fetch_view(gv, s);
  check_same_view(want, got);
  const auto pool = download(gv.pool, static_cast<std::size_t>(L.layer_slots(gv.layer) * L.block_elems), s);
  int mismatches = 0;
  for (std::size_t e = 0; e < want.slot.size(); ++e) {
    const float* a = cv.keys(static_cast<std::int32_t>(e));
    const float* b = pool.data() + static_cast<std::int64_t>(got.slot[e]) * L.block_elems;
    const auto n = static_cast<std::size_t>(want.valid[e]) * static_cast<std::size_t>(L.head_dim()) * sizeof(float);
    const std::int64_t v = static_cast<std::int64_t>(L.block_tokens()) * L.head_dim();
    mismatches += (std::memcmp(a, b, n) != 0 || std::memcmp(a + v, b + v, n) != 0) ? 1 : 0;
  }
  CHECK(mismatches == 0);
}

// Acquires the CPU and the CUDA cache's tickets, checks their views the same, releases both.
void check_same_tickets(Twin<float>& tw, Ticket cpu_ticket, Ticket gpu_ticket) {
  const LayerView<float> cv = tw.cpu_cache.acquire(cpu_ticket);
  const LayerView<float> gv = tw.gpu_cache.acquire(gpu_ticket);
  check_same(tw.cpu_cache, cv, gv, tw.s());
  tw.cpu_cache.release(cpu_ticket);
  tw.gpu_cache.release(gpu_ticket);
}

}  // namespace

OASISKV_CUDA_TEST_CASE("cuda Cache<cuda> admitted from another process equals Cache<cpu> and a failing source fails its sequence") {
  OASISKV_SEEDED_RNG(rng);
  const CacheConfig config = remote_config();
  Twin<float> tw(config);
  const Exported a = export_sequence(rng, config, 700), b = export_sequence(rng, config, 450);
  auto cpu_a = std::make_shared<MemorySource>(a.region), gpu_a = std::make_shared<MemorySource>(a.region);
  auto cpu_b = std::make_shared<MemorySource>(b.region), gpu_b = std::make_shared<MemorySource>(b.region);
  const int L = config.shape.num_layers;
  std::vector<std::pair<Ticket, Ticket>> first(static_cast<std::size_t>(L));
  for (auto [id, m, cs, gs] : {std::tuple{SeqId{10}, &a.message, cpu_a, gpu_a}, std::tuple{SeqId{20}, &b.message, cpu_b, gpu_b}}) {
    const auto ct = tw.cpu_cache.admit(id, *m, cs);
    const auto gt = tw.gpu_cache.admit(id, *m, gs);
    REQUIRE(ct.size() == gt.size());
    for (int l = 0; l < L; ++l) {
      check_same_tickets(tw, ct[static_cast<std::size_t>(l)], gt[static_cast<std::size_t>(l)]);
    }
  }
  std::vector<SeqId> batch{10, 20};
  for (int step = 0; step < 12; ++step) {
    INFO("step " << step);
    for (int l = 0; l < L; ++l) {
      tw.append(rng, batch, l, {1, 1});
      const auto t = tw.prefetch(rng, batch, l, 1);
      check_same_tickets(tw, t.first, t.second);
    }
  }
  CHECK(gpu_a->reads > 0);  // remote blocks came through the host functions
  CHECK(gpu_a->reads == cpu_a->reads);
  CHECK(gpu_b->reads == cpu_b->reads);
  CHECK(tw.gpu_cache.statistics().total().remote_blocks_fetched == tw.cpu_cache.statistics().total().remote_blocks_fetched);
  CHECK(tw.cpu_cache.statistics().total().remote_blocks_fetched == static_cast<std::uint64_t>(cpu_a->reads + cpu_b->reads));

  // The source of sequence 10 fails: both caches fail 10 at acquire, and 20 goes on.
  cpu_a->failing = true;
  gpu_a->failing = true;
  bool cpu_failed = false, gpu_failed = false;
  for (int step = 0; step < 30 && !(cpu_failed && gpu_failed); ++step) {
    for (int l = 0; l < L; ++l) {
      tw.append(rng, batch, l, {1, 1});
      const auto t = tw.prefetch(rng, batch, l, 1);
      try {
        (void)tw.cpu_cache.acquire(t.first);
        tw.cpu_cache.release(t.first);
      } catch (const Error& e) {
        cpu_failed = true;
        CHECK(std::string(e.what()).find("sequence 10 failed") != std::string::npos);
      }
      try {
        (void)tw.gpu_cache.acquire(t.second);
        tw.gpu_cache.release(t.second);
      } catch (const Error& e) {
        gpu_failed = true;
        CHECK(std::string(e.what()).find("sequence 10 failed") != std::string::npos);
      }
    }
  }
  CHECK(cpu_failed);
  CHECK(gpu_failed);
  tw.remove(10);
  for (int l = 0; l < L; ++l) {
    tw.append(rng, {20}, l, {1});
    const auto t = tw.prefetch(rng, {20}, l, 1);
    check_same_tickets(tw, t.first, t.second);
  }
}

// Under the runs scorer the message carries the run sums: the device's first plans and later
// plans (the prompt ends inside a run, which the decode rows complete) equal Cache<cpu>'s.
OASISKV_CUDA_TEST_CASE("cuda Cache<cuda> with scorer runs admitted from another process equals Cache<cpu>") {
  OASISKV_SEEDED_RNG(rng);
  CacheConfig config = remote_config();
  config.scorer = BlockScore::runs;
  Twin<float> tw(config);
  const Exported a = export_sequence(rng, config, 702);
  REQUIRE(a.message.run_tokens == config.run_tokens);
  auto cpu_a = std::make_shared<MemorySource>(a.region), gpu_a = std::make_shared<MemorySource>(a.region);
  const int L = config.shape.num_layers;
  const auto ct = tw.cpu_cache.admit(10, a.message, cpu_a);
  const auto gt = tw.gpu_cache.admit(10, a.message, gpu_a);
  REQUIRE(ct.size() == gt.size());
  for (int l = 0; l < L; ++l) {
    check_same_tickets(tw, ct[static_cast<std::size_t>(l)], gt[static_cast<std::size_t>(l)]);
  }
  for (int step = 0; step < 12; ++step) {
    INFO("step " << step);
    for (int l = 0; l < L; ++l) {
      tw.append(rng, {10}, l, {1});
      const auto t = tw.prefetch(rng, {10}, l, 1);
      check_same_tickets(tw, t.first, t.second);
    }
  }
  CHECK(gpu_a->reads == cpu_a->reads);
}

// A decode cache with budgets by layer and kv head admits a message from a uniform prefill cache
// (its working set sized for the uniform budget): per-head first plans, pinned slots and remote
// reads equal Cache<cpu>'s with the same profile.
OASISKV_CUDA_TEST_CASE("cuda Cache<cuda> with a budget profile admitted from another process equals Cache<cpu>") {
  OASISKV_SEEDED_RNG(rng);
  const CacheConfig config = remote_config();  // 16 blocks a head: 4 pinned
  const BudgetProfile profile(2, 2, 16, {26, 6, 10, 22});
  Twin<float> tw(config, profile);
  const Exported a = export_sequence(rng, config, 900);
  auto cpu_a = std::make_shared<MemorySource>(a.region), gpu_a = std::make_shared<MemorySource>(a.region);
  const auto ct = tw.cpu_cache.admit(10, a.message, cpu_a);
  const auto gt = tw.gpu_cache.admit(10, a.message, gpu_a);
  const int L = config.shape.num_layers;
  REQUIRE(ct.size() == gt.size());
  for (int l = 0; l < L; ++l) {
    check_same(tw.cpu_cache, tw.cpu_cache.acquire(ct[static_cast<std::size_t>(l)]),
               tw.gpu_cache.acquire(gt[static_cast<std::size_t>(l)]), tw.s());
    tw.cpu_cache.release(ct[static_cast<std::size_t>(l)]);
    tw.gpu_cache.release(gt[static_cast<std::size_t>(l)]);
  }
  for (int step = 0; step < 10; ++step) {
    INFO("step " << step);
    for (int l = 0; l < L; ++l) {
      tw.append(rng, {10}, l, {1});
      const auto t = tw.prefetch(rng, {10}, l, 1);
      check_same(tw.cpu_cache, tw.cpu_cache.acquire(t.first), tw.gpu_cache.acquire(t.second), tw.s());
      tw.cpu_cache.release(t.first);
      tw.gpu_cache.release(t.second);
    }
  }
  CHECK(gpu_a->reads > 0);
  CHECK(gpu_a->reads == cpu_a->reads);
  check_same_statistics(tw.cpu_cache.statistics(), tw.gpu_cache.statistics());
}

namespace {

// A decode cache with a remainder estimate admits a prompt of `length` tokens (moments travel; with
// clusters, the prompt's clustered segments too): moments bit for bit and the estimate within
// float rounding, through decode steps.
void admit_with_estimate(RemainderEstimate kind, std::int64_t length) {
  OASISKV_SEEDED_RNG(rng);
  CAPTURE(remainder_name(kind));
  CacheConfig config = remote_config();
  config.remainder = kind;
  Twin<float> tw(config);
  const Exported a = export_sequence(rng, config, length);  // the prefill cache keeps moments: they travel
  REQUIRE(a.message.moment_vectors == 2);
  if (kind == RemainderEstimate::clusters) REQUIRE(a.message.cluster_segments == length / 1024);
  auto cs = std::make_shared<MemorySource>(a.region), gs = std::make_shared<MemorySource>(a.region);
  const auto ct = tw.cpu_cache.admit(10, a.message, cs);
  const auto gt = tw.gpu_cache.admit(10, a.message, gs);
  const int layers = config.shape.num_layers;
  for (int l = 0; l < layers; ++l) {
    (void)tw.cpu_cache.acquire(ct[static_cast<std::size_t>(l)]);
    (void)tw.gpu_cache.acquire(gt[static_cast<std::size_t>(l)]);
    tw.cpu_cache.release(ct[static_cast<std::size_t>(l)]);
    tw.gpu_cache.release(gt[static_cast<std::size_t>(l)]);
  }
  const CacheLayout& L = tw.cpu_cache.layout();
  const int slot = tw.cpu_cache.block_table().find(10);
  REQUIRE(slot == tw.gpu_cache.block_table().find(10));
  for (int step = 0; step < 6; ++step) {
    INFO("step " << step);
    for (int l = 0; l < layers; ++l) {
      tw.append(rng, {10}, l, {1});
      // Every block's moments: the message's, then the decode rows' folds, bit for bit.
      const auto dev = download(gpu_clusters(tw.gpu_cache)->moments(), static_cast<std::size_t>(L.remainder.moment_floats), tw.s());
      int mismatches = 0;
      for (int h = 0; h < L.num_kv_heads(); ++h) {
        for (std::int64_t b = 0; b < L.blocks_for(tw.cpu_cache.sequence_length(10, l)); ++b) {
          mismatches += std::memcmp(dev.data() + L.moment_offset(slot, l, h, b),
                                    cpu_clusters(tw.cpu_cache)->moments().sums(slot, l, h, b),
                                    sizeof(float) * static_cast<std::size_t>(L.remainder.moment_vectors * L.head_dim())) != 0;
        }
      }
      CHECK(mismatches == 0);
      const auto t = tw.prefetch(rng, {10}, l, 1);
      const LayerView<float> cv = tw.cpu_cache.acquire(t.first);
      const LayerView<float> gv = tw.gpu_cache.acquire(t.second);
      check_same(tw.cpu_cache, cv, gv, tw.s());
      const auto states = static_cast<std::size_t>(L.num_q_heads());
      auto q = make_rows<float>(rng, 1, static_cast<int>(L.q_row_elems), tw.s(), 2.0f);
      std::vector<float> out(states * static_cast<std::size_t>(L.head_dim())), lse(states);
      tw.cpu_cache.remainder(t.first, q.host_view(), out, lse);
      gpu::DeviceBuffer<float> dout(out.size()), dlse(states);
      tw.gpu_cache.remainder(t.second, q.device_view(), std::span<float>(dout.data(), out.size()),
                             std::span<float>(dlse.data(), states));
      const auto got_lse = download(dlse, tw.s());
      for (std::size_t i = 0; i < states; ++i) {
        INFO("state " << i);
        REQUIRE(std::isfinite(lse[i]));  // the prompt's middle blocks are left out
        CHECK(std::fabs(got_lse[i] - lse[i]) <= 1e-4f * std::max(1.0f, std::fabs(lse[i])));
      }
      check_close(download(dout, tw.s()), out, 1e-4f);
      tw.cpu_cache.release(t.first);
      tw.gpu_cache.release(t.second);
    }
  }
  CHECK(gs->reads == cs->reads);
}

}  // namespace

OASISKV_CUDA_TEST_CASE("cuda Cache<cuda> admitted with a remainder estimate: its device moments and estimate equal Cache<cpu>'s") {
  admit_with_estimate(RemainderEstimate::clusters, 700);
  admit_with_estimate(RemainderEstimate::clusters, 1300);  // its first segment clustered: it travels
}

}  // namespace oasiskv::gpu_test
