// Reference block selection for tests: the Quest bound from raw keys and a sort-based top-K.
// Written independently of the library's scorer and selector (which the tests compare with).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "oasiskv/config.hpp"
#include "oasiskv/kit/score_formulas.hpp"

namespace oasiskv::test {

// Top-K by sorting every (score, index) pair, best first, ties to the lower index; NaN ranks
// below every number.
inline std::vector<std::int32_t> brute_top_k(const std::vector<float>& scores, std::int64_t first, int k) {
  std::vector<std::pair<float, std::int32_t>> all;
  for (std::size_t i = 0; i < scores.size(); ++i) all.emplace_back(scores[i], static_cast<std::int32_t>(i));
  std::sort(all.begin(), all.end(), [](auto a, auto b) {
    const bool na = std::isnan(a.first), nb = std::isnan(b.first);
    if (na != nb) return nb;
    if (na || a.first == b.first) return a.second < b.second;
    return a.first > b.first;
  });
  std::vector<std::int32_t> out;
  for (std::size_t i = 0; i < all.size() && static_cast<int>(i) < k; ++i) out.push_back(static_cast<std::int32_t>(all[i].second + first));
  return out;
}

// The bound of one query over keys rows [first_row, first_row + rows) (row-major, d channels),
// from the channel-wise max and min of those rows, summed in the library's lane order.
inline float reference_bound(const float* q, const std::vector<float>& keys, std::int64_t first_row, std::int64_t rows, int d) {
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

// The configured scorer's score of one query against a block's max and min (config.hpp BlockScore),
// written out from the formulas with its own lane arrays: channel i into lane i % 8, the lanes
// added in sum_lanes' tree, centre = (max + min) * 0.5 and range = max - min.
inline float reference_score(const ScoreParams& p, const float* q, const float* mx, const float* mn, int d) {
  float centre[kScoreLanes] = {}, range[kScoreLanes] = {}, bound[kScoreLanes] = {};
  for (int i = 0; i < d; ++i) {
    const int j = i % kScoreLanes;
    const float c = (mx[i] + mn[i]) * 0.5f, r = mx[i] - mn[i];
    centre[j] += q[i] * c;
    range[j] += std::fabs(q[i]) * r;
    bound[j] += std::max(q[i] * mx[i], q[i] * mn[i]);
  }
  switch (p.kind) {
    case BlockScore::quest: return sum_lanes(bound);
    case BlockScore::spread: return sum_lanes(centre) + p.half_alpha * sum_lanes(range);
    case BlockScore::runs: break;  // from the run key sums, not the min/max: test_scorers.py's reference
  }
  return NAN;
}

// reference_score of the block of keys rows [first_row, first_row + rows) (as reference_bound).
inline float reference_block_score(const ScoreParams& p, const float* q, const std::vector<float>& keys,
                                   std::int64_t first_row, std::int64_t rows, int d) {
  std::vector<float> mx(static_cast<std::size_t>(d), -INFINITY), mn(static_cast<std::size_t>(d), INFINITY);
  for (std::int64_t r = first_row; r < first_row + rows; ++r) {
    for (int i = 0; i < d; ++i) {
      mx[static_cast<std::size_t>(i)] = std::max(mx[static_cast<std::size_t>(i)], keys[static_cast<std::size_t>(r * d + i)]);
      mn[static_cast<std::size_t>(i)] = std::min(mn[static_cast<std::size_t>(i)], keys[static_cast<std::size_t>(r * d + i)]);
    }
  }
  return reference_score(p, q, mx.data(), mn.data(), d);
}

}  // namespace oasiskv::test
