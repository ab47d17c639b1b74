// Scoring and top-K selection against simple references.
#include <algorithm>
#include <cmath>

#include "reference_selection.hpp"
#include "support.hpp"

using namespace oasiskv;

using test::brute_top_k;
using test::reference_bound;

TEST_CASE("top_k equals a sort-based brute force, ties to the lower block index") {
  OASISKV_SEEDED_RNG(rng);
  for (int trial = 0; trial < 500; ++trial) {
    const int n = std::uniform_int_distribution<int>(0, 300)(rng);
    const int k = std::uniform_int_distribution<int>(0, n + 5)(rng);
    const std::int64_t first = std::uniform_int_distribution<int>(0, 4)(rng);
    // Few distinct values, so ties are common.
    std::uniform_int_distribution<int> level(0, trial % 2 == 0 ? 5 : 1000);
    std::vector<float> scores(static_cast<std::size_t>(n));
    for (auto& s : scores) s = static_cast<float>(level(rng)) * 0.25f;
    std::vector<std::int32_t> got;
    LookaheadSelector::top_k(scores, first, k, got);
    REQUIRE(got == brute_top_k(scores, first, k));
  }
}

TEST_CASE("the Quest bound is at least the true max of q.k over its block, for every block") {
  OASISKV_SEEDED_RNG(rng);
  CacheConfig c = test::small_config(128, 2048, 1);
  Cache<cpu, float> cache(c);
  cache.add_sequence(1);
  const auto& L = cache.layout();
  const int H = c.shape.num_kv_heads, d = c.shape.head_dim;
  const std::int64_t rows = 16 * 40 + 7;
  auto k = test::random_rows<float>(rng, static_cast<std::size_t>(rows * H * d), 2.0f);
  auto v = test::random_rows<float>(rng, static_cast<std::size_t>(rows * H * d));
  const std::vector<SeqId> batch{1};
  cache.append(batch, 0, std::vector<std::int32_t>{static_cast<std::int32_t>(rows)}, rows_view(k.data(), rows), rows_view(v.data(), rows));
  SummaryStore summaries(L);
  for (std::int64_t t = 0; t < rows; ++t)
    for (int h = 0; h < H; ++h) summaries.add_key(0, 0, h, t, k.data() + (t * H + h) * d);
  for (int trial = 0; trial < 50; ++trial) {
    auto q = test::random_rows<float>(rng, static_cast<std::size_t>(d), 3.0f);
    for (int h = 0; h < H; ++h) {
      for (std::int64_t b = 0; b < L.blocks_for(rows); ++b) {
        const float bound = quest_bound(q.data(), summaries.key_max(0, 0, h, b), summaries.key_min(0, 0, h, b), d);
        for (std::int64_t t = b * 16; t < std::min(rows, (b + 1) * 16); ++t) {
          // q.k summed in the bound's lane order (channel i in lane i % 8, then the lane tree).
          float lane[kScoreLanes] = {};
          for (int i = 0; i < d; ++i) lane[i % kScoreLanes] += q[static_cast<std::size_t>(i)] * k[static_cast<std::size_t>((t * H + h) * d + i)];
          const float dot = sum_lanes(lane);
          REQUIRE(bound >= dot);
          // And the bound is never below the exact dot product by more than float rounding.
          double exact = 0.0;
          for (int i = 0; i < d; ++i) exact += static_cast<double>(q[static_cast<std::size_t>(i)]) * k[static_cast<std::size_t>((t * H + h) * d + i)];
          double magnitude = 0.0;
          for (int i = 0; i < d; ++i) magnitude += std::fabs(static_cast<double>(q[static_cast<std::size_t>(i)]) * k[static_cast<std::size_t>((t * H + h) * d + i)]);
          REQUIRE(static_cast<double>(bound) >= exact - 1e-6 * magnitude);
        }
      }
    }
  }
}


TEST_CASE("top_k: a NaN score never wins, -0 equals +0, infinities order as numbers") {
  OASISKV_SEEDED_RNG(rng);
  const std::vector<float> special{NAN, -NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 1.0f, -1.0f};
  for (int trial = 0; trial < 500; ++trial) {
    const int n = std::uniform_int_distribution<int>(1, 40)(rng);
    std::vector<float> scores;
    for (int i = 0; i < n; ++i) {
      scores.push_back(std::bernoulli_distribution(0.5)(rng) ? special[std::uniform_int_distribution<std::size_t>(0, special.size() - 1)(rng)]
                                                             : std::normal_distribution<float>()(rng));
    }
    const int k = std::uniform_int_distribution<int>(0, n + 2)(rng);
    std::vector<std::int32_t> got;
    LookaheadSelector::top_k(scores, 3, k, got);
    CHECK(got == brute_top_k(scores, 3, k));
    // Every NaN selected comes after every number, and only when fewer numbers than k exist.
    bool seen_nan = false;
    for (std::int32_t b : got) {
      const bool nan = std::isnan(scores[static_cast<std::size_t>(b - 3)]);
      CHECK(!(seen_nan && !nan));
      seen_nan = seen_nan || nan;
    }
  }
}
