// Templated device code of the CUDA backend (nvcc only). cuda/kernels.cu instantiates these
// kernels and wraps them in the host operations declared in oasiskv/cuda/ops.cuh; engines that
// want to fuse or re-instantiate them can include this header from their own .cu files.
//
// Bit-identity with the CPU backend: float arithmetic uses the explicitly rounded intrinsics
// (__fmul_rn, __fadd_rn, __fdiv_rn) so nvcc cannot contract a*b+c into an FMA, and max/min are
// written as std::max/std::min are defined ((a < b) ? b : a), in the same order as the CPU loops.
#pragma once

#if !defined(__CUDACC__)
#error "oasiskv/cuda/kernels.cuh is device code: compile it with nvcc (include oasiskv/cuda/ops.cuh from host code)"
#endif

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "oasiskv/cuda/ops.cuh"
#include "oasiskv/summary.hpp"  // kScoreLanes: the bound's summation order

namespace oasiskv {
inline namespace v0 {
namespace gpu {
namespace kernels {

// ---- element conversions (exact: fp16 and bf16 widen to float without rounding) ----------------

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(fp16_t x) { return __half2float(__ushort_as_half(x.bits)); }
__device__ __forceinline__ float to_f(bf16_t x) {
  return __uint_as_float(static_cast<unsigned>(x.bits) << 16);
}

__device__ __forceinline__ float fmax_cpu(float a, float b) { return (a < b) ? b : a; }  // std::max
__device__ __forceinline__ float fmin_cpu(float a, float b) { return (b < a) ? b : a; }  // std::min

// ---- append ------------------------------------------------------------------------------------

// Grid: (ceil(kv_heads * head_dim / blockDim.x), batch). Thread (h, c) walks its sequence's new
// rows in order, so a block's first row resets the summary exactly as SummaryStore::add_key.
template <class T>
__global__ void append_kernel(Geometry g, int layer, DeviceBatch batch, const std::int32_t* row_offset,
                              const T* k, const T* v, T* host, T* pool, float* summaries) {
  const int i = static_cast<int>(blockIdx.y);
  const int H = g.num_kv_heads;
  const int d = g.head_dim;
  const int hc = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= batch.size || hc >= H * d) return;
  const int h = hc / d;
  const int c = hc % d;
  const int s = batch.seq_slot[i];
  const std::int64_t len = batch.seq_len[i];
  const std::int32_t r0 = row_offset[i];
  const std::int32_t r1 = row_offset[i + 1];
  const std::int64_t end = len + (r1 - r0);
  const std::int64_t bt = g.block_tokens;
  const std::int64_t ring_first = g.ring_start(end);
  const std::int64_t head = g.head_index(s, layer, h);
  T* hbase = host + head * g.max_blocks * g.block_elems;
  float* sbase = summaries + head * g.max_blocks * 2 * d;
  for (std::int32_t r = r0; r < r1; ++r) {
    const std::int64_t pos = len + (r - r0);
    const std::int64_t b = pos / bt;
    const std::int64_t off = pos % bt;
    const std::int64_t src = (static_cast<std::int64_t>(r) * H + h) * d + c;
    const T kv = k[src];
    const T vv = v[src];
    T* hb = hbase + b * g.block_elems;
    hb[off * d + c] = kv;
    hb[(bt + off) * d + c] = vv;
    float* mx = sbase + b * 2 * d;
    const float kf = to_f(kv);
    if (off == 0) {
      mx[c] = kf;
      mx[d + c] = kf;
    } else {
      mx[c] = fmax_cpu(mx[c], kf);
      mx[d + c] = fmin_cpu(mx[d + c], kf);
    }
    if (b < g.sink_blocks || b >= ring_first) {
      T* slot = pool + g.slot_id(s, h, g.pinned_slot(b)) * g.block_elems;
      slot[off * d + c] = kv;
      slot[(bt + off) * d + c] = vv;
    }
  }
}

// ---- scoring -----------------------------------------------------------------------------------

inline constexpr int kScoreTile = 32;     // candidate blocks per thread block
inline constexpr int kScoreThreads = 128;  // 4 warps: warp w takes queries w, w + 4, ...

// Grid: (ceil(max candidates / kScoreTile), pairs). The tile's summaries are staged in shared
// memory (row stride 2d+1 floats: conflict-free); lane j of every warp computes quest_bound of
// block j for its queries, summed in the CPU's lane order (summary.hpp); then thread j reduces
// over the queries in order. softmax_sum writes the raw bounds for softmax_kernel instead.
template <class QT>
__global__ void __launch_bounds__(kScoreThreads) score_kernel(Geometry g, int layer, DeviceBatch batch,
                                                              const QT* q, int rows, const float* summaries,
                                                              ScoreBuffers out, bool current) {
  extern __shared__ float smem[];
  const int H = g.num_kv_heads;
  const int d = g.head_dim;
  const int G = g.group_size;
  const int p = static_cast<int>(blockIdx.y);
  const int i = p / H;
  const int h = p % H;
  const std::int64_t first = g.sink_blocks;
  // current: the blocks before the recent ring now (Cache<cpu>::observe); otherwise prefetch's
  // candidates for the next step.
  const std::int64_t n =
      (current ? g.ring_start(batch.seq_len[i]) : g.candidates_end(batch.seq_len[i])) - first;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    out.count[p] = static_cast<std::int32_t>(n);
    out.first[p] = static_cast<std::int32_t>(first);
  }
  const std::int64_t j0 = static_cast<std::int64_t>(blockIdx.x) * kScoreTile;
  if (j0 >= n) return;  // uniform over the thread block
  const int tn = static_cast<int>(n - j0 < kScoreTile ? n - j0 : kScoreTile);
  const int s = batch.seq_slot[i];
  const float* src = summaries + (g.head_index(s, layer, h) * g.max_blocks + first + j0) * 2 * d;
  const int row = 2 * d + 1;
  for (int e = static_cast<int>(threadIdx.x); e < tn * 2 * d; e += blockDim.x) {
    smem[(e / (2 * d)) * row + e % (2 * d)] = src[e];
  }
  __syncthreads();
  const bool softmax = g.reduction == GroupReduction::softmax_sum;
  float* bound = smem + kScoreTile * row;  // [Q][kScoreTile]
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int Q = rows * G;
  for (int qi = warp; qi < Q; qi += kScoreThreads / 32) {
    if (lane < tn) {
      const int r = qi / G;
      const int gg = qi % G;
      const QT* qv = q + ((static_cast<std::int64_t>(i) * rows + r) * g.num_q_heads + h * G + gg) * d;
      const float* mx = smem + lane * row;
      const float* mn = mx + d;
      // The CPU's quest_bound order: channel c into lane c % 8, then the fixed lane tree.
      float lanes[kScoreLanes] = {};
      for (int c = 0; c < d; ++c) {
        const float qc = to_f(qv[c]);
        lanes[c % kScoreLanes] =
            __fadd_rn(lanes[c % kScoreLanes], fmax_cpu(__fmul_rn(qc, mx[c]), __fmul_rn(qc, mn[c])));
      }
      const float acc = __fadd_rn(__fadd_rn(__fadd_rn(lanes[0], lanes[4]), __fadd_rn(lanes[2], lanes[6])),
                                  __fadd_rn(__fadd_rn(lanes[1], lanes[5]), __fadd_rn(lanes[3], lanes[7])));
      if (softmax) {
        out.bounds[(static_cast<std::int64_t>(p) * Q + qi) * out.stride + j0 + lane] = acc;
      } else {
        bound[qi * kScoreTile + lane] = acc;
      }
    }
  }
  if (softmax) return;
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < tn) {
    const bool is_max = g.reduction == GroupReduction::max;
    float sc = is_max ? -INFINITY : 0.0f;
    for (int qi = 0; qi < Q; ++qi) {
      const float b = bound[qi * kScoreTile + threadIdx.x];
      sc = is_max ? fmax_cpu(sc, b) : __fadd_rn(sc, b);
    }
    out.scores[static_cast<std::int64_t>(p) * out.stride + j0 + threadIdx.x] = sc;
  }
}

inline constexpr int kSoftmaxThreads = 256;

// Grid: pairs. For each query in order: max over the blocks (exact in any order), exp in
// parallel, the normaliser summed sequentially by one thread (the CPU's order), then
// scores[j] += row[j] / total.
template <int = 0>  // a template: defined in every including TU without ODR clashes
__global__ void __launch_bounds__(kSoftmaxThreads) softmax_kernel(Geometry g, int rows, ScoreBuffers out) {
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
      row[j] = expf(__fmul_rn(__fsub_rn(row[j], top), g.softmax_scale));
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

// ---- segmented top-K -----------------------------------------------------------------------------
//
// CCCL 3.0 has no cub::DeviceTopK (it arrives in 3.5). Rather than a full
// cub::DeviceSegmentedSort of every candidate (8 radix passes over 64-bit keys, a temp-storage
// size query that fails without a device and must precede graph capture, and several launches),
// each (sequence, kv head) segment is one thread block that runs a radix *select*: four 8-bit
// histogram passes over the 32-bit order key of the score find the K-th best score exactly; the
// blocks strictly better than it, plus the lowest-index blocks equal to it, are the selection
// (ScoreOrder's tie rule); the K chosen (score, index) keys are then bitonic-sorted in shared
// memory. One launch, no temp storage, no host synchronisation; deterministic.

inline constexpr int kTopKThreads = 256;

// Smaller key = better: descending score. -0.0 and +0.0 compare equal on the CPU, so both map to
// the key of +0.0. (NaN scores are not ordered by ScoreOrder either; the inputs are finite.)
__device__ __forceinline__ std::uint32_t order_key(float f) {
  std::uint32_t b = __float_as_uint(f == 0.0f ? 0.0f : f);
  b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);  // ascending float order
  return ~b;
}

template <int = 0>  // a template: defined in every including TU without ODR clashes
__global__ void __launch_bounds__(kTopKThreads) topk_kernel(const float* scores, int stride,
                                                            const std::int32_t* count,
                                                            const std::int32_t* first, int k,
                                                            std::int32_t* selected,
                                                            std::int32_t* selected_count) {
  extern __shared__ unsigned long long keys[];  // [pow2 >= k]
  __shared__ unsigned hist[256];
  __shared__ std::uint32_t prefix_s, remaining_s;
  __shared__ unsigned n_below, n_equal_taken;
  __shared__ unsigned warp_sums[kTopKThreads / 32];
  const int seg = static_cast<int>(blockIdx.x);
  const int n = count[seg];
  const int kk = n < k ? n : k;
  if (threadIdx.x == 0) selected_count[seg] = kk > 0 ? kk : 0;
  if (kk <= 0) return;
  const float* sc = scores + static_cast<std::int64_t>(seg) * stride;
  const int tid = static_cast<int>(threadIdx.x);

  // Radix select of the kk-th smallest key.
  std::uint32_t prefix = 0, mask = 0;
  std::uint32_t remaining = static_cast<std::uint32_t>(kk);
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = tid; b < 256; b += blockDim.x) hist[b] = 0;
    __syncthreads();
    for (int j = tid; j < n; j += blockDim.x) {
      const std::uint32_t u = order_key(sc[j]);
      if ((u & mask) == prefix) atomicAdd(&hist[(u >> shift) & 0xffu], 1u);
    }
    __syncthreads();
    if (tid == 0) {
      std::uint32_t cum = 0;
      int digit = 0;
      for (; digit < 255; ++digit) {
        if (cum + hist[digit] >= remaining) break;
        cum += hist[digit];
      }
      prefix_s = prefix | (static_cast<std::uint32_t>(digit) << shift);
      remaining_s = remaining - cum;
    }
    __syncthreads();
    prefix = prefix_s;
    remaining = remaining_s;
    mask |= 0xffu << shift;
  }
  // prefix is the kk-th key; take every key below it and the `remaining` lowest-index keys equal.
  const std::uint32_t threshold = prefix;
  if (tid == 0) {
    n_below = 0;
    n_equal_taken = 0;
  }
  __syncthreads();
  const unsigned below_total = static_cast<unsigned>(kk) - remaining;
  for (int base = 0; base < n; base += blockDim.x) {
    const int j = base + tid;
    std::uint32_t u = 0xffffffffu;
    if (j < n) u = order_key(sc[j]);
    const bool eq = j < n && u == threshold;
    // Ordered rank of `eq` within this chunk: warp ballot + warp prefix.
    const unsigned ballot = __ballot_sync(0xffffffffu, eq);
    const int lane = tid % 32, warp = tid / 32;
    if (lane == 0) warp_sums[warp] = static_cast<unsigned>(__popc(ballot));
    __syncthreads();
    unsigned before = n_equal_taken;
    for (int w = 0; w < warp; ++w) before += warp_sums[w];
    before += static_cast<unsigned>(__popc(ballot & ((1u << lane) - 1u)));
    if (j < n && u < threshold) {
      const unsigned pos = atomicAdd(&n_below, 1u);
      keys[pos] = (static_cast<unsigned long long>(u) << 32) | static_cast<unsigned>(j);
    } else if (eq && before < remaining) {
      keys[below_total + before] = (static_cast<unsigned long long>(u) << 32) | static_cast<unsigned>(j);
    }
    __syncthreads();
    if (tid == 0) {
      unsigned total = 0;
      for (int w = 0; w < static_cast<int>(blockDim.x) / 32; ++w) total += warp_sums[w];
      n_equal_taken += total;
    }
    __syncthreads();
  }
  // Bitonic sort of the kk keys (padded to a power of two with the largest key).
  int m = 1;
  while (m < kk) m <<= 1;
  for (int j = kk + tid; j < m; j += blockDim.x) keys[j] = ~0ull;
  __syncthreads();
  for (int size = 2; size <= m; size <<= 1) {
    for (int stride2 = size >> 1; stride2 > 0; stride2 >>= 1) {
      for (int t = tid; t < m; t += blockDim.x) {
        const int partner = t ^ stride2;
        if (partner > t) {
          const bool ascending = (t & size) == 0;
          const unsigned long long a = keys[t], b = keys[partner];
          if ((a > b) == ascending) {
            keys[t] = b;
            keys[partner] = a;
          }
        }
      }
      __syncthreads();
    }
  }
  const std::int32_t f = first[seg];
  for (int j = tid; j < kk; j += blockDim.x) {
    selected[static_cast<std::int64_t>(seg) * k + j] = f + static_cast<std::int32_t>(keys[j] & 0xffffffffull);
  }
}

// ---- transfer planning ---------------------------------------------------------------------------

inline constexpr int kPlanThreads = 256;

// Grid: pairs. Dynamic shared memory: see plan_smem_bytes. The order-dependent lists (kept in
// selection order, missing in selection order, free slots ascending) are built by one thread, as
// they are O(slots); victims are ranked in parallel by (last selected, block), as
// TransferPlanner's sort.
__host__ __device__ inline std::size_t plan_smem_bytes(int slots, int k) {
  return static_cast<std::size_t>(slots) * (8 + 4 + 4 + 4) + static_cast<std::size_t>(k) * (4 + 4);
}

template <int = 0>  // a template: defined in every including TU without ODR clashes
__global__ void __launch_bounds__(kPlanThreads) plan_kernel(Geometry g, int layer, DeviceBatch batch,
                                                            const std::int64_t* steps,
                                                            const std::int32_t* selected,
                                                            const std::int32_t* selected_count,
                                                            int sel_stride, std::int32_t* res_block,
                                                            std::int64_t* res_last, PlanBuffers out) {
  extern __shared__ unsigned long long plan_smem[];
  const int S = g.selectable_blocks;
  const int p = static_cast<int>(blockIdx.x);
  const int H = g.num_kv_heads;
  const int i = p / H;
  const int h = p % H;
  std::int64_t* last = reinterpret_cast<std::int64_t*>(plan_smem);  // [S]
  std::int32_t* blk = reinterpret_cast<std::int32_t*>(last + S);     // [S]
  std::int32_t* chosen = blk + S;                                    // [S]
  std::int32_t* target = chosen + S;                                 // [S]
  std::int32_t* sel_slot = target + S;                               // [sel_stride]
  std::int32_t* missing = sel_slot + sel_stride;                     // [sel_stride]
  __shared__ int free_count_s, missing_count_s;

  const std::int64_t row = g.head_index(batch.seq_slot[i], layer, h) * S;
  const std::int64_t step = steps[i];
  const int nsel = selected_count[p];
  const std::int32_t* sel = selected + static_cast<std::int64_t>(p) * sel_stride;
  const int tid = static_cast<int>(threadIdx.x);
  for (int j = tid; j < S; j += blockDim.x) {
    blk[j] = res_block[row + j];
    last[j] = res_last[row + j];
    chosen[j] = 0;
  }
  __syncthreads();
  for (int a = tid; a < nsel; a += blockDim.x) {
    const std::int32_t b = sel[a];
    int found = -1;
    for (int j = 0; j < S; ++j) {
      if (blk[j] == b) {
        found = j;
        break;
      }
    }
    sel_slot[a] = found;
    if (found >= 0) chosen[found] = 1;
  }
  __syncthreads();
  if (tid == 0) {
    int kept = 0, miss = 0;
    for (int a = 0; a < nsel; ++a) {
      if (sel_slot[a] >= 0) {
        if (out.kept != nullptr) out.kept[static_cast<std::int64_t>(p) * sel_stride + kept] = sel_slot[a];
        ++kept;
      } else {
        missing[miss++] = sel[a];
      }
    }
    if (out.kept_count != nullptr) out.kept_count[p] = kept;
    int nfree = 0;
    for (int j = 0; j < S; ++j) {
      if (blk[j] == kNoBlock) target[nfree++] = j;
    }
    free_count_s = nfree;
    missing_count_s = miss;
  }
  __syncthreads();
  const int nfree = free_count_s;
  for (int j = tid; j < S; j += blockDim.x) {
    if (blk[j] != kNoBlock && !chosen[j]) {
      int rank = 0;
      for (int v = 0; v < S; ++v) {
        if (blk[v] != kNoBlock && !chosen[v] &&
            (last[v] < last[j] || (last[v] == last[j] && blk[v] < blk[j]))) {
          ++rank;
        }
      }
      target[nfree + rank] = j;
    }
  }
  __syncthreads();
  if (tid == 0) {
    int ntargets = nfree;
    for (int j = 0; j < S; ++j) {
      if (blk[j] != kNoBlock && !chosen[j]) ++ntargets;
    }
    const int miss = missing_count_s;
    // CacheLayout::admit_cap: the first plan (after prefill) is not capped.
    const int cap = step == 0 ? S : (g.fetch_cap > 0 ? g.fetch_cap : 0);
    int n = miss < ntargets ? miss : ntargets;
    n = n < cap ? n : cap;
    for (int a = 0; a < n; ++a) {
      const std::int32_t slot = target[a];
      out.admits[static_cast<std::int64_t>(p) * g.admit_stride + a] = DeviceAdmit{missing[a], slot, blk[slot]};
    }
    out.admit_count[p] = n;
    if (out.capped != nullptr) out.capped[p] = miss - n;
    // apply(): kept slots and admitted slots are stamped with the step.
    for (int a = 0; a < nsel; ++a) {
      if (sel_slot[a] >= 0) last[sel_slot[a]] = step;
    }
    for (int a = 0; a < n; ++a) {
      blk[target[a]] = missing[a];
      last[target[a]] = step;
    }
  }
  __syncthreads();
  for (int j = tid; j < S; j += blockDim.x) {
    res_block[row + j] = blk[j];
    res_last[row + j] = last[j];
  }
}

// ---- gather ----------------------------------------------------------------------------------------

inline constexpr int kGatherThreads = 256;

// Copies `bytes` with the thread block: 16-byte vectors when everything is 16-byte aligned (a
// block of 16 tokens x head_dim 128 x 2 B is 8 KB: 512 vectors, two per thread, all loads in
// flight before the stores), bytes otherwise.
__device__ __forceinline__ void block_copy(const void* src, void* dst, std::size_t bytes) {
  const auto s = reinterpret_cast<std::uintptr_t>(src);
  const auto d = reinterpret_cast<std::uintptr_t>(dst);
  if (((s | d | bytes) & 15u) == 0) {
    const uint4* sv = static_cast<const uint4*>(src);
    uint4* dv = static_cast<uint4*>(dst);
    const std::size_t n = bytes / 16;
    std::size_t t = threadIdx.x;
    for (; t + 3 * blockDim.x < n; t += 4 * blockDim.x) {
      const uint4 a = sv[t], b = sv[t + blockDim.x], c = sv[t + 2 * blockDim.x], e = sv[t + 3 * blockDim.x];
      dv[t] = a;
      dv[t + blockDim.x] = b;
      dv[t + 2 * blockDim.x] = c;
      dv[t + 3 * blockDim.x] = e;
    }
    for (; t < n; t += blockDim.x) dv[t] = sv[t];
  } else {
    const unsigned char* sb = static_cast<const unsigned char*>(src);
    unsigned char* db = static_cast<unsigned char*>(dst);
    for (std::size_t t = threadIdx.x; t < bytes; t += blockDim.x) db[t] = sb[t];
  }
}

// Grid: (admit_stride, pairs). Thread block (a, p) copies admit a of pair p.
template <class T>
__global__ void __launch_bounds__(kGatherThreads) gather_admits_kernel(Geometry g, int layer, DeviceBatch batch,
                                                                       const DeviceAdmit* admits,
                                                                       const std::int32_t* admit_count,
                                                                       const T* host, T* pool) {
  const int a = static_cast<int>(blockIdx.x);
  const int p = static_cast<int>(blockIdx.y);
  if (a >= admit_count[p]) return;
  const int H = g.num_kv_heads;
  const int i = p / H;
  const int h = p % H;
  const int s = batch.seq_slot[i];
  const DeviceAdmit adm = admits[static_cast<std::int64_t>(p) * g.admit_stride + a];
  const T* src = host + (g.head_index(s, layer, h) * g.max_blocks + adm.block) * g.block_elems;
  T* dst = pool + g.slot_id(s, h, g.sink_blocks + g.ring_blocks + adm.slot) * g.block_elems;
  block_copy(src, dst, static_cast<std::size_t>(g.block_elems) * sizeof(T));
}

// Grid: max_count. Thread block c copies copies[c] when c < *count.
template <int = 0>  // a template: defined in every including TU without ODR clashes
__global__ void __launch_bounds__(kGatherThreads) gather_copies_kernel(const BlockCopy* copies,
                                                                       const std::int32_t* count) {
  const int c = static_cast<int>(blockIdx.x);
  if (c >= *count) return;
  const BlockCopy bc = copies[c];
  block_copy(bc.src, bc.dst, bc.bytes);
}

// ---- attention ----------------------------------------------------------------------------------

inline constexpr int kAttentionThreads = 128;
inline constexpr int kAttentionMaxChunks = 4;  // head_dim <= 512

// Grid: (num_q_heads, batch). Rows in ascending token order, as the CPU reference; the q.k dot
// product is a block reduction, so logits match the CPU to float rounding, not bitwise.
template <class T>
__global__ void __launch_bounds__(kAttentionThreads) attention_kernel(LayerView<T> view, int num_q_heads,
                                                                      float scale, const float* q,
                                                                      float* out) {
  __shared__ float part[2][kAttentionThreads / 32];
  const int gq = static_cast<int>(blockIdx.x);
  const int i = static_cast<int>(blockIdx.y);
  const int d = view.head_dim;
  const int group = num_q_heads / view.num_kv_heads;
  const int p = i * view.num_kv_heads + gq / group;
  const float* qv = q + (static_cast<std::int64_t>(i) * num_q_heads + gq) * d;
  const int tid = static_cast<int>(threadIdx.x);
  float qr[kAttentionMaxChunks], acc[kAttentionMaxChunks];
#pragma unroll
  for (int u = 0; u < kAttentionMaxChunks; ++u) {
    const int c = tid + u * kAttentionThreads;
    qr[u] = c < d ? qv[c] : 0.0f;
    acc[u] = 0.0f;
  }
  float mx = -INFINITY, sum = 0.0f;
  int buf = 0;
  for (std::int32_t e = view.indptr[p]; e < view.indptr[p + 1]; ++e) {
    const T* kb = view.pool + static_cast<std::int64_t>(view.slot[e]) * view.slot_stride;
    const T* vb = kb + static_cast<std::int64_t>(view.block_tokens) * d;
    const std::int32_t valid = view.valid_tokens[e];
    for (std::int32_t r = 0; r < valid; ++r) {
      const T* kr = kb + static_cast<std::int64_t>(r) * d;
      const T* vr = vb + static_cast<std::int64_t>(r) * d;
      float partial = 0.0f;
#pragma unroll
      for (int u = 0; u < kAttentionMaxChunks; ++u) {
        const int c = tid + u * kAttentionThreads;
        if (c < d) partial += qr[u] * to_f(kr[c]);
      }
      for (int o = 16; o > 0; o >>= 1) partial += __shfl_xor_sync(0xffffffffu, partial, o);
      if (tid % 32 == 0) part[buf][tid / 32] = partial;
      __syncthreads();
      float s = 0.0f;
#pragma unroll
      for (int w = 0; w < kAttentionThreads / 32; ++w) s += part[buf][w];
      buf ^= 1;  // the next row writes the other buffer: one barrier per row suffices
      s *= scale;
      if (s > mx) {
        const float rr = expf(mx - s);
        sum *= rr;
#pragma unroll
        for (int u = 0; u < kAttentionMaxChunks; ++u) acc[u] *= rr;
        mx = s;
      }
      const float w = expf(s - mx);
      sum += w;
#pragma unroll
      for (int u = 0; u < kAttentionMaxChunks; ++u) {
        const int c = tid + u * kAttentionThreads;
        if (c < d) acc[u] += w * to_f(vr[c]);
      }
    }
  }
  float* o = out + (static_cast<std::int64_t>(i) * num_q_heads + gq) * d;
#pragma unroll
  for (int u = 0; u < kAttentionMaxChunks; ++u) {
    const int c = tid + u * kAttentionThreads;
    if (c < d) o[c] = sum > 0.0f ? acc[u] / sum : 0.0f;
  }
}

// ---- Cache<cuda> helpers: metadata upload, plan snapshot, view building, recall hits ----------

// Sum over the thread block (blockDim.x a multiple of 32, at most 1024); every thread gets the
// total. `shared` holds 32 values; the call begins with a barrier, so it may be reused at once.
template <class V>
__device__ __forceinline__ V block_sum(V x, V* shared) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_down_sync(0xffffffffu, x, o);
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  __syncthreads();
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  V total = 0;
  for (int w = 0; w < static_cast<int>(blockDim.x) / 32; ++w) total += shared[w];
  return total;
}

template <int = 0>  // a template: defined in every including TU without ODR clashes
__global__ void upload_words_kernel(WordBlock w) {
  for (int i = static_cast<int>(threadIdx.x); i < w.count; i += static_cast<int>(blockDim.x)) w.dst[i] = w.words[i];
}

inline constexpr int kViewThreads = 128;

// Grid: batch. Copies the residency rows of entry i ([kv head][selectable], contiguous in the
// BlockTable layout) to snapshot[i], and adds the entry's admits and capped counts to counters.
template <int = 0>
__global__ void __launch_bounds__(kViewThreads) snapshot_kernel(Geometry g, int layer, DeviceBatch batch,
                                                                const std::int32_t* res_block, std::int32_t* snapshot,
                                                                const std::int32_t* admit_count,
                                                                const std::int32_t* capped,
                                                                unsigned long long* counters) {
  const int i = static_cast<int>(blockIdx.x);
  const int H = g.num_kv_heads;
  const std::int64_t n = static_cast<std::int64_t>(H) * g.selectable_blocks;
  const std::int32_t* src = res_block + g.head_index(batch.seq_slot[i], layer, 0) * g.selectable_blocks;
  std::int32_t* dst = snapshot + static_cast<std::int64_t>(i) * n;
  for (std::int64_t e = threadIdx.x; e < n; e += blockDim.x) dst[e] = src[e];
  if (threadIdx.x == 0 && counters != nullptr) {
    unsigned long long a = 0, c = 0;
    for (int h = 0; h < H; ++h) {
      a += static_cast<unsigned long long>(admit_count[i * H + h]);
      c += static_cast<unsigned long long>(capped[i * H + h]);
    }
    if (a != 0) atomicAdd(&counters[0], a);
    if (c != 0) atomicAdd(&counters[1], c);
  }
}

// The parts of pair p's view (Cache<cpu>::build_view): sinks [0, nsink), the snapshot's blocks in
// [sink_blocks, ring_first), the ring [ring_first, nb).
struct ViewShape {
  std::int64_t len, nb, ring_first;
  int nsink, nring;
};
__device__ __forceinline__ ViewShape view_shape(const Geometry& g, std::int64_t len) {
  ViewShape v;
  v.len = len;
  v.nb = g.blocks_for(len);
  v.ring_first = g.ring_start(len);
  v.nsink = static_cast<int>(v.nb < g.sink_blocks ? v.nb : g.sink_blocks);
  v.nring = static_cast<int>(v.nb > v.ring_first ? v.nb - v.ring_first : 0);
  return v;
}
__device__ __forceinline__ bool view_chosen(const Geometry& g, const ViewShape& v, std::int32_t b) {
  return b != kNoBlock && b >= g.sink_blocks && b < v.ring_first;
}

// Grid: pairs. counts[p]: the entries of pair p.
template <int = 0>
__global__ void __launch_bounds__(kViewThreads) view_count_kernel(Geometry g, DeviceBatch batch,
                                                                  const std::int32_t* snapshot, std::int32_t* counts) {
  __shared__ int red[32];
  const int p = static_cast<int>(blockIdx.x);
  const int K = g.selectable_blocks;
  const ViewShape v = view_shape(g, batch.seq_len[p / g.num_kv_heads]);
  const std::int32_t* row = snapshot + static_cast<std::int64_t>(p) * K;
  int c = 0;
  for (int j = static_cast<int>(threadIdx.x); j < K; j += blockDim.x) c += view_chosen(g, v, row[j]) ? 1 : 0;
  c = block_sum(c, red);
  if (threadIdx.x == 0) counts[p] = v.nsink + c + v.nring;
}

// Grid: pairs; dynamic shared memory: selectable_blocks int32. Pair p's entries start at the sum
// of counts[0, p); chosen blocks are placed by rank (blocks are distinct), so ascending.
template <int = 0>
__global__ void __launch_bounds__(kViewThreads) view_fill_kernel(Geometry g, DeviceBatch batch,
                                                                 const std::int32_t* snapshot,
                                                                 const std::int32_t* counts, std::int32_t* indptr,
                                                                 std::int32_t* slot, std::int32_t* block,
                                                                 std::int32_t* valid) {
  extern __shared__ std::int32_t view_row[];  // [K]
  __shared__ long long red[32];
  const int p = static_cast<int>(blockIdx.x);
  const int pairs = static_cast<int>(gridDim.x);
  const int H = g.num_kv_heads, K = g.selectable_blocks;
  const int tid = static_cast<int>(threadIdx.x);
  long long partial = 0;
  for (int q = tid; q < p; q += blockDim.x) partial += counts[q];
  const long long base = block_sum(partial, red);
  if (tid == 0) {
    indptr[p] = static_cast<std::int32_t>(base);
    if (p == pairs - 1) indptr[pairs] = static_cast<std::int32_t>(base + counts[p]);
  }
  const int i = p / H, h = p % H;
  const int s = batch.seq_slot[i];
  const ViewShape v = view_shape(g, batch.seq_len[i]);
  const std::int64_t bt = g.block_tokens;
  auto put = [&](std::int64_t e, std::int64_t b, int local) {
    slot[e] = static_cast<std::int32_t>(g.slot_id(s, h, local));
    block[e] = static_cast<std::int32_t>(b);
    const std::int64_t left = v.len - b * bt;
    valid[e] = static_cast<std::int32_t>(left < bt ? left : bt);
  };
  for (int t = tid; t < v.nsink; t += blockDim.x) put(base + t, t, t);
  const std::int32_t* row = snapshot + static_cast<std::int64_t>(p) * K;
  for (int j = tid; j < K; j += blockDim.x) view_row[j] = row[j];
  __syncthreads();
  const int nchosen = counts[p] - v.nsink - v.nring;
  for (int j = tid; j < K; j += blockDim.x) {
    const std::int32_t b = view_row[j];
    if (!view_chosen(g, v, b)) continue;
    int rank = 0;
    for (int u = 0; u < K; ++u) {
      const std::int32_t x = view_row[u];
      rank += (view_chosen(g, v, x) && x < b) ? 1 : 0;
    }
    put(base + v.nsink + rank, b, g.sink_blocks + g.ring_blocks + j);
  }
  for (int t = tid; t < v.nring; t += blockDim.x) {
    const std::int64_t b = v.ring_first + t;
    put(base + v.nsink + nchosen + t, b, g.pinned_slot(b));
  }
}

// Grid: pairs. Adds to *counter the selected blocks of pair p that its view holds (binary search
// in the view's ascending blocks).
template <int = 0>
__global__ void __launch_bounds__(kViewThreads) count_hits_kernel(const std::int32_t* selected,
                                                                  const std::int32_t* selected_count, int k,
                                                                  const std::int32_t* indptr,
                                                                  const std::int32_t* block,
                                                                  unsigned long long* counter) {
  __shared__ unsigned long long red[32];
  const int p = static_cast<int>(blockIdx.x);
  const int n = selected_count[p];
  const std::int32_t lo0 = indptr[p], hi0 = indptr[p + 1];
  unsigned long long c = 0;
  for (int a = static_cast<int>(threadIdx.x); a < n; a += blockDim.x) {
    const std::int32_t b = selected[static_cast<std::int64_t>(p) * k + a];
    std::int32_t lo = lo0, hi = hi0;
    while (lo < hi) {
      const std::int32_t mid = lo + (hi - lo) / 2;
      if (block[mid] < b) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    c += (lo < hi0 && block[lo] == b) ? 1ull : 0ull;
  }
  c = block_sum(c, red);
  if (threadIdx.x == 0 && c != 0) atomicAdd(counter, c);
}

}  // namespace kernels
}  // namespace gpu
}  // namespace v0
}  // namespace oasiskv
