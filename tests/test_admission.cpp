// The admission message of prefill-decode disaggregation (oasiskv/admission.hpp): a message
// round-trips exactly, and every truncation, every flipped byte, another version and every
// inconsistent count are refused with an Error naming what is wrong.
#include <oasiskv/admission.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>

#include "support.hpp"

using namespace oasiskv;

namespace {

// A consistent message for `layout` (fp16), its fields random.
AdmissionMessage random_message(const CacheLayout& L, std::int64_t length, std::mt19937_64& rng) {
  AdmissionMessage m;
  m.request_id = rng();
  m.shape = L.config.shape;
  m.block_tokens = L.block_tokens();
  m.dtype = DType::f16;
  m.length = length;
  const std::int64_t blocks = L.blocks_for(length);
  const int heads = L.num_layers() * L.num_kv_heads();
  m.summaries = test::random_summaries(rng, static_cast<std::size_t>(heads * blocks), L.head_dim());
  m.moment_vectors = L.remainder.moment_vectors;
  m.moments = test::random_rows<float>(rng, static_cast<std::size_t>(heads * blocks * L.remainder.moment_vectors * L.head_dim()));
  if (L.score.runs > 0) {  // the runs scorer's run key sums
    m.run_tokens = L.config.run_tokens;
    m.run_sums = test::random_rows<float>(rng, static_cast<std::size_t>(heads * blocks * L.score.runs * L.head_dim()));
  }
  if (L.config.remainder == RemainderEstimate::clusters) {  // the whole segments' key clusters
    const int rows = kClusterSegmentBlocks * L.block_tokens(), k = rows / L.config.remainder_cluster_rows;
    m.cluster_rows = L.config.remainder_cluster_rows;
    m.cluster_segments = static_cast<std::int32_t>(blocks / kClusterSegmentBlocks);
    for (int u = 0; u < heads * m.cluster_segments; ++u) {
      std::vector<std::int32_t> counts(static_cast<std::size_t>(k), 0);
      for (int r = 0; r < rows; ++r) {
        m.cluster_ids.push_back(static_cast<std::uint8_t>(rng() % static_cast<std::uint64_t>(k)));
        counts[m.cluster_ids.back()] += 1;
      }
      m.cluster_counts.insert(m.cluster_counts.end(), counts.begin(), counts.end());
    }
    m.cluster_sums = test::random_rows<float>(rng, static_cast<std::size_t>(heads * m.cluster_segments * k * 2 * L.head_dim()));
  }
  for (int p = 0; p < heads; ++p) {
    // The sinks and the ring always (check_admission wants them), then random others.
    std::vector<std::int32_t> ids;
    for (std::int32_t b = 0; b < blocks; ++b) {
      if (L.pinned_block(b, length)) ids.push_back(b);
    }
    for (std::int32_t b = 0; b < blocks && static_cast<int>(ids.size()) < L.budget_blocks; ++b) {
      if (!L.pinned_block(b, length) && std::bernoulli_distribution(0.5)(rng)) ids.push_back(b);
    }
    std::sort(ids.begin(), ids.end());
    m.working_set_blocks.insert(m.working_set_blocks.end(), ids.begin(), ids.end());
    m.working_set_counts.push_back(static_cast<std::int32_t>(ids.size()));
  }
  const auto rows = test::random_rows<fp16_t>(rng, m.working_set_blocks.size() * static_cast<std::size_t>(L.block_elems));
  m.working_set_rows.resize(rows.size() * sizeof(fp16_t));
  if (!rows.empty()) std::memcpy(m.working_set_rows.data(), rows.data(), m.working_set_rows.size());
  const std::uint64_t pool_block = static_cast<std::uint64_t>(heads) * static_cast<std::uint64_t>(L.block_elems) * 2;
  m.region_base = 0x7f0000000000ull;
  m.region_bytes = pool_block * static_cast<std::uint64_t>(blocks + 3);
  for (std::int64_t b = 0; b < blocks; ++b) m.block_addresses.push_back(m.region_base + pool_block * static_cast<std::uint64_t>((b * 7) % (blocks + 3)));
  m.packed_rkey.resize(37);
  for (auto& x : m.packed_rkey) x = static_cast<std::byte>(rng());
  m.lookahead_rows = 2;
  m.next_step_rows = 3;
  m.lookahead_queries = test::random_rows<float>(rng, static_cast<std::size_t>(L.num_layers() * 2 * L.q_row_elems));
  m.user_data.resize(rng() % 9);
  for (auto& x : m.user_data) x = static_cast<std::byte>(rng());
  return m;
}

bool same(const AdmissionMessage& a, const AdmissionMessage& b) {
  return a.request_id == b.request_id && a.shape.num_layers == b.shape.num_layers &&
         a.shape.num_q_heads == b.shape.num_q_heads && a.shape.num_kv_heads == b.shape.num_kv_heads &&
         a.shape.head_dim == b.shape.head_dim && a.block_tokens == b.block_tokens && a.dtype == b.dtype &&
         a.length == b.length && a.summaries.size() == b.summaries.size() && a.moment_vectors == b.moment_vectors &&
         a.moments == b.moments && a.run_tokens == b.run_tokens && a.run_sums == b.run_sums && a.cluster_rows == b.cluster_rows && a.cluster_segments == b.cluster_segments &&
         a.cluster_ids == b.cluster_ids && a.cluster_sums == b.cluster_sums && a.cluster_counts == b.cluster_counts &&
         (a.summaries.empty() || std::memcmp(a.summaries.data(), b.summaries.data(), a.summaries.size() * sizeof(float)) == 0) &&
         a.working_set_counts == b.working_set_counts && a.working_set_blocks == b.working_set_blocks &&
         a.working_set_rows == b.working_set_rows && a.block_addresses == b.block_addresses &&
         a.region_base == b.region_base && a.region_bytes == b.region_bytes && a.packed_rkey == b.packed_rkey &&
         a.lookahead_rows == b.lookahead_rows && a.next_step_rows == b.next_step_rows &&
         a.lookahead_queries == b.lookahead_queries && a.user_data == b.user_data;
}

}  // namespace

TEST_CASE("an admission message round-trips and fits its cache") {
  OASISKV_SEEDED_RNG(rng);
  for (RemainderEstimate remainder : {RemainderEstimate::none, RemainderEstimate::clusters}) {
    CAPTURE(remainder_name(remainder));
    CacheConfig config = test::small_config(128, 1024, 2);
    config.remainder = remainder;
    const CacheLayout L = CacheLayout::from(config);
    for (std::int64_t length : {0, 1, 16, 300, 1024}) {
      CAPTURE(length);
      const AdmissionMessage m = random_message(L, length, rng);
      CHECK(m.moments.size() == (length == 0 ? 0u : static_cast<std::size_t>(L.num_layers() * L.num_kv_heads() *
                                                       L.blocks_for(length) * L.remainder.moment_vectors * L.head_dim())));
      const AdmissionMessage back = decode_admission(encode_admission(m));
      CHECK(same(m, back));
      CHECK_NOTHROW(check_admission(back, L, DType::f16));
    }
  }
}

TEST_CASE("a cache with clusters refuses a message without its block sums, a cache without one ignores them") {
  OASISKV_SEEDED_RNG(rng);
  CacheConfig config = test::small_config(128, 1024, 2);
  config.remainder = RemainderEstimate::clusters;
  const CacheLayout clusters = CacheLayout::from(config);
  config.remainder = RemainderEstimate::none;
  const CacheLayout none = CacheLayout::from(config);
  const AdmissionMessage bare = random_message(none, 300, rng);
  CHECK(bare.moment_vectors == 0);
  CHECK_THROWS_WITH_AS(check_admission(bare, clusters, DType::f16),
                       doctest::Contains("remainder estimate (clusters) needs every block's sums, and the message carries none"),
                       Error);
  const AdmissionMessage two = random_message(clusters, 300, rng);
  CHECK_NOTHROW(check_admission(two, none, DType::f16));
  CHECK_NOTHROW(check_admission(two, clusters, DType::f16));
  AdmissionMessage three = two;  // the variance estimate's third vector: no estimate reads it now
  three.moment_vectors = 3;
  three.moments.resize(two.moments.size() / 2 * 3);
  CHECK_THROWS_WITH_AS(decode_admission(encode_admission(three)),
                       doctest::Contains("moment_vectors is 3; expected 0 (no block sums) or 2"), Error);
}

TEST_CASE("a truncated or corrupted admission message is refused with the reason") {
  OASISKV_SEEDED_RNG(rng);
  const CacheLayout L = CacheLayout::from(test::small_config(128, 1024, 2));
  const std::vector<std::byte> bytes = encode_admission(random_message(L, 300, rng));
  // Every truncation.
  for (std::size_t n = 0; n < bytes.size(); n += 1 + n / 64) {
    CAPTURE(n);
    CHECK_THROWS_AS(decode_admission(std::span(bytes).first(n)), Error);
  }
  CHECK_THROWS_WITH_AS(decode_admission(std::span(bytes).first(10)), doctest::Contains("shorter than its 24-byte header"), Error);
  CHECK_THROWS_WITH_AS(decode_admission(std::span(bytes).first(bytes.size() - 1)), doctest::Contains("truncated or padded"), Error);
  // A flipped byte anywhere.
  for (int trial = 0; trial < 200; ++trial) {
    auto bad = bytes;
    const std::size_t at = std::uniform_int_distribution<std::size_t>(0, bad.size() - 1)(rng);
    bad[at] ^= static_cast<std::byte>(1u << std::uniform_int_distribution<int>(0, 7)(rng));
    CAPTURE(at);
    CHECK_THROWS_AS(decode_admission(bad), Error);
  }
  auto bad = bytes;
  bad[40] ^= std::byte{0x10};
  CHECK_THROWS_WITH_AS(decode_admission(bad), doctest::Contains("checksum mismatch"), Error);
  bad = bytes;
  bad[4] = std::byte{9};  // version 9
  CHECK_THROWS_WITH_AS(decode_admission(bad), doctest::Contains("version 9 is not supported"), Error);
  bad = bytes;
  bad[0] = std::byte{0};
  CHECK_THROWS_WITH_AS(decode_admission(bad), doctest::Contains("bad magic"), Error);
}

TEST_CASE("an admission message's key clusters are checked, and a cache of another cluster size refuses them") {
  OASISKV_SEEDED_RNG(rng);
  CacheConfig config = test::small_config(128, 2048, 2);
  config.remainder = RemainderEstimate::clusters;
  const CacheLayout L = CacheLayout::from(config);
  const AdmissionMessage good = random_message(L, 1100, rng);  // one whole segment
  REQUIRE(good.cluster_segments == 1);
  CHECK_NOTHROW(check_admission(decode_admission(encode_admission(good)), L, DType::f16));
  struct Case {
    const char* name;
    std::function<void(AdmissionMessage&)> edit;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"an id past the clusters", [](AdmissionMessage& m) { m.cluster_ids[5] = 64; }, "names cluster 64 of 64"},
      {"a count that is not the ids'", [](AdmissionMessage& m) { m.cluster_counts[0] += 1; }, "its ids name"},
      {"sums short", [](AdmissionMessage& m) { m.cluster_sums.pop_back(); }, "cluster sum floats"},
      {"more segments than the prompt", [](AdmissionMessage& m) { m.cluster_segments = 2; }, "2 clustered segments, outside [0, 1]"},
      {"data without segments", [](AdmissionMessage& m) { m.cluster_segments = 0; }, "cluster data sent for 0"},
      {"a size that splits no segment", [](AdmissionMessage& m) { m.cluster_rows = 3; }, "cluster_rows 3 does not divide"},
      {"a sum not finite", [](AdmissionMessage& m) { m.cluster_sums[9] = -INFINITY; }, "cluster sum float 9 is not finite"},
  };
  for (const auto& k : cases) {
    CAPTURE(k.name);
    AdmissionMessage m = good;
    k.edit(m);
    CHECK_THROWS_WITH_AS(decode_admission(encode_admission(m)), doctest::Contains(k.message), Error);
  }
  config.remainder_cluster_rows = 32;
  CHECK_THROWS_WITH_AS(check_admission(good, CacheLayout::from(config), DType::f16),
                       doctest::Contains("hold 16 rows each on average, the cache's remainder_cluster_rows is 32"), Error);
  config.remainder = RemainderEstimate::none;  // a cache without clusters ignores them
  CHECK_NOTHROW(check_admission(good, CacheLayout::from(config), DType::f16));
}

TEST_CASE("an admission message with inconsistent counts, or of another cache's shape, is refused") {
  OASISKV_SEEDED_RNG(rng);
  const CacheLayout L = CacheLayout::from(test::small_config(128, 1024, 2));
  const AdmissionMessage good = random_message(L, 300, rng);
  struct Case {
    const char* name;
    std::function<void(AdmissionMessage&)> edit;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"summaries short", [](AdmissionMessage& m) { m.summaries.pop_back(); }, "summary floats"},
      {"moments without a count", [](AdmissionMessage& m) { m.moments.assign(5, 1.0f); }, "5 moment floats, but"},
      {"moment vectors 1", [](AdmissionMessage& m) { m.moment_vectors = 1; }, "moment_vectors is 1; expected 0"},
      {"moments short", [](AdmissionMessage& m) { m.moment_vectors = 2; }, "0 moment floats, but 2 layers"},
      {"one count missing", [](AdmissionMessage& m) { m.working_set_counts.pop_back(); }, "working-set counts, expected one per"},
      {"ids not ascending", [](AdmissionMessage& m) { m.working_set_counts[0] = 2; m.working_set_blocks[0] = 5; m.working_set_blocks[1] = 5; }, "not ascending"},
      {"id past the end", [](AdmissionMessage& m) { m.working_set_blocks.back() = 19; }, "outside [0, 19)"},
      {"rows short", [](AdmissionMessage& m) { m.working_set_rows.resize(m.working_set_rows.size() - 2); }, "bytes of working-set rows"},
      {"an address outside the region", [](AdmissionMessage& m) { m.block_addresses[3] = m.region_base + m.region_bytes; }, "outside the registered region"},
      {"no remote key", [](AdmissionMessage& m) { m.packed_rkey.clear(); }, "no remote key"},
      {"bad shape", [](AdmissionMessage& m) { m.shape.num_q_heads = 3; }, "bad shape"},
      {"queries short", [](AdmissionMessage& m) { m.lookahead_queries.pop_back(); }, "lookahead query floats"},
      {"no lookahead row", [](AdmissionMessage& m) { m.lookahead_rows = 0; }, "lookahead_rows must be at least 1, got 0"},
      {"a query not finite", [](AdmissionMessage& m) { m.lookahead_queries[7] = std::nanf(""); }, "lookahead query float 7 is not finite"},
      // What append refuses, admit refuses: non-finite rows, and summaries or moments of such rows.
      {"a summary infinite", [](AdmissionMessage& m) { m.summaries[11] = INFINITY; }, "summary float 11 is not finite (inf)"},
      {"a summary's max below its min",  // block 3 of (layer 0, kv head 1) with max and min swapped
       [&L](AdmissionMessage& m) {
         const std::int64_t d = L.head_dim(), blocks = L.blocks_for(m.length);
         float* mx = m.summaries.data() + ((1 * blocks + 3) * 2) * d;
         mx[0] = mx[d] + 1.0f;  // channel 0 strictly wider, so the swap makes its max < min
         std::swap_ranges(mx, mx + d, mx + d);
       },
       "the summary of block 3 (layer 0, kv head 1) has channel 0 max"},
      {"a working-set row NaN",
       [](AdmissionMessage& m) {
         const std::uint16_t nan16 = 0x7e00;  // an fp16 NaN at element 5
         std::memcpy(m.working_set_rows.data() + 10, &nan16, 2);
       },
       "working-set row element 5 is not finite"},
      {"a moment NaN",
       [](AdmissionMessage& m) {
         m.moment_vectors = 2;
         m.moments.assign(m.summaries.size(), 0.5f);  // as many floats as the summaries: 2 vectors x head_dim a block
         m.moments[3] = std::nanf("");
       },
       "moment float 3 is not finite"},
  };
  for (const auto& k : cases) {
    CAPTURE(k.name);
    AdmissionMessage m = good;
    k.edit(m);
    CHECK_THROWS_WITH_AS(decode_admission(encode_admission(m)), doctest::Contains(k.message), Error);
  }
  // Consistent, but not this cache's.
  const std::vector<Case> mismatches = {
      {"other head dim",
       [](AdmissionMessage& m) {
         m.shape.head_dim *= 2;
         m.summaries.assign(m.summaries.size() * 2, 0.5f);  // max = min: a block of equal keys
         m.working_set_rows.resize(m.working_set_rows.size() * 2);
         m.lookahead_queries.resize(m.lookahead_queries.size() * 2);
         m.region_bytes *= 2;
         for (auto& a : m.block_addresses) a = m.region_base + (a - m.region_base) * 2;
       },
       "is not the cache's"},
  };
  AdmissionMessage other = good;
  mismatches[0].edit(other);
  const AdmissionMessage decoded = decode_admission(encode_admission(other));
  CHECK_THROWS_WITH_AS(check_admission(decoded, L, DType::f16), doctest::Contains("is not the cache's"), Error);
  CHECK_THROWS_WITH_AS(check_admission(good, L, DType::bf16), doctest::Contains("elements are f16, the cache's are bf16"), Error);
  // Built in memory, never encoded: check_admission checks its counts as decode does.
  for (const auto& k : cases) {
    CAPTURE(k.name);
    AdmissionMessage m = good;
    k.edit(m);
    CHECK_THROWS_WITH_AS(check_admission(m, L, DType::f16), doctest::Contains(k.message), Error);
  }
  CacheConfig small = test::small_config(128, 256, 2);
  CHECK_THROWS_WITH_AS(check_admission(good, CacheLayout::from(small), DType::f16), doctest::Contains("300 tokens, more than max_tokens_per_sequence = 256"), Error);
}

TEST_CASE("a runs cache admits a message with its run sums only, and other caches ignore them") {
  OASISKV_SEEDED_RNG(rng);
  CacheConfig config = test::small_config(128, 1024, 2);
  const CacheLayout quest = CacheLayout::from(config);
  config.scorer = BlockScore::runs;
  const CacheLayout runs4 = CacheLayout::from(config);
  config.run_tokens = 8;
  const CacheLayout runs8 = CacheLayout::from(config);
  const AdmissionMessage bare = random_message(quest, 300, rng);
  CHECK(bare.run_tokens == 0);
  CHECK(bare.run_sums.empty());
  CHECK_THROWS_WITH_AS(check_admission(bare, runs4, DType::f16),
                       doctest::Contains("the cache's scorer (runs) reads every block's run key sums, and the message carries none"),
                       Error);
  const AdmissionMessage m = random_message(runs4, 300, rng);
  CHECK(m.run_sums.size() == static_cast<std::size_t>(2 * 2 * 19 * 4 * 16));  // layers x kv heads x blocks x runs x d
  const AdmissionMessage back = decode_admission(encode_admission(m));
  CHECK(same(m, back));
  CHECK_NOTHROW(check_admission(back, runs4, DType::f16));
  CHECK_NOTHROW(check_admission(back, quest, DType::f16));
  CHECK_THROWS_WITH_AS(check_admission(back, runs8, DType::f16),
                       doctest::Contains("run sums are of 4 rows, the cache's run_tokens is 8"), Error);
  // Inconsistent run fields are refused on decode, naming them.
  AdmissionMessage odd = m;
  odd.run_tokens = 3;
  CHECK_THROWS_WITH_AS(decode_admission(encode_admission(odd)),
                       doctest::Contains("run_tokens is 3; expected 0 (no run sums) or a divisor of block_tokens (16)"), Error);
  AdmissionMessage shorter = m;
  shorter.run_sums.pop_back();
  CHECK_THROWS_WITH_AS(decode_admission(encode_admission(shorter)), doctest::Contains("run sum floats, but 2 layers"),
                       Error);
  AdmissionMessage nan = m;
  nan.run_sums[9] = std::nanf("");
  CHECK_THROWS_WITH_AS(decode_admission(encode_admission(nan)), doctest::Contains("run sum float 9 is not finite"), Error);
}
