// The block score formulas both backends compute bit for bit: Quest's bound and the spread score
// of one block's key summary (channel-wise max and min) against one query, summed in kScoreLanes
// fixed lanes; and the runs score from a block's run key sums. The CPU scorers
// (oasiskv/cpu/detail/block_scorer.hpp) and kernels (src/cpu/cpu_kernels.cpp) and the CUDA scoring kernels
// (oasiskv/cuda/kernels/score.cuh) all add in this order, so a selection does not depend on the backend.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>

namespace oasiskv {
inline namespace v0 {

// Lanes of the bound's sum. Fixed, so that every backend adds in the same order and computes
// bit-identical scores; eight independent chains also let the compiler vectorise.
inline constexpr int kScoreLanes = 8;

// Adds lane partial sums in a fixed tree: ((0+4)+(2+6)) + ((1+5)+(3+7)).
inline float sum_lanes(const float* lane) noexcept {
  return ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
}

// Quest's upper bound of q.k over every key k of a block: sum_i max(q_i * max_i, q_i * min_i).
// Channel i goes to lane i % 8. Each term bounds q_i * k_i and float rounding is monotone, so the
// bound is >= q.k summed in the same lane order (the test checks exactly that).
inline float quest_bound(const float* q, const float* key_max, const float* key_min, int head_dim) noexcept {
  float lane[kScoreLanes] = {};
  int i = 0;
  for (; i + kScoreLanes <= head_dim; i += kScoreLanes) {
    for (int j = 0; j < kScoreLanes; ++j) {
      lane[j] += std::max(q[i + j] * key_max[i + j], q[i + j] * key_min[i + j]);
    }
  }
  for (int j = 0; i < head_dim; ++i, ++j) lane[j] += std::max(q[i] * key_max[i], q[i] * key_min[i]);
  return sum_lanes(lane);
}

// Lanes of the spread score (oasiskv/cpu/detail/block_scorer.hpp), channel i into lane i % 8 as
// quest_bound does. Every backend adds one channel with add() and the lanes with finish(), so the
// portable, AVX and CUDA kernels compute the same bits. centre = (max + min) * 0.5 and range =
// max - min per channel, as written here (no contraction: see src/cpu/cpu_kernels.cpp).
struct SpreadLanes {
  float centre[kScoreLanes] = {};  // q_i c_i
  float range[kScoreLanes] = {};   // |q_i| r_i
  void add(int j, float q, float mx, float mn) noexcept {
    const float c = (mx + mn) * 0.5f, r = mx - mn;
    centre[j] += q * c;
    range[j] += std::fabs(q) * r;
  }
  // q.c + half_alpha * sum |q_i| r_i
  float finish(float half_alpha) const noexcept { return sum_lanes(centre) + half_alpha * sum_lanes(range); }
};

template <class Lanes>
inline Lanes score_lanes(const float* q, const float* key_max, const float* key_min, int head_dim) noexcept {
  Lanes l;
  int i = 0;
  for (; i + kScoreLanes <= head_dim; i += kScoreLanes) {
    for (int j = 0; j < kScoreLanes; ++j) l.add(j, q[i + j], key_max[i + j], key_min[i + j]);
  }
  for (int j = 0; i < head_dim; ++i, ++j) l.add(j, q[i], key_max[i], key_min[i]);
  return l;
}

// BlockScore::spread of one block (config.hpp): q.c + 2 half_alpha * 0.5 sum |q_i| r_i.
inline float spread_score(const float* q, const float* key_max, const float* key_min, int head_dim,
                          float half_alpha) noexcept {
  return score_lanes<SpreadLanes>(q, key_max, key_min, head_dim).finish(half_alpha);
}

// BlockScore::runs of one block (config.hpp): the largest over its `runs` runs of scale * q.sum_r,
// sum_r a run's key sum and scale 1 / run_tokens (so q.(mean key of the run)). Each dot is summed
// in kScoreLanes lanes, channel i into lane i % 8, as the other scores.
inline float run_means_score(const float* q, const float* run_sums, int runs, int head_dim, float scale) noexcept {
  float best = -INFINITY;
  for (int r = 0; r < runs; ++r) {
    const float* sum = run_sums + static_cast<std::ptrdiff_t>(r) * head_dim;
    float lane[kScoreLanes] = {};
    int i = 0;
    for (; i + kScoreLanes <= head_dim; i += kScoreLanes) {
      for (int j = 0; j < kScoreLanes; ++j) lane[j] += q[i + j] * sum[i + j];
    }
    for (int j = 0; i < head_dim; ++i, ++j) lane[j] += q[i] * sum[i];
    best = std::max(best, scale * sum_lanes(lane));
  }
  return best;
}

}  // namespace v0
}  // namespace oasiskv
