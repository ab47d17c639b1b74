// Truncate and fork (nvcc only): what a sequence's new length changes on the device.
// rebuild_rows_kernel (compute stream): the partial block's summary refolded from its rows in
// order, exactly as append folded them, the pinned slots rebuilt from the host tier and, for a
// fork, the source's summaries copied; rebuild_run_sums_kernel the same for the runs scorer's run
// key sums. truncate_residency_kernel (copy stream): selectable slots
// holding a block from length / block_tokens on are freed.
#pragma once

#include <cstdint>

#include "oasiskv/cuda/kernels/append.cuh"  // fold_run_key
#include "oasiskv/cuda/kernels/common.cuh"
#include "oasiskv/kit/transfer_plan.hpp"  // kNoBlock

namespace oasiskv {
inline namespace v0 {
namespace gpu {
namespace kernels {

inline constexpr int kTruncateThreads = 256;

// Thread block h of a rebuild grid (kv_heads) at `length`: blocks [0, cut) are whole, block `cut`
// holds partial_rows rows (0: length ends on a block boundary). rebuild_rows_kernel and
// rebuild_moments_kernel (remainder/clusters.cuh) rebuild from the same.
struct RebuildHead {
  int h = 0, d = 0;  // kv head, head_dim
  std::int64_t bt = 0, cut = 0, partial_rows = 0;
};

__device__ __forceinline__ RebuildHead rebuild_head(const CacheLayout& g, std::int64_t length) {
  RebuildHead r;
  r.h = static_cast<int>(blockIdx.x);
  r.d = g.head_dim();
  r.bt = g.block_tokens();
  r.cut = length / r.bt;
  r.partial_rows = length - r.cut * r.bt;
  return r;
}

// A fork's copy of the whole blocks' per-block vectors (n floats), threads striding.
__device__ __forceinline__ void copy_block_floats(const float* from, float* to, std::int64_t n) {
  for (std::int64_t e = threadIdx.x; e < n; e += blockDim.x) to[e] = from[e];
}

// Grid: kv_heads. Rebuilds what (dst_slot, layer) derives from its host rows at `length`:
// summaries of blocks [0, length / block_tokens) copied from src_slot (when src_slot != dst_slot:
// a fork), the partial block's summary refolded from its rows in order, and the pinned slots of
// blocks [first_pinned, sink_blocks) (the sinks: a fork) and of the recent ring copied from the
// host tier. Threads take channels (summaries) and elements (blocks).
template <class T>
__global__ void __launch_bounds__(kTruncateThreads)
    rebuild_rows_kernel(CacheLayout g, int src_slot, int dst_slot, int layer, std::int64_t length,
                        std::int64_t first_pinned, DeviceHostTier<T> host, T* pool, float* summaries) {
  const RebuildHead r = rebuild_head(g, length);
  const int h = r.h, d = r.d;
  if (src_slot != dst_slot) {
    copy_block_floats(summaries + g.summary_offset(src_slot, layer, h, 0),
                      summaries + g.summary_offset(dst_slot, layer, h, 0), r.cut * 2 * d);
  }
  if (r.partial_rows != 0) {
    const T* hb = host.block(g, dst_slot, layer, h, r.cut);
    float* mx = summaries + g.summary_offset(dst_slot, layer, h, r.cut);
    for (int c = static_cast<int>(threadIdx.x); c < d; c += static_cast<int>(blockDim.x)) {
      float hi = to_f(hb[c]), lo = hi;
      for (std::int64_t off = 1; off < r.partial_rows; ++off) {
        const float x = to_f(hb[off * d + c]);
        hi = fmax_cpu(hi, x);
        lo = fmin_cpu(lo, x);
      }
      mx[c] = hi;
      mx[d + c] = lo;
    }
  }
  const std::int64_t nb = g.blocks_for(length);
  const std::int64_t ring = g.ring_start(length) > g.sink_blocks ? g.ring_start(length) : g.sink_blocks;
  for (std::int64_t b = first_pinned; b < nb; ++b) {
    if (b >= g.sink_blocks && b < ring) continue;
    const T* src = host.block(g, dst_slot, layer, h, b);
    T* dst = pool + static_cast<std::int64_t>(g.slot_id(dst_slot, layer, h, g.pinned_slot(b))) * g.block_elems;
    for (std::int64_t e = threadIdx.x; e < g.block_elems; e += blockDim.x) dst[e] = src[e];
  }
}

// Grid: kv_heads. rebuild_rows_kernel's companion under the runs scorer: dst_slot's run key sums
// of blocks [0, length / block_tokens) copied from src_slot when it differs (a fork), the partial
// block's refolded from its host rows in order.
template <class T>
__global__ void __launch_bounds__(kTruncateThreads)
    rebuild_run_sums_kernel(CacheLayout g, int src_slot, int dst_slot, int layer, std::int64_t length,
                            DeviceHostTier<T> host, float* run_sums) {
  const RebuildHead r = rebuild_head(g, length);
  if (src_slot != dst_slot) {
    copy_block_floats(run_sums + g.run_offset(src_slot, layer, r.h, 0),
                      run_sums + g.run_offset(dst_slot, layer, r.h, 0), r.cut * g.score.runs * r.d);
  }
  if (r.partial_rows == 0) return;
  const T* hb = host.block(g, dst_slot, layer, r.h, r.cut);
  float* block_runs = run_sums + g.run_offset(dst_slot, layer, r.h, r.cut);
  const int rt = g.config.run_tokens;
  for (int c = static_cast<int>(threadIdx.x); c < r.d; c += static_cast<int>(blockDim.x)) {
    // Run by run: its first row, then the others added in order (fold_run_key's bits).
    for (std::int64_t first = 0, run = 0; first < r.partial_rows; first += rt, ++run) {
      float sum = to_f(hb[first * r.d + c]);
      for (std::int64_t off = first + 1; off < first + rt && off < r.partial_rows; ++off) {
        sum = __fadd_rn(sum, to_f(hb[off * r.d + c]));
      }
      block_runs[run * r.d + c] = sum;
    }
  }
}

// Grid: kv_heads. Frees the selectable slots of (seq_slot, layer) that hold a block >= cut.
template <int = 0>  // a template: defined in every including TU without ODR clashes
__global__ void __launch_bounds__(kTruncateThreads)
    truncate_residency_kernel(CacheLayout g, int seq_slot, int layer, std::int64_t cut, std::int32_t* res_block,
                              std::int64_t* res_last) {
  const int h = static_cast<int>(blockIdx.x);
  const std::int64_t row = g.residency_offset(seq_slot, layer, h);
  const int S = g.head_selectable_blocks(layer, h);
  for (int j = static_cast<int>(threadIdx.x); j < S; j += static_cast<int>(blockDim.x)) {
    const std::int32_t b = res_block[row + j];
    if (b != kNoBlock && b >= cut) {
      res_block[row + j] = kNoBlock;
      res_last[row + j] = -1;
    }
  }
}

}  // namespace kernels
}  // namespace gpu
}  // namespace v0
}  // namespace oasiskv
