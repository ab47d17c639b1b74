// Views (nvcc only): the residency snapshot of a plan, the CSR LayerView built from it, and the
// recall counter (selected blocks the view holds).
#pragma once

#include <cstdint>

#include "oasiskv/cuda/kernels/common.cuh"
#include "oasiskv/kit/transfer_plan.hpp"  // kNoBlock

namespace oasiskv {
inline namespace v0 {
namespace gpu {
namespace kernels {

inline constexpr int kViewThreads = 128;

// Grid: batch. Copies the residency rows of entry i to snapshot[i]: [kv head][max_selectable_blocks],
// a head's row padded with kNoBlock past its own selectable slots (a profile's heads differ), and
// adds the entry's admits and capped counts to counters.
template <int = 0>
__global__ void __launch_bounds__(kViewThreads)
    snapshot_kernel(CacheLayout g, int layer, DeviceBatch batch, const std::int32_t* res_block, std::int32_t* snapshot,
                    const std::int32_t* admit_count, const std::int32_t* capped, unsigned long long* counters) {
  const int i = static_cast<int>(blockIdx.x);
  const int H = g.num_kv_heads();
  const int M = g.max_selectable_blocks;
  const std::int64_t n = static_cast<std::int64_t>(H) * M;
  std::int32_t* dst = snapshot + static_cast<std::int64_t>(i) * n;
  for (std::int64_t e = threadIdx.x; e < n; e += blockDim.x) {
    const int h = static_cast<int>(e / M), j = static_cast<int>(e % M);
    dst[e] = j < g.head_selectable_blocks(layer, h) ? res_block[g.residency_offset(batch.seq_slot[i], layer, h) + j]
                                                    : kNoBlock;
  }
  if (threadIdx.x == 0 && counters != nullptr) {
    unsigned long long a = 0, c = 0;
    for (int h = 0; h < H; ++h) {
      const std::int64_t p = static_cast<std::int64_t>(i) * H + h;
      a += static_cast<unsigned long long>(admit_count[p]);
      if (capped != nullptr) c += static_cast<unsigned long long>(capped[p]);
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
__device__ __forceinline__ ViewShape view_shape(const CacheLayout& g, std::int64_t len) {
  ViewShape v;
  v.len = len;
  v.nb = g.blocks_for(len);
  v.ring_first = g.ring_start(len);
  v.nsink = static_cast<int>(v.nb < g.sink_blocks ? v.nb : g.sink_blocks);
  v.nring = static_cast<int>(v.nb > v.ring_first ? v.nb - v.ring_first : 0);
  return v;
}
__device__ __forceinline__ bool view_chosen(const CacheLayout& g, const ViewShape& v, std::int32_t b) {
  return b != kNoBlock && b >= g.sink_blocks && b < v.ring_first;
}

// Grid: pairs. counts[p]: the entries of pair p (snapshot rows of max_selectable_blocks).
template <int = 0>
__global__ void __launch_bounds__(kViewThreads)
    view_count_kernel(CacheLayout g, DeviceBatch batch, const std::int32_t* snapshot, std::int32_t* counts) {
  __shared__ int red[32];
  const int p = static_cast<int>(blockIdx.x);
  const int K = g.max_selectable_blocks;
  const ViewShape v = view_shape(g, batch.seq_len[p / g.num_kv_heads()]);
  const std::int32_t* row = snapshot + static_cast<std::int64_t>(p) * K;
  int c = 0;
  for (int j = static_cast<int>(threadIdx.x); j < K; j += blockDim.x) c += view_chosen(g, v, row[j]) ? 1 : 0;
  c = block_sum(c, red);
  if (threadIdx.x == 0) counts[p] = v.nsink + c + v.nring;
}

// The view row in shared memory: selectable_blocks rounded up to whole 16-byte vectors, the
// padding kNoBlock. The rank loop then has no remainder: compute-sanitizer (sm_90) saw the
// remainder's loads of an unpadded row read one int past the allocation as a 12-byte load.
__host__ __device__ constexpr int view_row_ints(int selectable_blocks) { return (selectable_blocks + 3) / 4 * 4; }

// Grid: pairs; dynamic shared memory: view_row_ints(max_selectable_blocks) int32. Pair p's entries
// start at the sum of counts[0, p); chosen blocks are placed by rank (blocks are distinct), so
// ascending.
template <int = 0>
__global__ void __launch_bounds__(kViewThreads)
    view_fill_kernel(CacheLayout g, int layer, DeviceBatch batch, const std::int32_t* snapshot,
                     const std::int32_t* counts, std::int32_t* indptr, std::int32_t* slot, std::int32_t* block,
                     std::int32_t* valid) {
  extern __shared__ std::int32_t view_row[];  // [K]
  __shared__ long long red[32];
  const int p = static_cast<int>(blockIdx.x);
  const int pairs = static_cast<int>(gridDim.x);
  const int H = g.num_kv_heads(), K = g.max_selectable_blocks;
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
  const std::int64_t bt = g.block_tokens();
  auto put = [&](std::int64_t e, std::int64_t b, int local) {
    slot[e] = g.slot_id(s, layer, h, local);
    block[e] = static_cast<std::int32_t>(b);
    const std::int64_t left = v.len - b * bt;
    valid[e] = static_cast<std::int32_t>(left < bt ? left : bt);
  };
  for (int t = tid; t < v.nsink; t += blockDim.x) put(base + t, t, t);
  const std::int32_t* row = snapshot + static_cast<std::int64_t>(p) * K;
  const int K4 = view_row_ints(K);
  for (int j = tid; j < K4; j += blockDim.x) view_row[j] = j < K ? row[j] : kNoBlock;
  __syncthreads();
  const int nchosen = counts[p] - v.nsink - v.nring;
  for (int j = tid; j < K; j += blockDim.x) {
    const std::int32_t b = view_row[j];
    if (!view_chosen(g, v, b)) continue;
    int rank = 0;
    for (int u = 0; u < K4; ++u) {
      const std::int32_t x = view_row[u];
      rank += (view_chosen(g, v, x) && x < b) ? 1 : 0;
    }
    put(base + v.nsink + rank, b, g.selectable_slot(j));
  }
  for (int t = tid; t < v.nring; t += blockDim.x) {
    const std::int64_t b = v.ring_first + t;
    put(base + v.nsink + nchosen + t, b, g.pinned_slot(b));
  }
}

// Grid: pairs. Adds to *counter the selected blocks of pair p that its view holds (binary search
// in the view's ascending blocks).
template <int = 0>
__global__ void __launch_bounds__(kViewThreads)
    count_hits_kernel(const std::int32_t* selected, const std::int32_t* selected_count, int k,
                      const std::int32_t* indptr, const std::int32_t* block, unsigned long long* counter) {
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
