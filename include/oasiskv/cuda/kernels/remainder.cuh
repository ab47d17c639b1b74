// The remainder estimate on the device (nvcc only; CacheConfig::remainder, Cache::remainder).
// append_moments_kernel and rebuild_moments_kernel keep each block's moments ([key sum | value
// sum (| key sum of squares)][head_dim], CacheLayout::moment_offset) bit for bit as the CPU's
// SummaryStore does: rows folded in order, a block's first row resets, and the explicitly rounded
// intrinsics keep nvcc from contracting x * x + s into an FMA. remainder_kernel computes the
// attention state of the blocks a view leaves out (oasiskv/remainder.hpp's formulas).
#pragma once

#include <cstdint>

#include "oasiskv/cuda/kernels/common.cuh"

namespace oasiskv {
inline namespace v0 {
namespace gpu {
namespace kernels {

inline constexpr int kMomentThreads = 256;
inline constexpr int kRemainderThreads = 128;

// Folds key row k and value row v (channel c) into moments m: fold_moments of summary.hpp.
__device__ __forceinline__ void fold_moment(float* m, int vectors, int d, int c, float kf, float vf, bool reset) {
  if (reset) {
    m[c] = kf;
    m[d + c] = vf;
    if (vectors == 3) m[2 * d + c] = __fmul_rn(kf, kf);
  } else {
    m[c] = __fadd_rn(m[c], kf);
    m[d + c] = __fadd_rn(m[d + c], vf);
    if (vectors == 3) m[2 * d + c] = __fadd_rn(m[2 * d + c], __fmul_rn(kf, kf));
  }
}

// append_kernel's grid and walk (batch entry, channel chunk): the new rows folded into their
// blocks' moments.
template <class T>
__global__ void __launch_bounds__(kMomentThreads)
    append_moments_kernel(CacheLayout g, int layer, DeviceBatch batch, const std::int32_t* row_offset, const T* k,
                          const T* v, float* moments) {
  const int i = static_cast<int>(blockIdx.x);
  const int H = g.num_kv_heads();
  const int d = g.head_dim();
  const int hc = static_cast<int>(blockIdx.y * blockDim.x + threadIdx.x);
  if (i >= batch.size || hc >= H * d) return;
  const int h = hc / d;
  const int c = hc % d;
  const int s = batch.seq_slot[i];
  const std::int64_t len = batch.seq_len[i];
  const std::int32_t r0 = row_offset[i];
  const std::int32_t r1 = row_offset[i + 1];
  const std::int64_t bt = g.block_tokens();
  for (std::int32_t r = r0; r < r1; ++r) {
    const std::int64_t pos = len + (r - r0);
    const std::int64_t src = (static_cast<std::int64_t>(r) * H + h) * d + c;
    fold_moment(moments + g.moment_offset(s, layer, h, pos / bt), g.moment_vectors, d, c, to_f(k[src]), to_f(v[src]),
                pos % bt == 0);
  }
}

// Grid: kv_heads. (dst_slot, layer) at `length`: the moments of blocks [0, length / block_tokens)
// copied from src_slot when it differs (a fork), the partial block's refolded from its host rows.
template <class T>
__global__ void __launch_bounds__(kMomentThreads)
    rebuild_moments_kernel(CacheLayout g, int src_slot, int dst_slot, int layer, std::int64_t length,
                           DeviceHostTier<T> host, float* moments) {
  const int h = static_cast<int>(blockIdx.x);
  const int d = g.head_dim();
  const std::int64_t bt = g.block_tokens();
  const std::int64_t cut = length / bt;
  if (src_slot != dst_slot) {
    const float* from = moments + g.moment_offset(src_slot, layer, h, 0);
    float* to = moments + g.moment_offset(dst_slot, layer, h, 0);
    for (std::int64_t e = threadIdx.x; e < cut * g.moment_vectors * d; e += blockDim.x) to[e] = from[e];
  }
  if (length % bt == 0) return;
  const T* hb = host.block(g, dst_slot, layer, h, cut);
  float* m = moments + g.moment_offset(dst_slot, layer, h, cut);
  for (int c = static_cast<int>(threadIdx.x); c < d; c += static_cast<int>(blockDim.x)) {
    for (std::int64_t off = 0; off < length - cut * bt; ++off) {
      fold_moment(m, g.moment_vectors, d, c, to_f(hb[off * d + c]), to_f(hb[(bt + off) * d + c]), off == 0);
    }
  }
}

// Max over the thread block; every thread gets it. `shared` holds 32 values; begins with a barrier.
__device__ __forceinline__ float block_max(float x, float* shared) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_down_sync(0xffffffffu, x, o));
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  __syncthreads();
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  float top = -INFINITY;
  for (int w = 0; w < static_cast<int>(blockDim.x) / 32; ++w) top = fmaxf(top, shared[w]);
  return top;
}

// remainder_logit (oasiskv/remainder.hpp) of one block: q in shared memory, its moments and its
// Quest summary ([max | min][d]) in global memory.
__device__ __forceinline__ float block_logit(RemainderEstimate kind, const float* q, const float* m,
                                             const float* summary, int d, int n, float scale, float sigma) {
  const float inv_n = 1.0f / static_cast<float>(n);
  float dot = 0.0f;
  for (int c = 0; c < d; ++c) dot += q[c] * m[c];
  const float log_n = logf(static_cast<float>(n));
  float logit = log_n + scale * dot * inv_n;
  if (kind == RemainderEstimate::centroid) return logit;
  float spread = 0.0f, bound = 0.0f;
  for (int c = 0; c < d; ++c) {
    const float hi = summary[c], lo = summary[d + c];
    bound += fmax_cpu(q[c] * hi, q[c] * lo);
    if (kind == RemainderEstimate::gaussian) {
      const float r = (hi - lo) * q[c];
      spread += r * r;
    } else {
      const float mu = m[c] * inv_n;
      spread += q[c] * q[c] * fmax_cpu(m[2 * d + c] * inv_n - mu * mu, 0.0f);
    }
  }
  logit += kind == RemainderEstimate::gaussian ? 0.5f * scale * scale * sigma * sigma * spread
                                               : 0.5f * scale * scale * spread;
  return fminf(logit, log_n + scale * bound);  // the block's hard bound (config.hpp)
}

// Grid: (pair p = batch entry i * kv_heads + h, row r * group_size + j): the state of query head
// h * group_size + j of row r of entry i over the blocks of [0, blocks_for(len)) that the view's
// pair p (indptr, block: ascending) does not hold. One pass in tiles of kRemainderThreads blocks:
// each thread scores one block, the tile's weights go to shared memory, threads then take
// channels and add the weighted value sums (rescaled when the running max rises, as flash
// decoding does). Shared memory: q[d], acc[d], w[kRemainderThreads], 32 floats.
template <class QT>
__global__ void __launch_bounds__(kRemainderThreads)
    remainder_kernel(CacheLayout g, int layer, DeviceBatch batch, const std::int32_t* indptr,
                     const std::int32_t* view_block, const QT* q, int rows, const float* summaries,
                     const float* moments, float* out, float* lse) {
  extern __shared__ float smem[];
  const int d = g.head_dim(), H = g.num_kv_heads(), G = g.group_size;
  float* qs = smem;
  float* acc = qs + d;
  float* ws = acc + d;
  float* red = ws + kRemainderThreads;
  const int p = static_cast<int>(blockIdx.x);
  const int i = p / H, h = p % H;
  const int r = static_cast<int>(blockIdx.y) / G;
  const std::int64_t state = (static_cast<std::int64_t>(i) * rows + r) * g.num_q_heads() + h * G +
                             static_cast<int>(blockIdx.y) % G;
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
  const RemainderEstimate kind = g.config.remainder;
  float m = -INFINITY, total = 0.0f;
  __syncthreads();
  for (std::int64_t base = 0; base < nb; base += kRemainderThreads) {
    const std::int64_t b = base + tid;
    float logit = -INFINITY, inv_n = 0.0f;
    if (b < nb) {
      std::int32_t a = lo, z = hi;  // binary search of b in the pair's ascending blocks
      while (a < z) {
        const std::int32_t mid = a + (z - a) / 2;
        if (view_block[mid] < b) a = mid + 1; else z = mid;
      }
      if (a == hi || view_block[a] != b) {
        const int n = static_cast<int>(len - b * bt < bt ? len - b * bt : bt);
        logit = block_logit(kind, qs, moments + g.moment_offset(s, layer, h, b),
                            summaries + g.summary_offset(s, layer, h, b), d, n, g.softmax_scale,
                            g.config.remainder_sigma);
        inv_n = 1.0f / static_cast<float>(n);
      }
    }
    const float top = block_max(logit, red);
    if (top == -INFINITY) continue;  // every block of the tile is resident (uniform: no barrier skipped)
    const float next = fmaxf(m, top);
    const float rescale = m == -INFINITY ? 0.0f : expf(m - next);
    const float w = logit == -INFINITY ? 0.0f : expf(logit - next);
    ws[tid] = w * inv_n;  // the value sum to the mean value
    total = total * rescale + block_sum(w, red);  // its first barrier publishes ws
    const int tile = static_cast<int>(nb - base < kRemainderThreads ? nb - base : kRemainderThreads);
    for (int c = tid; c < d; c += blockDim.x) {
      float x = acc[c] * rescale;
      for (int j = 0; j < tile; ++j) {
        if (ws[j] != 0.0f) x += ws[j] * moments[g.moment_offset(s, layer, h, base + j) + d + c];
      }
      acc[c] = x;
    }
    m = next;
    __syncthreads();  // ws is rewritten by the next tile
  }
  const bool empty = m == -INFINITY || !(total > 0.0f);
  for (int c = tid; c < d; c += blockDim.x) out[state * d + c] = empty ? 0.0f : acc[c] / total;
  if (tid == 0) lse[state] = empty ? -INFINITY : m + logf(total);
}

}  // namespace kernels
}  // namespace gpu
}  // namespace v0
}  // namespace oasiskv
