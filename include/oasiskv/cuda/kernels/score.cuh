// Block scoring (nvcc only): scores of the candidate blocks against the lookahead queries with the
// configured scorer (CacheConfig::scorer), reduced over each kv head's group as GroupReduction says:
// score_kernel from the min/max summaries (quest, spread), run_score_kernel from the run key sums
// (runs).
#pragma once

#include <cstdint>

#include "oasiskv/cuda/kernels/common.cuh"
#include "oasiskv/kit/score_formulas.hpp"  // kScoreLanes: the bound's summation order

namespace oasiskv {
inline namespace v0 {
namespace gpu {
namespace kernels {

// The CPU's lane tree (sum_lanes): ((0+4)+(2+6)) + ((1+5)+(3+7)).
__device__ __forceinline__ float lane_tree(const float* l) {
  return __fadd_rn(__fadd_rn(__fadd_rn(l[0], l[4]), __fadd_rn(l[2], l[6])),
                   __fadd_rn(__fadd_rn(l[1], l[5]), __fadd_rn(l[3], l[7])));
}

// One (block, query) score of BlockScore K: the CPU's quest_bound / SpreadLanes / MassLanes
// (oasiskv/kit/score_formulas.hpp), channel c into lane c % 8 with the same operations, rounded one by one (no
// contraction), then the same finish.
template <BlockScore K>
struct ScoreLanes;

template <>
struct ScoreLanes<BlockScore::quest> {
  float bound[kScoreLanes] = {};
  __device__ __forceinline__ void add(int j, float q, float mx, float mn) {
    bound[j] = __fadd_rn(bound[j], fmax_cpu(__fmul_rn(q, mx), __fmul_rn(q, mn)));
  }
  __device__ __forceinline__ float finish(const ScoreParams&) const { return lane_tree(bound); }
};

template <>
struct ScoreLanes<BlockScore::spread> {
  float centre[kScoreLanes] = {}, range[kScoreLanes] = {};
  __device__ __forceinline__ void add(int j, float q, float mx, float mn) {
    const float c = __fmul_rn(__fadd_rn(mx, mn), 0.5f), r = __fsub_rn(mx, mn);
    centre[j] = __fadd_rn(centre[j], __fmul_rn(q, c));
    range[j] = __fadd_rn(range[j], __fmul_rn(fabsf(q), r));
  }
  __device__ __forceinline__ float finish(const ScoreParams& p) const {
    return __fadd_rn(lane_tree(centre), __fmul_rn(p.half_alpha, lane_tree(range)));
  }
};

inline constexpr int kScoreTile = 32;      // candidate blocks per thread block
inline constexpr int kScoreThreads = 128;  // 4 warps: warp w takes queries w, w + 4, ...

// The candidate tile of a scoring thread block: pair p = blockIdx.x (batch entry i, kv head h,
// sequence slot s), its candidate blocks [first, first + n) (n and first written to out by one
// thread of tile 0), and this block's tile [j0, j0 + tn) of them. false when the tile lies past
// the candidates (uniform over the thread block: it returns at once).
struct ScoreTile {
  int p = 0, i = 0, h = 0, s = 0, tn = 0;
  std::int64_t first = 0, j0 = 0;
};
__device__ __forceinline__ bool score_tile(const CacheLayout& g, const DeviceBatch& batch, const ScoreBuffers& out,
                                           bool current, int next_rows, ScoreTile& t) {
  const int H = g.num_kv_heads();
  t.p = static_cast<int>(blockIdx.x);
  t.i = t.p / H;
  t.h = t.p % H;
  t.first = g.sink_blocks;
  const std::int64_t len = batch.seq_len[t.i];
  const std::int64_t n =
      (current ? g.current_candidates_end(len) : g.next_step_candidates_end(len, next_rows)) - t.first;
  if (blockIdx.y == 0 && threadIdx.x == 0) {
    out.count[t.p] = static_cast<std::int32_t>(n);
    out.first[t.p] = static_cast<std::int32_t>(t.first);
  }
  t.j0 = static_cast<std::int64_t>(blockIdx.y) * kScoreTile;
  if (t.j0 >= n) return false;
  t.tn = static_cast<int>(n - t.j0 < kScoreTile ? n - t.j0 : kScoreTile);
  t.s = batch.seq_slot[t.i];
  return true;
}

// Query qi (= lookahead row qi / G, query head qi % G of kv head h's group) of the tile's entry:
// q is [batch * rows][num_q_heads][head_dim].
template <class QT>
__device__ __forceinline__ const QT* group_query(const CacheLayout& g, const ScoreTile& t, const QT* q, int rows,
                                                 int qi) {
  const int G = g.group_size;
  return q + ((static_cast<std::int64_t>(t.i) * rows + qi / G) * g.num_q_heads() + t.h * G + qi % G) * g.head_dim();
}

// The group reduction of a tile's scores (max or sum; softmax_sum has its own kernel): thread j
// folds bound[qi][j] over the queries in order, as LookaheadSelector::score does.
__device__ __forceinline__ void reduce_group(const CacheLayout& g, const float* bound, int tn, int Q,
                                             const ScoreBuffers& out, int p, std::int64_t j0) {
  if (static_cast<int>(threadIdx.x) >= tn) return;
  const bool is_max = g.config.reduction == GroupReduction::max;
  float sc = is_max ? -INFINITY : 0.0f;
  for (int qi = 0; qi < Q; ++qi) {
    const float b = bound[qi * kScoreTile + threadIdx.x];
    sc = is_max ? fmax_cpu(sc, b) : __fadd_rn(sc, b);
  }
  out.scores[static_cast<std::int64_t>(p) * out.stride + j0 + threadIdx.x] = sc;
}

// Grid: (pairs, ceil(max candidates / kScoreTile)). The tile's summaries are staged in shared
// memory (row stride 2d+1 floats: conflict-free); lane j of every warp computes quest_bound of
// block j for its queries with scorer K (g.score, the host's constants), summed in the CPU's lane
// order (oasiskv/kit/score_formulas.hpp); then thread j reduces over the queries in order. softmax_sum writes the raw
// scores for softmax_kernel instead. K is chosen at the launch (score_blocks).
template <class QT, BlockScore K>
__global__ void __launch_bounds__(kScoreThreads)
    score_kernel(CacheLayout g, int layer, DeviceBatch batch, const QT* q, int rows, const float* summaries,
                 ScoreBuffers out, bool current, int next_rows) {
  extern __shared__ float smem[];
  ScoreTile t;
  if (!score_tile(g, batch, out, current, next_rows, t)) return;  // uniform over the thread block
  const int d = g.head_dim();
  const int p = t.p, tn = t.tn;
  const std::int64_t j0 = t.j0;
  const float* src = summaries + g.summary_offset(t.s, layer, t.h, t.first + j0);
  const int row = 2 * d + 1;
  for (int e = static_cast<int>(threadIdx.x); e < tn * 2 * d; e += blockDim.x) {
    smem[(e / (2 * d)) * row + e % (2 * d)] = src[e];
  }
  __syncthreads();
  const bool softmax = g.config.reduction == GroupReduction::softmax_sum;
  float* bound = smem + kScoreTile * row;  // [Q][kScoreTile]
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int Q = rows * g.group_size;
  for (int qi = warp; qi < Q; qi += kScoreThreads / 32) {
    if (lane < tn) {
      const QT* qv = group_query(g, t, q, rows, qi);
      const float* mx = smem + lane * row;
      const float* mn = mx + d;
      // The CPU's order: channel c into lane c % 8, then the fixed lane tree.
      // Lanes indexed by constants (unrolled by 8) stay in registers, not in local memory.
      ScoreLanes<K> lanes;
      int c0 = 0;
      for (; c0 + kScoreLanes <= d; c0 += kScoreLanes) {
#pragma unroll
        for (int j = 0; j < kScoreLanes; ++j) lanes.add(j, to_f(qv[c0 + j]), mx[c0 + j], mn[c0 + j]);
      }
#pragma unroll
      for (int j = 0; j < kScoreLanes; ++j) {
        if (c0 + j < d) lanes.add(j, to_f(qv[c0 + j]), mx[c0 + j], mn[c0 + j]);
      }
      const float acc = lanes.finish(g.score);
      if (softmax) {
        out.bounds[(static_cast<std::int64_t>(p) * Q + qi) * out.stride + j0 + lane] = acc;
      } else {
        bound[qi * kScoreTile + lane] = acc;
      }
    }
  }
  if (softmax) return;
  __syncthreads();
  reduce_group(g, bound, tn, Q, out, p, j0);
}

// BlockScore::runs (run_means_score, oasiskv/kit/score_formulas.hpp). Grid and outputs as
// score_kernel's, but `run_sums` are the run key sums (CacheLayout::run_offset): a block has
// g.score.runs of them, too many to stage a tile's all at once, so the tile is staged one run at a
// time (row stride d+1) and lane j of every warp keeps, for each of its queries, the best run so
// far of block j in shared memory. Each dot is summed in the CPU's lanes and tree, rounded one by
// one, and the runs are compared as std::max does: the CPU's bits.
template <class QT>
__global__ void __launch_bounds__(kScoreThreads)
    run_score_kernel(CacheLayout g, int layer, DeviceBatch batch, const QT* q, int rows, const float* run_sums,
                     ScoreBuffers out, bool current, int next_rows) {
  extern __shared__ float smem[];
  ScoreTile t;
  if (!score_tile(g, batch, out, current, next_rows, t)) return;  // uniform over the thread block
  const int d = g.head_dim();
  const int runs = g.score.runs;
  const int p = t.p, tn = t.tn;
  const std::int64_t j0 = t.j0;
  const float* src = run_sums + g.run_offset(t.s, layer, t.h, t.first + j0);
  const int row = d + 1;
  float* best = smem + kScoreTile * row;  // [Q][kScoreTile]
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int Q = rows * g.group_size;
  for (int qi = warp; qi < Q; qi += kScoreThreads / 32) best[qi * kScoreTile + lane] = -INFINITY;
  for (int r = 0; r < runs; ++r) {
    __syncthreads();  // the previous run's tile is read
    for (int e = static_cast<int>(threadIdx.x); e < tn * d; e += blockDim.x) {
      smem[(e / d) * row + e % d] = src[static_cast<std::int64_t>(e / d) * runs * d + r * d + e % d];
    }
    __syncthreads();
    for (int qi = warp; qi < Q; qi += kScoreThreads / 32) {
      if (lane < tn) {
        const QT* qv = group_query(g, t, q, rows, qi);
        const float* sum = smem + lane * row;
        float dot[kScoreLanes] = {};
        int c0 = 0;
        for (; c0 + kScoreLanes <= d; c0 += kScoreLanes) {
#pragma unroll
          for (int j = 0; j < kScoreLanes; ++j) dot[j] = __fadd_rn(dot[j], __fmul_rn(to_f(qv[c0 + j]), sum[c0 + j]));
        }
#pragma unroll
        for (int j = 0; j < kScoreLanes; ++j) {
          if (c0 + j < d) dot[j] = __fadd_rn(dot[j], __fmul_rn(to_f(qv[c0 + j]), sum[c0 + j]));
        }
        float& b = best[qi * kScoreTile + lane];
        b = fmax_cpu(b, __fmul_rn(g.score.run_scale, lane_tree(dot)));
      }
    }
  }
  if (g.config.reduction == GroupReduction::softmax_sum) {
    for (int qi = warp; qi < Q; qi += kScoreThreads / 32) {
      if (lane < tn)
        out.bounds[(static_cast<std::int64_t>(p) * Q + qi) * out.stride + j0 + lane] = best[qi * kScoreTile + lane];
    }
    return;
  }
  __syncthreads();
  reduce_group(g, best, tn, Q, out, p, j0);
}

inline constexpr int kSoftmaxThreads = 256;

// Grid: pairs. For each query in order: max over the blocks (exact in any order), exp in
// parallel, the normaliser summed sequentially by one thread (the CPU's order), then
// scores[j] += row[j] / total.
template <int = 0>
__global__ void __launch_bounds__(kSoftmaxThreads) softmax_kernel(CacheLayout g, int rows, ScoreBuffers out) {
  __shared__ float red[kSoftmaxThreads];
  __shared__ float total_s;
  const int p = static_cast<int>(blockIdx.x);
  const int n = out.count[p];
  if (n <= 0) return;
  const int Q = rows * g.group_size;
  float* sc = out.scores + static_cast<std::int64_t>(p) * out.stride;
  for (int j = static_cast<int>(threadIdx.x); j < n; j += blockDim.x) sc[j] = 0.0f;
  for (int qi = 0; qi < Q; ++qi) {
    float* row = out.bounds + (static_cast<std::int64_t>(p) * Q + qi) * out.stride;
    float m = -INFINITY;
    for (int j = static_cast<int>(threadIdx.x); j < n; j += blockDim.x) m = fmax_cpu(m, row[j]);
    red[threadIdx.x] = m;
    __syncthreads();
    for (int w = kSoftmaxThreads / 2; w > 0; w /= 2) {
      if (static_cast<int>(threadIdx.x) < w) red[threadIdx.x] = fmax_cpu(red[threadIdx.x], red[threadIdx.x + w]);
      __syncthreads();
    }
    const float top = red[0];
    for (int j = static_cast<int>(threadIdx.x); j < n; j += blockDim.x) {
      row[j] = expf(__fmul_rn(__fsub_rn(row[j], top), g.score.softmax_scale));
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float t = 0.0f;
      for (int j = 0; j < n; ++j) t = __fadd_rn(t, row[j]);
      total_s = t;
    }
    __syncthreads();
    const float total = total_s;
    for (int j = static_cast<int>(threadIdx.x); j < n; j += blockDim.x) {
      sc[j] = __fadd_rn(sc[j], __fdiv_rn(row[j], total));
    }
    __syncthreads();
  }
}

}  // namespace kernels
}  // namespace gpu
}  // namespace v0
}  // namespace oasiskv
