// The remainder estimate on the device (nvcc only; CacheConfig::remainder, Cache::remainder).
// append_moments_kernel and rebuild_moments_kernel keep each block's moments ([key sum | value
// sum (| key sum of squares)][head_dim], CacheLayout::moment_offset) bit for bit as the CPU's
// SummaryStore does: rows folded in order, a block's first row resets, and the explicitly rounded
// intrinsics keep nvcc from contracting x * x + s into an FMA. remainder_kernel computes the
// attention state of the blocks a view leaves out (oasiskv/remainder.hpp's formulas).
// RemainderEstimate::quantized: encode_quantized_kernel codes blocks from their host rows as
// src/quantized_rows.cpp does (the same bytes: IEEE-rounded subtract, divide and round to nearest
// even), after every append, truncate and fork, so every block with rows has codes (the CPU codes
// only full blocks and codes a partial one when it meets it: the same bytes); and
// remainder_quantized_kernel attends over the decoded rows of the blocks a view leaves out.
#pragma once

#include <cstdint>

#include "oasiskv/cuda/kernels/common.cuh"
#include "oasiskv/quantized_rows.hpp"  // the code format

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
  if (kind == RemainderEstimate::centroid || kind == RemainderEstimate::clusters) return logit;
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

// ---- RemainderEstimate::clusters (detail/key_clusters.hpp, src/key_clusters.cpp) ----

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
                     const std::int32_t* view_block, const QT* q, int rows, const float* summaries,
                     const float* moments, float* out, float* lse, DeviceClusters cl) {
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
        if (view_block[mid] < b) a = mid + 1; else z = mid;
      }
      if (a == hi || view_block[a] != b) {
        const int n = static_cast<int>(len - b * bt < bt ? len - b * bt : bt);
        const float* mo = moments + g.moment_offset(s, layer, h, b);
        logit = block_logit(kind, qs, mo, summaries + g.summary_offset(s, layer, h, b), d, n, g.softmax_scale,
                            g.config.remainder_sigma);
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
          logit = block_logit(kind, qs, sums, nullptr, d, n, g.softmax_scale, g.config.remainder_sigma);
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

// ---- RemainderEstimate::quantized (oasiskv/quantized_rows.hpp's format) ----

inline constexpr int kQuantizedThreads = 128;

// Byte offsets of a block's key codes and value codes (its value scales start at 0).
struct QuantizedParts {
  std::int64_t groups, code_bytes, key_codes, value_codes;
};
__device__ __forceinline__ QuantizedParts quantized_parts(int bt, int d, int bits) {
  QuantizedParts p;
  p.groups = (d + kQuantizedValueGroup - 1) / kQuantizedValueGroup;
  p.code_bytes = (static_cast<std::int64_t>(bt) * d * bits + 7) / 8;
  p.key_codes = static_cast<std::int64_t>(bt) * p.groups * 2 * 4;
  p.value_codes = p.key_codes + p.code_bytes;
  return p;
}

__device__ __forceinline__ float quantized_step(float hi, float lo, float levels) {
  const float step = __fdiv_rn(__fsub_rn(hi, lo), levels);
  return isfinite(step) ? step : __fsub_rn(__fdiv_rn(hi, levels), __fdiv_rn(lo, levels));
}

__device__ __forceinline__ unsigned quantized_code(float x, float lo, float step, float levels) {
  if (!(step > 0.0f)) return 0u;
  const float c = rintf(__fdiv_rn(__fsub_rn(x, lo), step));
  return static_cast<unsigned>(fminf(fmaxf(c, 0.0f), levels));
}

// Code e of a block's stream (32-bit: a block holds far fewer than 2^28 codes).
__device__ __forceinline__ unsigned code_at(const std::uint8_t* p, int e, int bits) {
  const int bit = e * bits;
  const int shift = bit & 7;
  unsigned v = static_cast<unsigned>(p[bit >> 3]) >> shift;
  if (shift + bits > 8) v |= static_cast<unsigned>(p[(bit >> 3) + 1]) << (8 - shift);
  return v & ((1u << bits) - 1u);
}

// One thread block codes the first n rows of a host block (hb: [K | V][bt][d]) with the key
// summary ([max | min][d]) into out. Every byte is written by one thread (the codes overlapping it),
// so no two threads write one byte; the value scales are written first and read back after a barrier.
template <class T>
__device__ void encode_quantized_block(const T* hb, int n, int bt, int d, int bits, const float* summary,
                                       std::uint8_t* out) {
  const QuantizedParts p = quantized_parts(bt, d, bits);
  const float levels = static_cast<float>((1 << bits) - 1);
  float* scales = reinterpret_cast<float*>(out);
  const int tid = static_cast<int>(threadIdx.x), nt = static_cast<int>(blockDim.x);
  for (std::int64_t u = tid; u < static_cast<std::int64_t>(bt) * p.groups; u += nt) {
    const int r = static_cast<int>(u / p.groups), g0 = static_cast<int>(u % p.groups) * kQuantizedValueGroup;
    float lo = 0.0f, step = 0.0f;
    if (r < n) {
      const T* v = hb + (static_cast<std::int64_t>(bt) + r) * d;
      const int g1 = min(d, g0 + kQuantizedValueGroup);
      lo = to_f(v[g0]);
      float hi = lo;
      for (int c = g0 + 1; c < g1; ++c) lo = fmin_cpu(lo, to_f(v[c])), hi = fmax_cpu(hi, to_f(v[c]));
      step = quantized_step(hi, lo, levels);
    }
    scales[u * 2] = lo;
    scales[u * 2 + 1] = step;
  }
  __syncthreads();  // the scales, for the value codes below
  const int elems = n * d, code_bytes = static_cast<int>(p.code_bytes);
  for (int j = tid; j < 2 * code_bytes; j += nt) {
    const bool value = j >= code_bytes;
    const int byte = value ? j - code_bytes : j;
    unsigned x = 0;
    for (int e = byte * 8 / bits; e <= (byte * 8 + 7) / bits && e < elems; ++e) {
      const int r = e / d, c = e % d;
      unsigned code;
      if (value) {
        const float* sc = scales + (static_cast<std::int64_t>(r) * p.groups + c / kQuantizedValueGroup) * 2;
        code = quantized_code(to_f(hb[(static_cast<std::int64_t>(bt) + r) * d + c]), sc[0], sc[1], levels);
      } else {
        code = quantized_code(to_f(hb[static_cast<std::int64_t>(r) * d + c]), summary[d + c],
                              quantized_step(summary[c], summary[d + c], levels), levels);
      }
      const int shift = e * bits - byte * 8;  // where the code starts, relative to the byte
      x |= shift >= 0 ? code << shift : code >> (-shift);
    }
    out[(value ? p.value_codes : p.key_codes) + byte] = static_cast<std::uint8_t>(x & 0xffu);
  }
  // The padding to 4 bytes past the value codes.
  const std::int64_t end = p.value_codes + p.code_bytes;
  for (std::int64_t j = end + tid; j < (end + 3) / 4 * 4; j += nt) out[j] = 0;
}

// Grid: (batch entry, kv head). After append_kernel (same stream): the blocks the append of rows
// [row_offset[i], row_offset[i + 1]) touched, coded from the host tier (a partial one: its rows).
template <class T>
__global__ void __launch_bounds__(kQuantizedThreads)
    append_quantized_kernel(CacheLayout g, int layer, DeviceBatch batch, const std::int32_t* row_offset,
                            DeviceHostTier<T> host, const float* summaries, std::uint8_t* codes) {
  const int i = static_cast<int>(blockIdx.x), h = static_cast<int>(blockIdx.y);
  const int s = batch.seq_slot[i];
  const std::int64_t bt = g.block_tokens();
  const std::int64_t from = batch.seq_len[i], to = from + (row_offset[i + 1] - row_offset[i]);
  for (std::int64_t b = from / bt; b * bt < to; ++b) {
    const int n = static_cast<int>(to - b * bt < bt ? to - b * bt : bt);
    encode_quantized_block(host.block(g, s, layer, h, b), n, static_cast<int>(bt), g.head_dim(), g.config.remainder_bits,
                           summaries + g.summary_offset(s, layer, h, b), codes + g.quantized_offset(s, layer, h, b));
    __syncthreads();  // the next block reuses nothing, but keep the blocks' writes in order
  }
}

// Grid: kv heads. (dst_slot, layer) at `length`: codes of blocks [0, length / block_tokens) copied
// from src_slot when it differs (a fork), the partial block's coded from its host rows.
template <class T>
__global__ void __launch_bounds__(kQuantizedThreads)
    rebuild_quantized_kernel(CacheLayout g, int src_slot, int dst_slot, int layer, std::int64_t length,
                             DeviceHostTier<T> host, const float* summaries, std::uint8_t* codes) {
  const int h = static_cast<int>(blockIdx.x);
  const std::int64_t bt = g.block_tokens();
  const std::int64_t cut = length / bt;
  if (src_slot != dst_slot) {
    const std::uint8_t* from = codes + g.quantized_offset(src_slot, layer, h, 0);
    std::uint8_t* to = codes + g.quantized_offset(dst_slot, layer, h, 0);
    for (std::int64_t e = threadIdx.x; e < cut * g.quantized_block_bytes; e += blockDim.x) to[e] = from[e];
  }
  if (length % bt == 0) return;
  encode_quantized_block(host.block(g, dst_slot, layer, h, cut), static_cast<int>(length - cut * bt), static_cast<int>(bt),
                         g.head_dim(), g.config.remainder_bits, summaries + g.summary_offset(dst_slot, layer, h, cut),
                         codes + g.quantized_offset(dst_slot, layer, h, cut));
}

// Grid as remainder_kernel's: one state per thread block, over the blocks of [0, blocks_for(len))
// the view's pair leaves out, one block at a time: its key steps and score offset
// (quantized_score_offset), each row's score from its decoded key (threads over rows), the running
// max and sum as flash decoding keeps them, the decoded values weighted in (threads over channels).
// Shared memory: q[d], acc[d], steps[d], scores[block_tokens], 32 floats.
template <class QT>
__global__ void __launch_bounds__(kQuantizedThreads)
    remainder_quantized_kernel(CacheLayout g, int layer, DeviceBatch batch, const std::int32_t* indptr,
                               const std::int32_t* view_block, const QT* q, int rows, const float* summaries,
                               const std::uint8_t* codes, float* out, float* lse) {
  extern __shared__ float smem[];
  const int d = g.head_dim(), H = g.num_kv_heads(), G = g.group_size;
  const int bt = g.block_tokens(), bits = g.config.remainder_bits;
  float* qs = smem;
  float* acc = qs + d;
  float* steps = acc + d;
  float* scores = steps + d;
  float* red = scores + bt;
  const int p = static_cast<int>(blockIdx.x);
  const int i = p / H, h = p % H;
  const int r = static_cast<int>(blockIdx.y) / G;
  const std::int64_t state = (static_cast<std::int64_t>(i) * rows + r) * g.num_q_heads() + h * G +
                             static_cast<int>(blockIdx.y) % G;
  const int tid = static_cast<int>(threadIdx.x), nt = static_cast<int>(blockDim.x);
  for (int c = tid; c < d; c += nt) {
    qs[c] = to_f(q[state * d + c]);
    acc[c] = 0.0f;
  }
  const int s = batch.seq_slot[i];
  const std::int64_t len = batch.seq_len[i];
  const std::int64_t nb = g.blocks_for(len);
  const std::int32_t lo = indptr[p], hi = indptr[p + 1];
  const float levels = static_cast<float>((1 << bits) - 1);
  const float scale = g.softmax_scale;
  const QuantizedParts parts = quantized_parts(bt, d, bits);
  float m = -INFINITY, total = 0.0f;
  std::int32_t next = lo;  // the view's blocks are ascending
  __syncthreads();
  for (std::int64_t b = 0; b < nb; ++b) {
    if (next < hi && view_block[next] == b) {  // resident (every thread takes the same branch)
      ++next;
      continue;
    }
    const int n = static_cast<int>(len - b * bt < bt ? len - b * bt : bt);
    const float* summary = summaries + g.summary_offset(s, layer, h, b);
    const std::uint8_t* code = codes + g.quantized_offset(s, layer, h, b);
    const float* vscale = reinterpret_cast<const float*>(code);
    float noise = 0.0f;
    for (int c = tid; c < d; c += nt) {
      steps[c] = quantized_step(summary[c], summary[d + c], levels);
      const float st = summary[c] / levels - summary[d + c] / levels;  // quantized_key_noise
      noise += qs[c] * qs[c] * (st * st / 12.0f);
    }
    const float offset = 0.5f * scale * scale * block_sum(noise, red);  // its barriers publish steps
    float top = -INFINITY;
    for (int row = tid; row < n; row += nt) {
      float dot = 0.0f;
      for (int c = 0; c < d; ++c) {
        const float k = summary[d + c] + static_cast<float>(code_at(code + parts.key_codes, row * d + c, bits)) * steps[c];
        dot += qs[c] * k;
      }
      scores[row] = dot * scale - offset;
      top = fmaxf(top, scores[row]);
    }
    top = block_max(top, red);
    const float fresh = fmaxf(m, top);
    const float rescale = m == -INFINITY ? 0.0f : expf(m - fresh);
    float mine = 0.0f;
    for (int row = tid; row < n; row += nt) {
      scores[row] = expf(scores[row] - fresh);
      mine += scores[row];
    }
    total = total * rescale + block_sum(mine, red);  // its barriers publish the weights
    for (int c = tid; c < d; c += nt) {
      float x = acc[c] * rescale;
      const int gi = c / kQuantizedValueGroup;
      for (int row = 0; row < n; ++row) {
        const float* sc = vscale + (static_cast<std::int64_t>(row) * parts.groups + gi) * 2;
        const float v = sc[0] + static_cast<float>(code_at(code + parts.value_codes, row * d + c, bits)) * sc[1];
        x += scores[row] * v;
      }
      acc[c] = x;
    }
    m = fresh;
    __syncthreads();  // steps and scores are rewritten by the next block
  }
  const bool empty = m == -INFINITY || !(total > 0.0f);
  for (int c = tid; c < d; c += nt) out[state * d + c] = empty ? 0.0f : acc[c] / total;
  if (tid == 0) lse[state] = empty ? -INFINITY : m + logf(total);
}

}  // namespace kernels
}  // namespace gpu
}  // namespace v0
}  // namespace oasiskv
