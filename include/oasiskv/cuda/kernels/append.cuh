// Append (nvcc only): new rows into the host tier, the pinned slots and the block summaries (and,
// under the runs scorer, the run key sums).
#pragma once

#include <cstdint>

#include "oasiskv/cuda/kernels/common.cuh"

namespace oasiskv {
inline namespace v0 {
namespace gpu {
namespace kernels {

inline constexpr int kAppendThreads = 256;

// One thread of an append grid (batch, ceil(kv_heads * head_dim / threads)): channel c of kv head
// h of batch entry i, whose new rows [r0, r1) of the input land at positions len + (r - r0) of
// sequence slot s. append_kernel and append_moments_kernel (remainder/clusters.cuh) walk the same.
struct AppendLane {
  int H = 0, d = 0;  // kv heads, head_dim
  int h = 0, c = 0, s = 0;
  std::int64_t len = 0;
  std::int32_t r0 = 0, r1 = 0;

  // The element (kv head h, channel c) of input row r ([rows][kv_heads][head_dim]).
  __device__ std::int64_t src(std::int32_t r) const { return (static_cast<std::int64_t>(r) * H + h) * d + c; }
};

// This thread's lane; false for a thread past the batch or the channels (nothing to do).
__device__ __forceinline__ bool append_lane(const CacheLayout& g, const DeviceBatch& batch,
                                            const std::int32_t* row_offset, AppendLane& a) {
  const int i = static_cast<int>(blockIdx.x);
  a.H = g.num_kv_heads();
  a.d = g.head_dim();
  const int hc = static_cast<int>(blockIdx.y * blockDim.x + threadIdx.x);
  if (i >= batch.size || hc >= a.H * a.d) return false;
  a.h = hc / a.d;
  a.c = hc % a.d;
  a.s = batch.seq_slot[i];
  a.len = batch.seq_len[i];
  a.r0 = row_offset[i];
  a.r1 = row_offset[i + 1];
  return true;
}

// Grid: (batch, ceil(kv_heads * head_dim / kAppendThreads)). Thread (h, c) of entry i walks its
// sequence's new rows in order, so a block's first row resets the summary exactly as
// SummaryStore::add_key.
template <class T>
__global__ void __launch_bounds__(kAppendThreads)
    append_kernel(CacheLayout g, int layer, DeviceBatch batch, const std::int32_t* row_offset, const T* k, const T* v,
                  DeviceHostTier<T> host, T* pool, float* summaries) {
  AppendLane a;
  if (!append_lane(g, batch, row_offset, a)) return;
  const int h = a.h, c = a.c, d = a.d, s = a.s;
  const std::int64_t len = a.len;
  const std::int32_t r0 = a.r0, r1 = a.r1;
  const std::int64_t end = len + (r1 - r0);
  const std::int64_t bt = g.block_tokens();
  const std::int64_t ring_first = g.ring_start(end);
  for (std::int32_t r = r0; r < r1; ++r) {
    const std::int64_t pos = len + (r - r0);
    const std::int64_t b = pos / bt;
    const std::int64_t off = pos % bt;
    const std::int64_t src = a.src(r);
    const T kv = k[src];
    const T vv = v[src];
    T* hb = host.block(g, s, layer, h, b);
    hb[off * d + c] = kv;
    hb[(bt + off) * d + c] = vv;
    float* mx = summaries + g.summary_offset(s, layer, h, b);
    const float kf = to_f(kv);
    if (off == 0) {
      mx[c] = kf;
      mx[d + c] = kf;
    } else {
      mx[c] = fmax_cpu(mx[c], kf);
      mx[d + c] = fmin_cpu(mx[d + c], kf);
    }
    if (b < g.sink_blocks || b >= ring_first) {
      T* slot = pool + static_cast<std::int64_t>(g.slot_id(s, layer, h, g.pinned_slot(b))) * g.block_elems;
      slot[off * d + c] = kv;
      slot[(bt + off) * d + c] = vv;
    }
  }
}

// Folds key channel c (value kf) of row `off` of a block into its run key sums (scorer runs:
// [run][head_dim], CacheLayout::run_offset): the run's first row resets its sum, later rows add in
// order, as SummaryStore::add_run_key.
__device__ __forceinline__ void fold_run_key(float* block_runs, int d, int c, std::int64_t off, int run_tokens,
                                             float kf) {
  float& sum = block_runs[off / run_tokens * d + c];
  sum = off % run_tokens == 0 ? kf : __fadd_rn(sum, kf);
}

// append_kernel's grid and walk (AppendLane): the new keys folded into their runs' key sums
// (scorer runs).
template <class T>
__global__ void __launch_bounds__(kAppendThreads)
    append_run_sums_kernel(CacheLayout g, int layer, DeviceBatch batch, const std::int32_t* row_offset, const T* k,
                           float* run_sums) {
  AppendLane a;
  if (!append_lane(g, batch, row_offset, a)) return;
  const std::int64_t bt = g.block_tokens();
  for (std::int32_t r = a.r0; r < a.r1; ++r) {
    const std::int64_t pos = a.len + (r - a.r0);
    fold_run_key(run_sums + g.run_offset(a.s, layer, a.h, pos / bt), a.d, a.c, pos % bt, g.config.run_tokens,
                 to_f(k[a.src(r)]));
  }
}

// Grid: num_layers * kv_heads. Thread block x copies (layer, kv head) block x of pool block
// `from` to `to` (a copy on write).
template <class T>
__global__ void __launch_bounds__(kAppendThreads)
    clone_host_block_kernel(CacheLayout g, T* host, std::int32_t from, std::int32_t to) {
  const std::int64_t x = blockIdx.x;
  const T* src = host + g.host_block_offset(from, 0, 0) + x * g.block_elems;
  T* dst = host + g.host_block_offset(to, 0, 0) + x * g.block_elems;
  for (std::int64_t e = threadIdx.x; e < g.block_elems; e += blockDim.x) dst[e] = src[e];
}

}  // namespace kernels
}  // namespace gpu
}  // namespace v0
}  // namespace oasiskv
