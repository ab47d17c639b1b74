// Reference block selection for tests: the Quest bound from raw keys and a sort-based top-K.
// Written independently of the library's scorer and selector (which the tests compare with).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "oasiskv/summary.hpp"

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

}  // namespace oasiskv::test
