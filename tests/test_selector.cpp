// Scoring and top-K selection against simple references.
#include <algorithm>
#include <cmath>

#include "support.hpp"

using namespace oasiskv;

namespace {
// Reference top-K: sort every (score, index) pair, best first, ties to the lower index.
std::vector<std::int32_t> brute_top_k(const std::vector<float>& scores, std::int64_t first, int k) {
  std::vector<std::pair<float, std::int32_t>> all;
  for (std::size_t i = 0; i < scores.size(); ++i) all.emplace_back(scores[i], static_cast<std::int32_t>(i));
  std::sort(all.begin(), all.end(), [](auto a, auto b) { return a.first != b.first ? a.first > b.first : a.second < b.second; });
  std::vector<std::int32_t> out;
  for (std::size_t i = 0; i < all.size() && static_cast<int>(i) < k; ++i) out.push_back(static_cast<std::int32_t>(all[i].second + first));
  return out;
}

// Reference block score from raw keys: per-channel max/min, the bound, then the reduction.
float reference_bound(const float* q, const std::vector<float>& keys, std::int64_t first_row, std::int64_t rows, int d) {
  std::vector<float> mx(static_cast<std::size_t>(d), -INFINITY), mn(static_cast<std::size_t>(d), INFINITY);
  for (std::int64_t r = first_row; r < first_row + rows; ++r) {
    for (int i = 0; i < d; ++i) {
      mx[static_cast<std::size_t>(i)] = std::max(mx[static_cast<std::size_t>(i)], keys[static_cast<std::size_t>(r * d + i)]);
      mn[static_cast<std::size_t>(i)] = std::min(mn[static_cast<std::size_t>(i)], keys[static_cast<std::size_t>(r * d + i)]);
    }
  }
  float lane[kScoreLanes] = {};
  for (int i = 0; i < d; ++i) lane[i % kScoreLanes] += std::max(q[i] * mx[static_cast<std::size_t>(i)], q[i] * mn[static_cast<std::size_t>(i)]);
  return sum_lanes(lane);
}
}  // namespace

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

TEST_CASE("the cache's working set: pinned blocks plus the brute-force top-K of the others") {
  OASISKV_SEEDED_RNG(rng);
  for (GroupReduction reduction : {GroupReduction::max, GroupReduction::sum, GroupReduction::softmax_sum}) {
    for (int trial = 0; trial < 8; ++trial) {
      CAPTURE(reduction_name(reduction));
      CacheConfig c = test::small_config(160, 2048, 1);  // 10 slots: 1 sink, 3 ring, 6 selected
      c.reduction = reduction;
      Cache<cpu, float> cache(c);
      const auto& L = cache.layout();
      const int H = c.shape.num_kv_heads, Hq = c.shape.num_q_heads, G = L.group_size, d = c.shape.head_dim;
      cache.add_sequence(5);
      const std::vector<SeqId> batch{5};
      const std::int64_t rows = std::uniform_int_distribution<std::int64_t>(1, 500)(rng);
      const int R = std::uniform_int_distribution<int>(1, 3)(rng);
      auto k = test::random_rows<float>(rng, static_cast<std::size_t>(rows * H * d));
      auto v = test::random_rows<float>(rng, static_cast<std::size_t>(rows * H * d));
      auto q = test::random_rows<float>(rng, static_cast<std::size_t>(R * Hq * d));
      cache.append(batch, 1, std::vector<std::int32_t>{static_cast<std::int32_t>(rows)}, rows_view(k.data(), rows), rows_view(v.data(), rows));
      const Ticket t = cache.prefetch(batch, 1, rows_view(q.data(), R));
      const auto view = cache.acquire(t);
      for (int h = 0; h < H; ++h) {
        CAPTURE(h);
        std::vector<float> head_keys;
        for (std::int64_t r = 0; r < rows; ++r) head_keys.insert(head_keys.end(), k.begin() + (r * H + h) * d, k.begin() + (r * H + h + 1) * d);
        const std::int64_t nb = L.blocks_for(rows);
        const std::int64_t first = L.sink_blocks;
        const std::int64_t last = std::max(first, std::min(nb, L.ring_start(rows + 1)));
        std::vector<float> scores;
        for (std::int64_t b = first; b < last; ++b) {
          std::vector<float> per_query;
          for (int r = 0; r < R; ++r)
            for (int g = 0; g < G; ++g)
              per_query.push_back(reference_bound(q.data() + (r * Hq + h * G + g) * d, head_keys, b * 16, std::min<std::int64_t>(16, rows - b * 16), d));
          scores.push_back(0.0f);
          if (reduction == GroupReduction::max) scores.back() = *std::max_element(per_query.begin(), per_query.end());
          if (reduction == GroupReduction::sum) for (float s : per_query) scores.back() += s;
          if (reduction == GroupReduction::softmax_sum) scores.back() = 0.0f;
        }
        if (reduction == GroupReduction::softmax_sum && last > first) {
          for (int qi = 0; qi < R * G; ++qi) {
            const float* qq = q.data() + ((qi / G) * Hq + h * G + qi % G) * d;
            std::vector<float> raw;
            for (std::int64_t b = first; b < last; ++b) raw.push_back(reference_bound(qq, head_keys, b * 16, 16, d));
            const float top = *std::max_element(raw.begin(), raw.end());
            float total = 0.0f;
            for (float& s : raw) total += (s = std::exp((s - top) * L.softmax_scale));
            for (std::size_t j = 0; j < raw.size(); ++j) scores[j] += raw[j] / total;
          }
        }
        std::vector<std::int32_t> expected = brute_top_k(scores, first, L.selectable_blocks);
        // What select_blocks reports is the same ranking.
        CHECK(cache.select_blocks(5, 1, rows_view(q.data(), R))[static_cast<std::size_t>(h)] == expected);
        // Then the pinned blocks are added: sinks and the recent ring.
        for (std::int64_t b = 0; b < std::min<std::int64_t>(L.sink_blocks, nb); ++b) expected.push_back(static_cast<std::int32_t>(b));
        for (std::int64_t b = L.ring_start(rows); b < nb; ++b) expected.push_back(static_cast<std::int32_t>(b));
        std::sort(expected.begin(), expected.end());
        expected.erase(std::unique(expected.begin(), expected.end()), expected.end());
        const int p = h;
        std::vector<std::int32_t> got(view.block + view.indptr[p], view.block + view.indptr[p + 1]);
        CHECK(got == expected);
      }
      cache.release(t);
    }
  }
}
