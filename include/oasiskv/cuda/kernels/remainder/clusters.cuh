// `remainder = clusters` on the device (nvcc only; the host side: cuda/detail/remainder/
// clusters.hpp). append_moments_kernel and rebuild_moments_kernel keep each block's key and value
// sums ([key sum | value sum][head_dim], CacheLayout::moment_offset) bit for bit as the CPU's
// BlockMoments does: rows folded in order, a block's first row resets, and the explicitly rounded
// intrinsics keep nvcc from contracting. cluster_segment_kernel clusters a filled segment as the
// CPU's k-means does; remainder_kernel computes the attention state of the blocks (and clusters) a
// view leaves out, as the CPU's centroid_state.
#pragma once

#include <cstdint>

#include "oasiskv/cuda/kernels/append.cuh"  // AppendLane
#include "oasiskv/cuda/kernels/common.cuh"
#include "oasiskv/cuda/kernels/truncate.cuh"  // RebuildHead

namespace oasiskv {
inline namespace v0 {
namespace gpu {
namespace kernels {

inline constexpr int kRemainderThreads = 128;
inline constexpr int kMomentThreads = 256;

// Folds key row k and value row v (channel c) into a block's sums m: BlockMoments::add_row.
__device__ __forceinline__ void fold_moment(float* m, int d, int c, float kf, float vf, bool reset) {
  if (reset) {
    m[c] = kf;
    m[d + c] = vf;
  } else {
    m[c] = __fadd_rn(m[c], kf);
    m[d + c] = __fadd_rn(m[d + c], vf);
  }
}

// append_kernel's grid and walk (batch entry, channel chunk; AppendLane): the new rows folded into
// their blocks' moments.
template <class T>
__global__ void __launch_bounds__(kMomentThreads)
    append_moments_kernel(CacheLayout g, int layer, DeviceBatch batch, const std::int32_t* row_offset, const T* k,
                          const T* v, float* moments) {
  AppendLane a;
  if (!append_lane(g, batch, row_offset, a)) return;
  const std::int64_t bt = g.block_tokens();
  for (std::int32_t r = a.r0; r < a.r1; ++r) {
    const std::int64_t pos = a.len + (r - a.r0);
    const std::int64_t src = a.src(r);
    fold_moment(moments + g.moment_offset(a.s, layer, a.h, pos / bt), a.d, a.c, to_f(k[src]), to_f(v[src]),
                pos % bt == 0);
  }
}

// Grid: kv_heads. (dst_slot, layer) at `length`: the moments of blocks [0, length / block_tokens)
// copied from src_slot when it differs (a fork), the partial block's refolded from its host rows.
template <class T>
__global__ void __launch_bounds__(kMomentThreads)
    rebuild_moments_kernel(CacheLayout g, int src_slot, int dst_slot, int layer, std::int64_t length,
                           DeviceHostTier<T> host, float* moments) {
  const RebuildHead r = rebuild_head(g, length);
  if (src_slot != dst_slot) {
    copy_block_floats(moments + g.moment_offset(src_slot, layer, r.h, 0),
                      moments + g.moment_offset(dst_slot, layer, r.h, 0), r.cut * g.remainder.moment_vectors * r.d);
  }
  if (r.partial_rows == 0) return;
  const T* hb = host.block(g, dst_slot, layer, r.h, r.cut);
  float* m = moments + g.moment_offset(dst_slot, layer, r.h, r.cut);
  const int d = r.d;
  const std::int64_t bt = r.bt;
  for (int c = static_cast<int>(threadIdx.x); c < d; c += static_cast<int>(blockDim.x)) {
    for (std::int64_t off = 0; off < r.partial_rows; ++off) {
      fold_moment(m, d, c, to_f(hb[off * d + c]), to_f(hb[(bt + off) * d + c]), off == 0);
    }
  }
}

// The centroid logit of n rows with key sum m[0, d) (centroid_state, cpu/detail/remainder/
// block_moments.hpp): log n + s q.mean; q in shared memory, m in global memory.
__device__ __forceinline__ float centroid_logit(const float* q, const float* m, int d, int n, float scale) {
  const float inv_n = 1.0f / static_cast<float>(n);
  float dot = 0.0f;
  for (int c = 0; c < d; ++c) dot += q[c] * m[c];
  return logf(static_cast<float>(n)) + scale * dot * inv_n;
}

// ---- RemainderEstimate::clusters (cpu/detail/remainder/key_clusters.hpp, src/cpu/key_clusters.cpp) ----

inline constexpr int kClusterThreads = 256;

// Grid: kv_heads. Thread block h clusters segment `segment` of (slot, layer, h) as kmeans_keys and
// KeyClusters::cluster do, so the result is the CPU's bit for bit: the same start rows, rounds and
// tie rule (the first nearest centre), every sum in row order by one thread per channel, and the
// arithmetic in explicitly rounded intrinsics (no contraction into FMA). During the rounds a
// cluster's [key sum | value sum] holds [its centre | the round's key sum]. scratch: the keys as
// floats, [kv head][segment rows][d].
// (At least 2 blocks per SM: without a minimum ptxas held it to 48 registers and spilled.)
template <class T>
__global__ void __launch_bounds__(kClusterThreads, 2)
    cluster_segment_kernel(CacheLayout g, int slot, int layer, std::int64_t segment, DeviceHostTier<T> host,
                           DeviceClusters cl, float* scratch) {
  const int h = static_cast<int>(blockIdx.x);
  const int d = g.head_dim(), k = cl.k, rows = cl.segment_rows, tid = static_cast<int>(threadIdx.x);
  const std::int64_t bt = g.block_tokens();
  const std::int64_t u = cl.unit(g, slot, layer, h, segment);
  const std::int64_t first = segment * kClusterSegmentBlocks;
  float* sums = cl.sums + u * k * 2 * d;
  std::int32_t* counts = cl.counts + u * k;
  std::uint8_t* ids = cl.ids + u * rows;
  float* keys = scratch + static_cast<std::int64_t>(h) * rows * d;
  const auto count_rows = [&] {  // thread 0: the rows of each cluster under the current ids
    for (int j = 0; j < k; ++j) counts[j] = 0;
    for (int r = 0; r < rows; ++r) counts[ids[r]] += 1;
  };
  for (std::int64_t e = tid; e < static_cast<std::int64_t>(rows) * d; e += blockDim.x) {
    const std::int64_t r = e / d, c = e % d;
    keys[e] = to_f(host.block(g, slot, layer, h, first + r / bt)[(r % bt) * d + c]);
  }
  __syncthreads();
  for (std::int64_t e = tid; e < static_cast<std::int64_t>(k) * d; e += blockDim.x) {  // centre j: row j 7919 + 13
    const std::int64_t j = e / d, c = e % d;
    sums[j * 2 * d + c] = keys[((j * 7919 + 13) % rows) * d + c];
  }
  __syncthreads();
  for (int it = 0; it < kClusterRounds; ++it) {
    for (int r = tid; r < rows; r += blockDim.x) {
      const float* x = keys + static_cast<std::int64_t>(r) * d;
      int best = 0;
      float best_dist = INFINITY;
      for (int j = 0; j < k; ++j) {
        const float* centre = sums + static_cast<std::int64_t>(j) * 2 * d;
        float dist = 0.0f;
        for (int c = 0; c < d; ++c) {
          const float t = __fsub_rn(x[c], centre[c]);
          dist = __fadd_rn(dist, __fmul_rn(t, t));
        }
        if (dist < best_dist) {
          best_dist = dist;
          best = j;
        }
      }
      ids[r] = static_cast<std::uint8_t>(best);
    }
    __syncthreads();
    if (it + 1 == kClusterRounds) break;  // the ids of the last round are the result
    for (int c = tid; c < d; c += blockDim.x) {
      for (int j = 0; j < k; ++j) sums[static_cast<std::int64_t>(j) * 2 * d + d + c] = 0.0f;
      for (int r = 0; r < rows; ++r) {
        float* s = sums + static_cast<std::int64_t>(ids[r]) * 2 * d + d + c;
        *s = __fadd_rn(*s, keys[static_cast<std::int64_t>(r) * d + c]);
      }
    }
    if (tid == 0) count_rows();
    __syncthreads();
    for (std::int64_t e = tid; e < static_cast<std::int64_t>(k) * d; e += blockDim.x) {
      const std::int64_t j = e / d, c = e % d;
      if (counts[j] == 0) continue;  // an empty cluster keeps its centre
      const float inv = __fdiv_rn(1.0f, static_cast<float>(counts[j]));
      sums[j * 2 * d + c] = __fmul_rn(sums[j * 2 * d + d + c], inv);
    }
    __syncthreads();
  }
  // The clusters' key and value sums (row order) and row counts.
  for (int c = tid; c < d; c += blockDim.x) {
    for (int j = 0; j < k; ++j) {
      sums[static_cast<std::int64_t>(j) * 2 * d + c] = 0.0f;
      sums[static_cast<std::int64_t>(j) * 2 * d + d + c] = 0.0f;
    }
    for (int r = 0; r < rows; ++r) {
      float* s = sums + static_cast<std::int64_t>(ids[r]) * 2 * d;
      s[c] = __fadd_rn(s[c], keys[static_cast<std::int64_t>(r) * d + c]);
      s[d + c] = __fadd_rn(s[d + c], to_f(host.block(g, slot, layer, h, first + r / bt)[(bt + r % bt) * d + c]));
    }
  }
  if (tid == 0) {
    count_rows();
    cl.clustered[u] = 1;
  }
}

// Grid: (pair p = batch entry i * kv_heads + h, row r * group_size + j): the state of query head
// h * group_size + j of row r of entry i over the blocks of [0, blocks_for(len)) that the view's
// pair p (indptr, block: ascending) does not hold. One pass in tiles of kRemainderThreads units:
// each thread scores one unit (a block, or a key cluster of a clustered segment), the tile's
// weights and value sums' addresses go to shared memory, threads then take channels and add the
// weighted value sums (rescaled when the running max rises, as flash decoding does). Shared
// memory: value-sum pointers [kRemainderThreads], q[d], acc[d], w[kRemainderThreads], 32 floats,
// then (clusters) a segment's resident rows per cluster, [cl.k] int32.
// (At least 4 blocks per SM: without a minimum ptxas spilled on sm_90 once clusters were added.)
template <class QT>
__global__ void __launch_bounds__(kRemainderThreads, 4)
    remainder_kernel(CacheLayout g, int layer, DeviceBatch batch, const std::int32_t* indptr,
                     const std::int32_t* view_block, const QT* q, int rows, const float* moments, float* out,
                     float* lse, DeviceClusters cl) {
  extern __shared__ float smem[];
  const int d = g.head_dim(), H = g.num_kv_heads(), G = g.group_size;
  const float** vs = reinterpret_cast<const float**>(smem);  // 8-byte aligned: first
  float* qs = smem + 2 * kRemainderThreads;
  float* acc = qs + d;
  float* ws = acc + d;
  float* red = ws + kRemainderThreads;
  std::int32_t* resident_rows = reinterpret_cast<std::int32_t*>(red + 32);  // [cl.k]
  const int p = static_cast<int>(blockIdx.x);
  const int i = p / H, h = p % H;
  const int r = static_cast<int>(blockIdx.y) / G;
  const std::int64_t state =
      (static_cast<std::int64_t>(i) * rows + r) * g.num_q_heads() + h * G + static_cast<int>(blockIdx.y) % G;
  const int tid = static_cast<int>(threadIdx.x);
  for (int c = tid; c < d; c += blockDim.x) {
    qs[c] = to_f(q[state * d + c]);
    acc[c] = 0.0f;
  }
  const int s = batch.seq_slot[i];
  const std::int64_t len = batch.seq_len[i];
  const std::int64_t bt = g.block_tokens();
  const std::int64_t nb = g.blocks_for(len);
  const std::int32_t lo = indptr[p], hi = indptr[p + 1];
  float m = -INFINITY, total = 0.0f;
  // Merges one tile of `units` units: this thread's (logit, 1 / its rows, its value sum) with the
  // block's state. Called by every thread alike (it holds barriers).
  const auto merge = [&](float logit, float inv_n, const float* value_sum, int units) {
    const float top = block_max(logit, red);
    if (top == -INFINITY) return;  // nothing in this tile (uniform: no barrier skipped)
    const float next = fmaxf(m, top);
    const float rescale = m == -INFINITY ? 0.0f : expf(m - next);
    const float w = logit == -INFINITY ? 0.0f : expf(logit - next);
    ws[tid] = w * inv_n;  // the value sum to the mean value
    vs[tid] = value_sum;
    total = total * rescale + block_sum(w, red);  // its first barrier publishes ws and vs
    for (int c = tid; c < d; c += blockDim.x) {
      float x = acc[c] * rescale;
      for (int j = 0; j < units; ++j) {
        if (ws[j] != 0.0f) x += ws[j] * vs[j][c];
      }
      acc[c] = x;
    }
    m = next;
    __syncthreads();  // ws and vs are rewritten by the next tile
  };
  // Whether segment `seg` is clustered: its blocks count through its clusters (below).
  const auto clustered = [&](std::int64_t seg) {
    return cl.clustered != nullptr && seg < cl.segments && cl.clustered[cl.unit(g, s, layer, h, seg)] != 0;
  };
  __syncthreads();
  for (std::int64_t base = 0; base < nb; base += kRemainderThreads) {
    const std::int64_t b = base + tid;
    float logit = -INFINITY, inv_n = 0.0f;
    const float* value_sum = nullptr;
    if (b < nb && !clustered(b / kClusterSegmentBlocks)) {
      std::int32_t a = lo, z = hi;  // binary search of b in the pair's ascending blocks
      while (a < z) {
        const std::int32_t mid = a + (z - a) / 2;
        if (view_block[mid] < b)
          a = mid + 1;
        else
          z = mid;
      }
      if (a == hi || view_block[a] != b) {
        const int n = static_cast<int>(len - b * bt < bt ? len - b * bt : bt);
        const float* mo = moments + g.moment_offset(s, layer, h, b);
        logit = centroid_logit(qs, mo, d, n, g.softmax_scale);
        inv_n = 1.0f / static_cast<float>(n);
        value_sum = mo + d;
      }
    }
    const std::int64_t units = nb - base < kRemainderThreads ? nb - base : kRemainderThreads;
    merge(logit, inv_n, value_sum, static_cast<int>(units));
  }
  // Clustered segments (KeyClusters::add_estimate_blocks): each cluster with rows outside the
  // view's blocks, its centroid logit weighted by those rows' share.
  for (std::int64_t seg = 0; cl.clustered != nullptr && seg < nb / kClusterSegmentBlocks; ++seg) {
    if (!clustered(seg)) continue;  // uniform over the thread block
    const std::int64_t u = cl.unit(g, s, layer, h, seg);
    const std::uint8_t* ids = cl.ids + u * cl.segment_rows;
    for (int c = tid; c < cl.k; c += blockDim.x) resident_rows[c] = 0;
    __syncthreads();
    const std::int64_t b0 = seg * kClusterSegmentBlocks;
    for (std::int32_t e = lo; e < hi; ++e) {  // the view's blocks in this segment, every row
      const std::int64_t b = view_block[e];
      if (b < b0 || b >= b0 + kClusterSegmentBlocks) continue;
      for (std::int64_t r = tid; r < bt; r += blockDim.x) atomicAdd(&resident_rows[ids[(b - b0) * bt + r]], 1);
    }
    __syncthreads();
    for (int base = 0; base < cl.k; base += kRemainderThreads) {
      const int c = base + tid;
      float logit = -INFINITY, inv_n = 0.0f;
      const float* value_sum = nullptr;
      if (c < cl.k) {
        const std::int32_t n = cl.counts[u * cl.k + c], left = n - resident_rows[c];
        if (left > 0) {
          const float* sums = cl.sums + (u * cl.k + c) * 2 * d;
          logit = centroid_logit(qs, sums, d, n, g.softmax_scale);
          if (left != n) logit += logf(static_cast<float>(left)) - logf(static_cast<float>(n));
          inv_n = 1.0f / static_cast<float>(n);
          value_sum = sums + d;
        }
      }
      merge(logit, inv_n, value_sum, cl.k - base < kRemainderThreads ? cl.k - base : kRemainderThreads);
    }
  }
  const bool empty = m == -INFINITY || !(total > 0.0f);
  for (int c = tid; c < d; c += blockDim.x) out[state * d + c] = empty ? 0.0f : acc[c] / total;
  if (tid == 0) lse[state] = empty ? -INFINITY : m + logf(total);
}

}  // namespace kernels
}  // namespace gpu
}  // namespace v0
}  // namespace oasiskv
