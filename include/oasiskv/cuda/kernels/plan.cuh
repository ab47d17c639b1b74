// Transfer planning and residency (nvcc only): TransferPlanner::plan + apply for every pair, and
// the reset of residency rows.
#pragma once

#include <cstddef>
#include <cstdint>

#include "oasiskv/cuda/kernels/common.cuh"
#include "oasiskv/kit/transfer_plan.hpp"  // kNoBlock

namespace oasiskv {
inline namespace v0 {
namespace gpu {
namespace kernels {

inline constexpr int kPlanThreads = 256;

// Dynamic shared memory of plan_kernel: per slot last (int64), block, chosen, target (int32);
// per selected block its slot and the missing list (int32).
__host__ __device__ inline std::size_t plan_smem_bytes(int slots, int k) {
  return static_cast<std::size_t>(slots) * (8 + 4 + 4 + 4) + static_cast<std::size_t>(k) * (4 + 4);
}

// Grid: pairs; dynamic shared memory plan_smem_bytes(max_selectable_blocks, sel_stride). Pair p
// has its head's selectable slots, admits a row of max_selectable_blocks, and caps[p] admits at
// most (CacheLayout::admit_cap of its head). The order-dependent lists (kept in selection order,
// missing in selection order, free slots ascending) are built by one thread, as they are
// O(slots); victims are ranked in parallel by (last selected, block), as TransferPlanner's sort.
// At least 4 blocks per SM: with no minimum ptxas held this kernel to 32 registers and spilled
// once a profile's per-head top-K was read from its table.
template <int = 0>
__global__ void __launch_bounds__(kPlanThreads, 4)
    plan_kernel(CacheLayout g, int layer, DeviceBatch batch, const std::int64_t* steps, const std::int32_t* caps,
                const std::int32_t* selected, const std::int32_t* selected_count, int sel_stride,
                std::int32_t* res_block, std::int64_t* res_last, PlanBuffers out) {
  extern __shared__ unsigned long long plan_smem[];
  const int p = static_cast<int>(blockIdx.x);
  const int H = g.num_kv_heads();
  const int i = p / H;
  const int h = p % H;
  const int S = g.head_selectable_blocks(layer, h);
  std::int64_t* last = reinterpret_cast<std::int64_t*>(plan_smem);  // [S]
  std::int32_t* blk = reinterpret_cast<std::int32_t*>(last + S);    // [S]
  std::int32_t* chosen = blk + S;                                   // [S]
  std::int32_t* target = chosen + S;                                // [S]
  std::int32_t* sel_slot = target + S;                              // [sel_stride]
  std::int32_t* missing = sel_slot + sel_stride;                    // [sel_stride]
  __shared__ int free_count_s, missing_count_s;

  const std::int64_t row = g.residency_offset(batch.seq_slot[i], layer, h);
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
        if (blk[v] != kNoBlock && !chosen[v] && (last[v] < last[j] || (last[v] == last[j] && blk[v] < blk[j]))) {
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
    // The host's CacheLayout::admit_cap for this pair.
    const int cap = caps[p] > 0 ? caps[p] : 0;
    int n = miss < ntargets ? miss : ntargets;
    n = n < cap ? n : cap;
    DeviceAdmit* admits = out.admits + static_cast<std::int64_t>(p) * g.max_selectable_blocks;
    for (int a = 0; a < n; ++a) {
      const std::int32_t slot = target[a];
      admits[a] = DeviceAdmit{missing[a], slot, blk[slot]};
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

inline constexpr int kClearThreads = 256;

// Grid-stride over the residency entries of (seq_slot, layer), where -1 means every sequence
// slot (every layer): one run per sequence slot, of the layer's entries or of every layer's (a
// sequence slot's residency is contiguous, layer after layer, with a profile too).
template <int = 0>
__global__ void __launch_bounds__(kClearThreads)
    clear_residency_kernel(CacheLayout g, int seq_slot, int layer, std::int32_t* res_block, std::int64_t* res_last) {
  const std::int64_t per = layer >= 0 ? g.layer_residency(layer)
                           : g.profiled()
                               ? g.sequence_residency
                               : static_cast<std::int64_t>(g.num_layers()) * g.num_kv_heads() * g.selectable_blocks;
  const int seqs = seq_slot < 0 ? g.config.max_sequences : 1;
  const std::int64_t total = per * seqs;
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += step) {
    const int s = seq_slot < 0 ? static_cast<int>(e / per) : seq_slot;
    const std::int64_t at = g.residency_offset(s, layer < 0 ? 0 : layer, 0) + e % per;
    res_block[at] = kNoBlock;
    res_last[at] = -1;
  }
}

}  // namespace kernels
}  // namespace gpu
}  // namespace v0
}  // namespace oasiskv
