// k-means of one segment's keys (RemainderEstimate::clusters; include/oasiskv/cpu/detail/remainder/key_clusters.hpp).
#include "oasiskv/cpu/detail/remainder/key_clusters.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace oasiskv {
inline namespace v0 {
namespace detail {

void kmeans_keys(const float* keys, int rows, int d, int k, int iterations, std::uint8_t* ids,
                 std::vector<float>& centres, std::vector<float>& scratch) {
  const auto D = static_cast<std::size_t>(d);
  centres.assign(static_cast<std::size_t>(k) * D, 0.0f);
  // Start: rows j * 7919 + 13 (mod rows); 7919 is prime, so distinct j give distinct rows when
  // k <= rows, spread over the segment rather than clumped at its start.
  for (int j = 0; j < k; ++j) {
    const std::int64_t r = (static_cast<std::int64_t>(j) * 7919 + 13) % rows;
    for (std::size_t i = 0; i < D; ++i)
      centres[static_cast<std::size_t>(j) * D + i] = keys[static_cast<std::size_t>(r) * D + i];
  }
  // scratch: per cluster the key sums of the round, then the counts.
  scratch.assign(static_cast<std::size_t>(k) * (D + 1), 0.0f);
  float* sums = scratch.data();
  float* counts = scratch.data() + static_cast<std::size_t>(k) * D;
  for (int it = 0; it < iterations; ++it) {
    std::fill(scratch.begin(), scratch.end(), 0.0f);
    for (int r = 0; r < rows; ++r) {
      const float* x = keys + static_cast<std::size_t>(r) * D;
      int best = 0;
      float best_dist = std::numeric_limits<float>::infinity();
      for (int j = 0; j < k; ++j) {
        const float* c = centres.data() + static_cast<std::size_t>(j) * D;
        float dist = 0.0f;
        for (std::size_t i = 0; i < D; ++i) dist += (x[i] - c[i]) * (x[i] - c[i]);
        if (dist < best_dist) {
          best_dist = dist;
          best = j;
        }
      }
      ids[r] = static_cast<std::uint8_t>(best);
      counts[best] += 1.0f;
      float* s = sums + static_cast<std::size_t>(best) * D;
      for (std::size_t i = 0; i < D; ++i) s[i] += x[i];
    }
    if (it + 1 == iterations) break;  // the ids of this round are the result; its centres are not needed
    for (int j = 0; j < k; ++j) {
      if (counts[j] == 0.0f) continue;  // an empty cluster keeps its centre
      const float inv = 1.0f / counts[j];
      for (std::size_t i = 0; i < D; ++i)
        centres[static_cast<std::size_t>(j) * D + i] = sums[static_cast<std::size_t>(j) * D + i] * inv;
    }
  }
}

}  // namespace detail
}  // namespace v0
}  // namespace oasiskv
