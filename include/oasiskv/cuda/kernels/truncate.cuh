// Truncate (nvcc only): what dropping rows [length, ...) of one (sequence, layer) changes on the
// device. truncate_rows_kernel (compute stream): the partial block's summary refolded from its rows
// in order, exactly as append folded them, and the recent ring of the new length rebuilt from the
// host tier. truncate_residency_kernel (copy stream): selectable slots holding a block from
// length / block_tokens on are freed.
#pragma once

#include <cstdint>

#include "oasiskv/cuda/kernels/common.cuh"
#include "oasiskv/transfer_plan.hpp"  // kNoBlock

namespace oasiskv {
inline namespace v0 {
namespace gpu {
namespace kernels {

inline constexpr int kTruncateThreads = 256;

// Grid: kv_heads. Threads take channels (summary) and elements (ring blocks).
template <class T>
__global__ void __launch_bounds__(kTruncateThreads)
    truncate_rows_kernel(CacheLayout g, int seq_slot, int layer, std::int64_t length, const T* host, T* pool,
                         float* summaries) {
  const int h = static_cast<int>(blockIdx.x);
  const int d = g.head_dim();
  const std::int64_t bt = g.block_tokens();
  const std::int64_t cut = length / bt;
  if (length % bt != 0) {
    const T* hb = host + g.host_block_offset(seq_slot, layer, h, cut);
    float* mx = summaries + g.summary_offset(seq_slot, layer, h, cut);
    for (int c = static_cast<int>(threadIdx.x); c < d; c += static_cast<int>(blockDim.x)) {
      float hi = to_f(hb[c]), lo = hi;
      for (std::int64_t off = 1; off < length - cut * bt; ++off) {
        const float x = to_f(hb[off * d + c]);
        hi = fmax_cpu(hi, x);
        lo = fmin_cpu(lo, x);
      }
      mx[c] = hi;
      mx[d + c] = lo;
    }
  }
  const std::int64_t first = g.ring_start(length) > g.sink_blocks ? g.ring_start(length) : g.sink_blocks;
  for (std::int64_t b = first; b < g.blocks_for(length); ++b) {
    const T* src = host + g.host_block_offset(seq_slot, layer, h, b);
    T* dst = pool + static_cast<std::int64_t>(g.slot_id(seq_slot, h, g.pinned_slot(b))) * g.block_elems;
    for (std::int64_t e = threadIdx.x; e < g.block_elems; e += blockDim.x) dst[e] = src[e];
  }
}

// Grid: kv_heads. Frees the selectable slots of (seq_slot, layer) that hold a block >= cut.
template <int = 0>  // a template: defined in every including TU without ODR clashes
__global__ void __launch_bounds__(kTruncateThreads)
    truncate_residency_kernel(CacheLayout g, int seq_slot, int layer, std::int64_t cut, std::int32_t* res_block,
                              std::int64_t* res_last) {
  const int h = static_cast<int>(blockIdx.x);
  const std::int64_t row = g.residency_offset(seq_slot, layer, h);
  for (int j = static_cast<int>(threadIdx.x); j < g.selectable_blocks; j += static_cast<int>(blockDim.x)) {
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
