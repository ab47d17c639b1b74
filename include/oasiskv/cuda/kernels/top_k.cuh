// Segmented top-K (nvcc only): the K best blocks of every (sequence, kv head) segment.
//
// CCCL 3.0 has no cub::DeviceTopK (it arrives in 3.5). Rather than a full
// cub::DeviceSegmentedSort of every candidate (8 radix passes over 64-bit keys, a temp-storage
// size query that fails without a device and must precede graph capture, and several launches),
// each segment is one thread block that runs a radix *select*: four 8-bit histogram passes over
// the 32-bit order key of the score find the K-th best key exactly; the blocks strictly better
// than it, plus the lowest-index blocks equal to it, are the selection (ScoreOrder's tie rule);
// the K chosen (key, index) pairs are then bitonic-sorted in shared memory. One launch, no temp
// storage, no host synchronisation; deterministic.
#pragma once

#include <cstdint>

#include "oasiskv/cuda/kernels/common.cuh"

namespace oasiskv {
inline namespace v0 {
namespace gpu {
namespace kernels {

inline constexpr int kTopKThreads = 256;

// The worst order key: every NaN, and nothing else (the largest key of a number is -inf's,
// 0xff800000).
inline constexpr std::uint32_t kNanOrderKey = 0xffffffffu;

// Smaller key = better: descending score, with ScoreOrder's rules. -0.0 and +0.0 compare equal,
// so both map to the key of +0.0. Every NaN (either sign, any payload) ranks below every number,
// -inf included, so it maps to kNanOrderKey; NaNs then tie, and ties go to the lower index.
__device__ __forceinline__ std::uint32_t order_key(float f) {
  if (f != f) return kNanOrderKey;
  std::uint32_t b = __float_as_uint(f == 0.0f ? 0.0f : f);
  b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);  // ascending float order
  return ~b;
}

// Grid: segments. Dynamic shared memory: next power of two >= k 64-bit keys. Segment s selects
// at most k blocks into selected[s * k ...], or, with head_budgets (one layer's row of a budget
// profile, num_kv_heads entries), at most head_budgets[s % num_kv_heads].selectable_blocks <= k.
template <int = 0>
__global__ void __launch_bounds__(kTopKThreads)
    topk_kernel(const float* scores, int stride, const std::int32_t* count, const std::int32_t* first, int k,
                const HeadBudget* head_budgets, int num_kv_heads, std::int32_t* selected,
                std::int32_t* selected_count) {
  extern __shared__ unsigned long long keys[];  // [pow2 >= k]
  __shared__ unsigned hist[256];
  __shared__ std::uint32_t prefix_s, remaining_s;
  __shared__ unsigned n_below, n_equal_taken;
  __shared__ unsigned warp_sums[kTopKThreads / 32];
  const int seg = static_cast<int>(blockIdx.x);
  const int n = count[seg];
  const int ks = head_budgets != nullptr ? head_budgets[seg % num_kv_heads].selectable_blocks : k;
  const int kk = n < ks ? n : ks;
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
  // Bitonic sort of the kk keys (padded to a power of two with the largest key, which no
  // (key, index) pair reaches: indices are below 2^31).
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

}  // namespace kernels
}  // namespace gpu
}  // namespace v0
}  // namespace oasiskv
