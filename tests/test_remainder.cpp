// The remainder estimate (CacheConfig::remainder, Cache::remainder): against a brute-force
// evaluation of the same formula from the rows (after appends, truncates and forks), exact zero
// mass when everything is resident, the error against dense attention lowered on keys with
// structure, merge_state, and the refusals.
#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>

#include <sys/mman.h>
#include <unistd.h>

#include "oasiskv/cpu/admission_export.hpp"

#include "reference_remainder.hpp"
#include "support.hpp"

using namespace oasiskv;
using namespace oasiskv::test;

TEST_CASE("remainder estimate names parse back, unknown names are refused") {
  for (RemainderEstimate r : {RemainderEstimate::none, RemainderEstimate::clusters, RemainderEstimate::quantized}) {
    CHECK(parse_remainder(remainder_name(r)) == r);
  }
  CHECK_THROWS_WITH_AS(parse_remainder("mean"), doctest::Contains("'mean'"), Error);
  for (const char* removed : {"centroid", "gaussian", "variance"}) {  // measured worse, removed
    CHECK_THROWS_WITH_AS(parse_remainder(removed), doctest::Contains("(expected none, clusters or quantized)"), Error);
  }
  CacheConfig c = test::small_config();
  CHECK(CacheLayout::from(c).remainder.moment_floats == 0);
  c.remainder = RemainderEstimate::clusters;  // a key sum and a value sum per block
  CHECK(CacheLayout::from(c).remainder.moment_floats == CacheLayout::from(c).summary_floats);
  CHECK(CacheLayout::from(c).moment_offset(0, 0, 0, 1) == 2 * c.shape.head_dim);  // 1,024-row segments: 4 .. 1,024 rows a cluster, at most 256 clusters
  for (int bad : {2, 3, 12, 2048}) {
    c.remainder_cluster_rows = bad;
    const std::string want =
        bad < 2048 ? fmt::format("remainder_cluster_rows must be a power of two, at least 4, got {}", bad)
                   : fmt::format("remainder_cluster_rows must be a power of two in [4, 1024] (the rows of a 64-block "
                                 "segment) giving at most 256 clusters a segment, got {}",
                                 bad);
    CHECK_THROWS_WITH_AS((void)CacheLayout::from(c), doctest::Contains(want.c_str()), Error);
  }
  for (int good : {4, 16, 1024}) {
    c.remainder_cluster_rows = good;
    CHECK_NOTHROW((void)CacheLayout::from(c));
  }
  c.remainder_cluster_rows = 16;
  // Validated whatever the estimate: a value no estimate reads is still refused.
  c.remainder = RemainderEstimate::none;
  c.remainder_bits = 100;
  CHECK_THROWS_WITH_AS((void)CacheLayout::from(c), doctest::Contains("remainder_bits must be in [2, 8], got 100"), Error);
  c.remainder_bits = 4;
  c.remainder_cluster_rows = 12;
  CHECK_THROWS_WITH_AS((void)CacheLayout::from(c), doctest::Contains("remainder_cluster_rows must be a power of two, at least 4, got 12"), Error);
  c.remainder_cluster_rows = 16;
  c.remainder = RemainderEstimate::quantized;  // codes, no moments
  for (int bad : {0, 1, 9}) {
    c.remainder_bits = bad;
    const std::string want = fmt::format("remainder_bits must be in [2, 8], got {}", bad);
    CHECK_THROWS_WITH_AS((void)CacheLayout::from(c), doctest::Contains(want.c_str()), Error);
  }
  c.remainder_bits = 4;  // 16 rows x 16 channels: 128 bytes of key codes, as many of value codes, 16 x 1 x 8 of scales
  CHECK(CacheLayout::from(c).remainder.moment_floats == 0);
  CHECK(CacheLayout::from(c).remainder.quantized_block_bytes == 128 + 128 + 128);
  CHECK(CacheLayout::from(c).remainder.quantized_bytes ==
        CacheLayout::from(c).remainder.quantized_block_bytes * c.max_sequences * c.shape.num_layers * c.shape.num_kv_heads * 64);
  c.remainder_bits = 3;  // 768 bits of codes: 96 bytes each
  CHECK(CacheLayout::from(c).remainder.quantized_block_bytes == 96 + 96 + 128);
  c.remainder = static_cast<RemainderEstimate>(7);
  CHECK_THROWS_WITH_AS((void)CacheLayout::from(c), doctest::Contains("value 7"), Error);
}

TEST_CASE("remainder matches the brute-force formula from the rows (append, truncate, fork)") {
  // Under a segment: every block by its own sums (the block centroid), folded on append, refolded
  // on truncate, copied on fork.
  SUBCASE("clusters (block sums), float rows") { random_against_brute_force<float>(RemainderEstimate::clusters); }
  SUBCASE("clusters (block sums), fp16 rows") { random_against_brute_force<fp16_t>(RemainderEstimate::clusters); }
  // Codes written when an append fills a block, copied by the fork below its point.
  SUBCASE("quantized 4 bits, float rows") { random_against_brute_force<float>(RemainderEstimate::quantized); }
  SUBCASE("quantized 2 bits, fp16 rows") { random_against_brute_force<fp16_t>(RemainderEstimate::quantized, 2); }
  SUBCASE("quantized 3 bits (codes across bytes), head dim 40 (a short value group)") {
    random_against_brute_force<float>(RemainderEstimate::quantized, 3, 40);
  }
  SUBCASE("quantized 8 bits, bf16 rows") { random_against_brute_force<bf16_t>(RemainderEstimate::quantized, 8); }
}

TEST_CASE("remainder is exactly zero mass when the budget covers the sequence") {
  // clusters: 1,100 rows, so that a segment is clustered and its clusters have no row left out.
  for (auto [kind, budget, length] : {std::tuple{RemainderEstimate::clusters, 512, 400},
                                      std::tuple{RemainderEstimate::clusters, 2048, 1100},
                                      std::tuple{RemainderEstimate::quantized, 512, 400}}) {
    OASISKV_SEEDED_RNG(rng);
    INFO("estimate " << remainder_name(kind));
    CacheConfig c = test::small_config(budget, budget, 1);
    c.remainder = kind;
    Cache<cpu, float> cache(c);
    std::map<SeqId, Rows<float>> rows;
    cache.add_sequence(1);
    append_random(cache, rows, 1, length, rng);
    if (length > 1024) REQUIRE(clusters_of(cache).key_clusters().clustered(0, 1, 1, 0));
    const auto q = test::random_rows<float>(rng, static_cast<std::size_t>(cache.layout().q_row_elems));
    const SeqId batch[] = {1};
    for (int l = 0; l < c.shape.num_layers; ++l) {
      const Ticket t = cache.prefetch(batch, l, rows_view(q.data(), 1));
      std::vector<float> out(q.size(), 123.0f), lse(static_cast<std::size_t>(c.shape.num_q_heads), 5.0f);
      cache.attend(t, [&](const LayerView<float>& view) {
        REQUIRE(view.indptr[1] - view.indptr[0] == (length + 15) / 16);  // every block resident
        cache.remainder(t, rows_view(q.data(), 1), out, lse);
      });
      for (float x : lse) CHECK(x == -INFINITY);
      for (float x : out) CHECK(x == 0.0f);
    }
  }
}

TEST_CASE("merge_state of attentions over disjoint keys is the attention over their union") {
  OASISKV_SEEDED_RNG(rng);
  const int d = 16, n = 40, split = 13;
  const auto k = test::random_rows<float>(rng, n * d), v = test::random_rows<float>(rng, n * d);
  const auto q = test::random_rows<float>(rng, d, 2.0f);
  SoftmaxAccumulator all(d), a(d), b(d);
  for (int t = 0; t < n; ++t) {
    all.add(q.data(), k.data() + t * d, v.data() + t * d, 0.25f);
    (t < split ? a : b).add(q.data(), k.data() + t * d, v.data() + t * d, 0.25f);
  }
  std::vector<float> want(d), out(d), other(d);
  all.finish(want.data());
  a.finish(out.data());
  b.finish(other.data());
  float lse = a.log_sum_exp();
  merge_state(out.data(), lse, other.data(), b.log_sum_exp(), d);
  CHECK(lse == doctest::Approx(all.log_sum_exp()).epsilon(1e-5));
  for (int i = 0; i < d; ++i) CHECK(out[i] == doctest::Approx(want[i]).epsilon(1e-4).scale(1.0));
  // An empty side changes nothing; an empty state takes the other.
  const std::vector<float> before = out;
  merge_state(out.data(), lse, other.data(), -INFINITY, d);
  CHECK(out == before);
  std::vector<float> empty(d, 0.0f);
  float empty_lse = -INFINITY;
  merge_state(empty.data(), empty_lse, out.data(), lse, d);
  CHECK(empty == out);
  CHECK(empty_lse == lse);
}

// Keys of each block clustered around the block's own centre, values around the block's own mean:
// the structure the estimate relies on. With the estimate merged, sparse attention is closer to
// dense attention than without it, for every query head (the test fails if the estimate is off
// or its state is wrong).
TEST_CASE("with the estimate merged, sparse attention is closer to dense on clustered keys") {
  for (RemainderEstimate kind : {RemainderEstimate::clusters, RemainderEstimate::quantized}) {
    OASISKV_SEEDED_RNG(rng);
    INFO("estimate " << remainder_name(kind));
    CacheConfig c = test::small_config(96, 1024, 1);  // 640 rows: under a segment, `clusters` by its block sums
    c.remainder = kind;
    Cache<cpu, float> cache(c);
    const auto& L = cache.layout();
    const int H = L.num_kv_heads(), d = L.head_dim(), Q = L.num_q_heads();
    const int len = 640;
    std::normal_distribution<float> unit(0.0f, 1.0f);
    std::vector<float> k(static_cast<std::size_t>(len) * L.row_elems), v(k.size());
    std::vector<float> kc(static_cast<std::size_t>(H * d)), vc(kc.size());
    for (int t = 0; t < len; ++t) {
      if (t % 16 == 0) {
        for (float& x : kc) x = unit(rng);
        for (float& x : vc) x = unit(rng);
      }
      for (int j = 0; j < H * d; ++j) {
        k[static_cast<std::size_t>(t) * H * d + j] = kc[j] + 0.2f * unit(rng);
        v[static_cast<std::size_t>(t) * H * d + j] = vc[j] + 0.2f * unit(rng);
      }
    }
    cache.add_sequence(1);
    const SeqId batch[] = {1};
    const std::int32_t counts[] = {len};
    cache.append(batch, 0, counts, rows_view(k.data(), len), rows_view(v.data(), len));
    const auto q = test::random_rows<float>(rng, static_cast<std::size_t>(L.q_row_elems), 1.5f);
    const Ticket t = cache.prefetch(batch, 0, rows_view(q.data(), 1));
    std::vector<float> dense(q.size()), sparse(q.size()), rem(q.size()), lse(static_cast<std::size_t>(Q)),
        rem_lse(lse.size());
    dense_attention_reference(k.data(), v.data(), len, Q, H, d, L.softmax_scale, q.data(), dense.data());
    cache.attend(t, [&](const LayerView<float>& view) {
      sparse_attention_reference(view, Q, L.softmax_scale, q.data(), sparse.data(), lse.data());
      cache.remainder(t, rows_view(q.data(), 1), rem, rem_lse);
    });
    std::vector<float> merged = sparse;
    merge_states(merged.data(), lse.data(), rem.data(), rem_lse.data(), Q, d);
    double total_without = 0, total_with = 0;
    for (int g = 0; g < Q; ++g) {
      double without = 0, with = 0;
      for (int i = 0; i < d; ++i) {
        const std::size_t j = static_cast<std::size_t>(g * d + i);
        without += (sparse[j] - dense[j]) * (sparse[j] - dense[j]);
        with += (merged[j] - dense[j]) * (merged[j] - dense[j]);
      }
      INFO("query head " << g << ": error " << std::sqrt(without) << " without, " << std::sqrt(with) << " with");
      CHECK(with < without);
      total_without += without;
      total_with += with;
    }
    // Not a marginal gain: the error at least halves over all heads.
    CHECK(total_with < 0.25 * total_without);
  }
}

TEST_CASE("remainder refuses a cache without the estimate, a ticket not acquired and wrong sizes") {
  OASISKV_SEEDED_RNG(rng);
  const auto q = test::random_rows<float>(rng, 64);
  const SeqId batch[] = {1};
  {
    Cache<cpu, float> cache(test::small_config(96, 1024, 1));
    cache.add_sequence(1);
    const Ticket t = cache.prefetch(batch, 0, rows_view(q.data(), 1));
    std::vector<float> out(64), lse(4);
    cache.attend(t, [&](const LayerView<float>&) {
      CHECK_THROWS_WITH_AS(cache.remainder(t, rows_view(q.data(), 1), out, lse),
                           doctest::Contains("CacheConfig::remainder is none"), Error);
    });
  }
  CacheConfig c = test::small_config(96, 1024, 1);
  c.remainder = RemainderEstimate::clusters;
  Cache<cpu, float> cache(c);
  cache.add_sequence(1);
  const Ticket t = cache.prefetch(batch, 0, rows_view(q.data(), 1));
  std::vector<float> out(64), lse(4), short_out(63), long_lse(5);
  CHECK_THROWS_WITH_AS(cache.remainder(t, rows_view(q.data(), 1), out, lse), doctest::Contains("is not acquired at layer 0"),
                       Error);
  cache.attend(t, [&](const LayerView<float>&) {
    CHECK_THROWS_WITH_AS(cache.remainder(t, rows_view(q.data(), 1), short_out, lse),
                         doctest::Contains("out has 63 floats"), Error);
    CHECK_THROWS_WITH_AS(cache.remainder(t, rows_view(q.data(), 1), out, long_lse),
                         doctest::Contains("lse has 5 floats"), Error);
    cache.remainder(t, rows_view(q.data(), 1), out, lse);  // empty sequence: zero mass
    Cache<cpu, float> other(c);
    other.add_sequence(1);
    const Ticket foreign = other.prefetch(batch, 0, rows_view(q.data(), 1));
    CHECK_THROWS_WITH_AS(cache.remainder(foreign, rows_view(q.data(), 1), out, lse),
                         doctest::Contains("remainder: ticket 1 was issued by another cache"), Error);
  });
  for (float x : lse) CHECK(x == -INFINITY);
}

TEST_CASE("an overstated query is refused before a byte of it is read: remainder and the calls that plan") {
  // q's one real row ends at a page that is followed by an inaccessible one: a read past it is a
  // crash, not a silent out-of-bounds read, so the order of the checks is what this tests.
  const long page = ::sysconf(_SC_PAGESIZE);
  void* map = ::mmap(nullptr, 2 * static_cast<std::size_t>(page), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  REQUIRE(map != MAP_FAILED);
  REQUIRE(::mprotect(static_cast<char*>(map) + page, static_cast<std::size_t>(page), PROT_NONE) == 0);
  CacheConfig c = test::small_config(96, 1024, 1);
  c.remainder = RemainderEstimate::quantized;
  Cache<cpu, float> cache(c);
  const int row = cache.layout().q_row_elems;  // 64 floats
  float* q = reinterpret_cast<float*>(static_cast<char*>(map) + page) - row;
  OASISKV_SEEDED_RNG(rng);
  const auto values = test::random_rows<float>(rng, static_cast<std::size_t>(row));
  std::copy(values.begin(), values.end(), q);
  cache.add_sequence(1);
  const SeqId batch[] = {1};
  std::mt19937_64 rows_rng(7);
  std::map<SeqId, Rows<float>> rows;
  append_random(cache, rows, 1, 200, rows_rng);
  const RowsView huge{q, DType::f32, std::int64_t{1} << 40}, two{q, DType::f32, 2};
  LayerStatistics before = cache.statistics().layers[0];
  const auto unchanged = [&] {
    const LayerStatistics& now = cache.statistics().layers[0];
    CHECK(now.plans == before.plans);
    CHECK(now.blocks_selected == before.blocks_selected);
    CHECK(now.observed_true_blocks == before.observed_true_blocks);
    CHECK(cache.sequence_length(1, 0) == 200);
  };
  CHECK_THROWS_WITH_AS(cache.prefetch(batch, 0, huge),
                       doctest::Contains("prefetch: q has 1099511627776 rows per sequence, more than this backend's max_query_rows = 1024"),
                       Error);
  unchanged();
  const Ticket t = cache.prefetch(batch, 0, rows_view(q, 1));
  before = cache.statistics().layers[0];
  std::vector<float> out(static_cast<std::size_t>(row)), lse(4);
  cache.attend(t, [&](const LayerView<float>&) {
    CHECK_THROWS_WITH_AS(cache.remainder(t, huge, out, lse), doctest::Contains("max_query_rows = 1024"), Error);
    // Two rows are within the cap, so only out and lse can tell: they are checked first.
    CHECK_THROWS_WITH_AS(cache.remainder(t, two, out, lse),
                         doctest::Contains("remainder: out has 64 floats, but 2 q rows x 4 query heads x 16 channels need 128"),
                         Error);
    CHECK_THROWS_WITH_AS(cache.observe(t, huge), doctest::Contains("observe: q has 1099511627776 rows"), Error);
    unchanged();
    cache.remainder(t, rows_view(q, 1), out, lse);  // the real row, after every refusal
    for (float x : lse) CHECK(std::isfinite(x));
  });
  CHECK_THROWS_WITH_AS(static_cast<void>(cache.select_blocks(1, 0, huge)),
                       doctest::Contains("select_blocks: q has 1099511627776 rows"), Error);
  CHECK(cache.sequence_length(1, 0) == 200);
  ::munmap(map, 2 * static_cast<std::size_t>(page));
}

// The admitted case (moments carried in the message, the estimate equal to a single-process
// twin's) is in test_remote_admission.cpp.
TEST_CASE("admit with clusters refuses a message from a prefill cache that keeps no block sums, and quantized any") {
  OASISKV_SEEDED_RNG(rng);
  Cache<cpu, float> prefill(test::small_config(96, 1024, 1));
  std::map<SeqId, Rows<float>> rows;
  prefill.add_sequence(1);
  append_random(prefill, rows, 1, 200, rng);
  const auto q = test::random_rows<float>(rng, static_cast<std::size_t>(2 * prefill.layout().q_row_elems));
  AdmissionMessage m = make_admission(prefill, 1, q, 1);
  // Remote fields that pass the message's own checks (nothing is read: the admit is refused).
  const std::uint64_t pool_block = prefill.host_tier().pool_block_bytes();
  m.region_base = 0x10000;
  m.region_bytes = pool_block * static_cast<std::uint64_t>(prefill.layout().blocks_for(200));
  for (std::int64_t b = 0; b < prefill.layout().blocks_for(200); ++b) {
    m.block_addresses.push_back(m.region_base + pool_block * static_cast<std::uint64_t>(b));
  }
  m.packed_rkey.assign(4, std::byte{1});
  CacheConfig c = test::small_config(96, 1024, 1);
  c.remainder = RemainderEstimate::clusters;
  Cache<cpu, float> decode(c);
  CHECK(m.moment_vectors == 0);
  CHECK_THROWS_WITH_AS(decode.admit(5, m, nullptr), doctest::Contains("needs every block's sums, and the message carries none"),
                       Error);
  CHECK_FALSE(decode.has_sequence(5));
  // quantized codes every block from its rows, and an admitted prompt's rows are not here.
  c.remainder = RemainderEstimate::quantized;
  Cache<cpu, float> coded(c);
  CHECK_THROWS_WITH_AS(coded.admit(5, m, nullptr), doctest::Contains("remainder estimate (quantized) codes every full block"),
                       Error);
  CHECK_FALSE(coded.has_sequence(5));
}
