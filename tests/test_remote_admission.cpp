// Cache::admit on the CPU backend with an in-memory RemoteBlockSource (the UCX one is tested in
// tests/ucx): a remote-backed sequence decodes exactly as a single-process twin (with every
// scorer (the runs scorer's run sums travel), with a remainder estimate whose moments the message carries, into a cache with budgets
// by layer and kv head); a failing source
// fails its sequence only; a bad message, a missing source or a full pool admits nothing; a
// truncate into the remote blocks is refused.
#include <oasiskv/cpu/admission_export.hpp>
#include <oasiskv/cache.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <random>

#include "remote_decode.hpp"
#include "support.hpp"

using namespace oasiskv;

TEST_SUITE_BEGIN("pipeline");  // the copy worker reads remote blocks: also under TSan

namespace {

// The "prefill side's" exported copy of a sequence's blocks, read by memcpy.
class MemorySource final : public RemoteBlockSource {
 public:
  std::vector<std::byte> region;
  std::atomic<bool> failing{false};
  std::atomic<int> reads{0};
  void read(std::span<const RemoteBlockRead> reads_) override {
    if (failing) fail("memory source: the peer is gone");
    const auto base = reinterpret_cast<std::uint64_t>(region.data());
    for (const RemoteBlockRead& r : reads_) {
      REQUIRE(r.remote >= base);
      REQUIRE(r.remote + r.bytes <= base + region.size());
      std::memcpy(r.local, reinterpret_cast<const void*>(r.remote), r.bytes);
    }
    reads += static_cast<int>(reads_.size());
  }
};

std::shared_ptr<MemorySource> export_to_memory(const Cache<cpu, float>& prefill, SeqId id, AdmissionMessage& m) {
  auto source = std::make_shared<MemorySource>();
  const auto blocks = host_blocks_of(prefill, id);
  const std::size_t bytes = prefill.host_tier().pool_block_bytes();
  source->region.resize(std::max<std::size_t>(1, blocks.size()) * bytes);
  for (std::size_t b = 0; b < blocks.size(); ++b) std::memcpy(source->region.data() + b * bytes, blocks[b], bytes);
  m.request_id = 42;
  m.region_base = reinterpret_cast<std::uint64_t>(source->region.data());
  m.region_bytes = source->region.size();
  m.block_addresses.clear();
  for (std::size_t b = 0; b < blocks.size(); ++b) m.block_addresses.push_back(m.region_base + b * bytes);
  m.packed_rkey.assign(4, std::byte{1});
  return source;
}

CacheConfig remote_config() {
  CacheConfig c = test::small_config(128, 2048, 3);
  c.fetch_ratio = 0.25;
  return c;
}

// A cache holding one random sequence of `length` tokens, and its admission message.
struct Prefilled {
  Cache<cpu, float> cache;
  AdmissionMessage message;
  std::shared_ptr<MemorySource> source;
  Prefilled(std::mt19937_64& rng, const CacheConfig& config, std::int64_t length) : cache(config) {
    const CacheLayout& L = cache.layout();
    const SeqId id = 1;
    cache.add_sequence(id);
    const std::int32_t rows[] = {static_cast<std::int32_t>(length)};
    for (int l = 0; l < L.num_layers(); ++l) {
      const auto k = test::random_rows<float>(rng, static_cast<std::size_t>(length * L.row_elems));
      cache.append(std::span(&id, 1), l, rows, rows_view(k.data(), length), rows_view(k.data(), length));
    }
    const auto q = test::random_rows<float>(rng, static_cast<std::size_t>(L.num_layers() * L.q_row_elems));
    message = make_admission(cache, id, q, 1);
    source = export_to_memory(cache, id, message);
    message = decode_admission(encode_admission(message));
  }
};

// check_remote_decode with the blocks exported to memory: its result and the source (its reads).
struct MemoryDecode {
  test::RemoteDecodeResult result;
  std::shared_ptr<MemorySource> source;
};
MemoryDecode decode_from_memory(std::mt19937_64& rng, const CacheConfig& config, std::int64_t prompt, int steps,
                                const BudgetProfile* decode_profile = nullptr) {
  MemoryDecode out;
  out.result = test::check_remote_decode(
      rng, config, prompt, steps,
      [&](const Cache<cpu, float>& p, SeqId id, AdmissionMessage& m) {
        CHECK(m.moment_vectors == CacheLayout::from(config).remainder.moment_vectors);  // the moments travel when kept
        CHECK(m.run_tokens == (config.scorer == BlockScore::runs ? config.run_tokens : 0));  // so do the run sums
        // and so do the prompt's key clusters
        CHECK(m.cluster_segments ==
              (config.remainder == RemainderEstimate::clusters ? prompt / (kClusterSegmentBlocks * config.block_tokens) : 0));
        out.source = export_to_memory(p, id, m);
        return out.source;
      },
      decode_profile);
  return out;
}

}  // namespace

TEST_CASE("a remote-backed sequence decodes as its single-process twin with every view holding the true rows") {
  OASISKV_SEEDED_RNG(rng);
  for (std::int64_t prompt : {40, 300, 777}) {
    CAPTURE(prompt);
    const auto [result, kept] = decode_from_memory(rng, remote_config(), prompt, 60);
    CHECK(result.steps == 60);
    // The decode side holds its sinks, ring and new rows only: less than the prompt's pool.
    if (prompt > 300) {
      CHECK(result.decode_host_bytes < result.prefill_host_bytes / 2);
      CHECK(kept->reads > 0);  // the later plans read remote blocks
      CHECK(result.remote_blocks_fetched == static_cast<std::uint64_t>(kept->reads));
      CHECK(result.remote_blocks_fetched <= result.blocks_fetched);
    }
  }
}

TEST_CASE("a remote-backed sequence decodes as its twin with every block scorer (working set and later plans)") {
  OASISKV_SEEDED_RNG(rng);
  for (BlockScore scorer : {BlockScore::quest, BlockScore::spread, BlockScore::runs}) {
    CAPTURE(block_score_name(scorer));
    CacheConfig c = remote_config();
    c.scorer = scorer;
    c.spread_alpha = 0.3f;
    // 502 tokens: the prompt ends inside a run (2 of its 4 rows), which the decode rows complete.
    const auto [result, kept] = decode_from_memory(rng, c, 502, 40);
    CHECK(result.steps == 40);
    CHECK(kept->reads > 0);
  }
}

TEST_CASE("a remote-backed sequence's remainder estimate is its twin's: the block sums and key clusters travel in the message") {
  OASISKV_SEEDED_RNG(rng);
  // Under a segment (block sums only), and one whole segment and a partial one (its clusters too).
  for (auto [remainder, prompt] : {std::pair{RemainderEstimate::clusters, 700}, std::pair{RemainderEstimate::clusters, 1500}}) {
    CAPTURE(remainder_name(remainder));
    CacheConfig c = remote_config();
    c.remainder = remainder;
    const auto [result, kept] = decode_from_memory(rng, c, prompt, 30);
    CHECK(result.steps == 30);
    CHECK(result.remainder_mass > 0.0);  // blocks were left out, and the estimate saw them
  }
}

TEST_CASE("a decode cache with budgets by layer and kv head admits from a uniform prefill cache and decodes as its twin") {
  OASISKV_SEEDED_RNG(rng);
  const CacheConfig c = remote_config();  // 2 layers x 2 kv heads, 8 blocks each: 32 in all
  const BudgetProfile profile(2, 2, 16, {12, 5, 4, 11});
  const auto [result, kept] = decode_from_memory(rng, c, 650, 40, &profile);
  CHECK(result.steps == 40);
  CHECK(kept->reads > 0);  // the heads with more than the uniform budget read beyond the working set
}

TEST_CASE("a failing remote source fails its sequence at acquire while the other sequence goes on") {
  OASISKV_SEEDED_RNG(rng);
  const CacheConfig config = remote_config();
  Prefilled a(rng, config, 700), b(rng, config, 500);
  Cache<cpu, float> decode(config);
  const CacheLayout& L = decode.layout();
  std::vector<Ticket> ta = decode.admit(10, a.message, a.source);
  std::vector<Ticket> tb = decode.admit(20, b.message, b.source);
  // One ticket per layer for both: acquire what each admission planned, then plan both together.
  const SeqId both[] = {10, 20};
  std::vector<Ticket> t(static_cast<std::size_t>(L.num_layers()));
  for (int l = 0; l < L.num_layers(); ++l) {
    for (const Ticket* x : {&ta[static_cast<std::size_t>(l)], &tb[static_cast<std::size_t>(l)]}) {
      (void)decode.acquire(*x);
      decode.release(*x);
    }
  }
  a.source->failing = true;
  bool failed = false;
  std::string why;
  for (int step = 0; step < 40 && !failed; ++step) {
    for (int l = 0; l < L.num_layers() && !failed; ++l) {
      const auto q = test::random_rows<float>(rng, static_cast<std::size_t>(2 * L.q_row_elems), 4.0f);
      const Ticket next = decode.prefetch(both, l, rows_view(q.data(), 2));
      try {
        (void)decode.acquire(next);
        decode.release(next);
      } catch (const Error& e) {
        failed = true;
        why = e.what();
      }
    }
  }
  REQUIRE(failed);
  CHECK(why.find("sequence 10 failed") != std::string::npos);
  CHECK(why.find("the peer is gone") != std::string::npos);
  decode.remove_sequence(10);
  // Sequence 20 goes on, its views holding its rows (the prompt's rows, K = V as appended above).
  const int reads_before = b.source->reads;
  for (int step = 0; step < 20; ++step) {
    for (int l = 0; l < L.num_layers(); ++l) {
      const auto q = test::random_rows<float>(rng, static_cast<std::size_t>(L.q_row_elems), 4.0f);
      const SeqId only[] = {20};
      const Ticket next = decode.prefetch(only, l, rows_view(q.data(), 1));
      const LayerView<float> view = decode.acquire(next);
      const int H = L.num_kv_heads();
      for (std::int32_t e = 0; e < view.indptr[H]; ++e) {
        CHECK(std::memcmp(view.keys(e), view.values(e), sizeof(float) * static_cast<std::size_t>(L.head_dim())) == 0);
      }
      decode.release(next);
    }
  }
  CHECK(b.source->reads > reads_before);
  CHECK_FALSE(decode.has_sequence(10));
}

TEST_CASE("an admission that does not fit is refused and admits nothing") {
  OASISKV_SEEDED_RNG(rng);
  const CacheConfig config = remote_config();
  Prefilled p(rng, config, 600);
  Cache<cpu, float> decode(config);
  const auto unchanged = [&] {
    CHECK_FALSE(decode.has_sequence(5));
    CHECK(decode.num_sequences() == 0);
    CHECK(decode.statistics().host_blocks_in_use == 0);
  };
  CHECK_THROWS_WITH_AS(decode.admit(5, p.message, nullptr), doctest::Contains("no RemoteBlockSource was given"), Error);
  unchanged();
  AdmissionMessage short_map = p.message;  // built in memory: its counts are checked all the same
  short_map.block_addresses.pop_back();
  CHECK_THROWS_WITH_AS(decode.admit(5, short_map, p.source), doctest::Contains("remote block addresses"), Error);
  unchanged();
  AdmissionMessage no_ring = p.message;
  no_ring.working_set_counts[0] -= 1;  // drops the last (a ring) block of (layer 0, kv head 0)
  no_ring.working_set_blocks.erase(no_ring.working_set_blocks.begin() + no_ring.working_set_counts[0]);
  no_ring.working_set_rows.resize(no_ring.working_set_rows.size() - static_cast<std::size_t>(decode.layout().block_elems) * 4);
  CHECK_THROWS_WITH_AS(decode.admit(5, no_ring, p.source), doctest::Contains("lacks block"), Error);
  unchanged();
  // Impossible bounds: block 3 of (layer 1, kv head 1) with its max and min channels swapped.
  AdmissionMessage swapped = p.message;
  {
    const auto& shape = config.shape;
    const std::int64_t d = shape.head_dim, blocks = decode.layout().blocks_for(p.message.length);
    const std::int64_t h = 1 * shape.num_kv_heads + 1;
    float* mx = swapped.summaries.data() + (h * blocks + 3) * 2 * d;
    std::swap_ranges(mx, mx + d, mx + d);
    int wider = 0;  // a channel whose max was above its min: now below, and refused
    for (std::int64_t c = 0; c < d; ++c) wider += mx[c] < mx[d + c];
    REQUIRE(wider > 0);
  }
  CHECK_THROWS_WITH_AS(decode.admit(5, swapped, p.source),
                       doctest::Contains("the summary of block 3 (layer 1, kv head 1) has channel"), Error);
  CHECK_THROWS_WITH_AS(decode.admit(5, swapped, p.source), doctest::Contains("below its min"), Error);
  unchanged();
  CHECK_THROWS_WITH_AS(decode_admission(encode_admission(swapped)), doctest::Contains("below its min"), Error);
  CHECK_NOTHROW(decode_admission(encode_admission(p.message)));  // the real summaries pass
  CacheConfig other = config;
  other.shape.head_dim = 32;
  Cache<cpu, float> wide(other);
  CHECK_THROWS_WITH_AS(wide.admit(5, p.message, p.source), doctest::Contains("is not the cache's"), Error);
  CHECK(wide.num_sequences() == 0);
  CacheConfig tiny = config;
  tiny.host_pool_blocks = 3;
  Cache<cpu, float> small(tiny);
  CHECK_THROWS_WITH_AS(small.admit(5, p.message, p.source), doctest::Contains("the host pool is exhausted"), Error);
  CHECK(small.num_sequences() == 0);
  CHECK(small.statistics().host_blocks_in_use == 0);
  // A decode cache with a remainder estimate, and a prefill cache that kept no block sums.
  CacheConfig wanting = config;
  wanting.remainder = RemainderEstimate::clusters;
  Cache<cpu, float> estimating(wanting);
  CHECK_THROWS_WITH_AS(estimating.admit(5, p.message, p.source), doctest::Contains("the message carries none"), Error);
  CHECK(estimating.num_sequences() == 0);
  CHECK(estimating.statistics().host_blocks_in_use == 0);
}

TEST_CASE("a remote-backed sequence refuses a truncate or fork into its remote blocks and forks above them") {
  OASISKV_SEEDED_RNG(rng);
  const CacheConfig config = remote_config();
  Prefilled p(rng, config, 600);
  Cache<cpu, float> decode(config);
  (void)decode.admit(5, p.message, p.source);
  CHECK_THROWS_WITH_AS(decode.truncate(5, 300), doctest::Contains("are remote"), Error);
  CHECK(decode.sequence_length(5, 0) == 600);
  CHECK_THROWS_WITH_AS(decode.fork(5, 6, 100), doctest::Contains("are remote"), Error);
  CHECK_FALSE(decode.has_sequence(6));
  CHECK_NOTHROW(decode.truncate(5, 599));
  CHECK_NOTHROW(decode.fork(5, 6));
  decode.remove_sequence(5);
  // The fork keeps the remote source: its plans still read the prompt's blocks.
  const int before = p.source->reads;
  const CacheLayout& L = decode.layout();
  for (int l = 0; l < L.num_layers(); ++l) {
    for (int step = 0; step < 6; ++step) {
      const auto q = test::random_rows<float>(rng, static_cast<std::size_t>(L.q_row_elems), 4.0f);
      const SeqId only[] = {6};
      const Ticket t = decode.prefetch(only, l, rows_view(q.data(), 1));
      const LayerView<float> view = decode.acquire(t);
      for (std::int32_t e = 0; e < view.indptr[L.num_kv_heads()]; ++e) {
        CHECK(std::memcmp(view.keys(e), view.values(e), sizeof(float) * static_cast<std::size_t>(L.head_dim())) == 0);
      }
      decode.release(t);
    }
  }
  CHECK(p.source->reads > before);
}
TEST_SUITE_END();
