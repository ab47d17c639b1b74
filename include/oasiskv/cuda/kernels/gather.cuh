// Gather (nvcc only): admitted blocks from the host tier (read zero-copy) into the slot pool, and
// a generic list of block copies.
#pragma once

#include <cstddef>
#include <cstdint>

#include "oasiskv/cuda/kernels/common.cuh"
#include "oasiskv/kit/host_block_pool.hpp"

namespace oasiskv {
inline namespace v0 {
namespace gpu {
namespace kernels {

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

// Grid: (pairs, max_selectable_blocks). Thread block (p, a) copies admit a of pair p: from the host
// tier, or, for a block kept in another process (kRemoteBlock), from staging[p][a], where the host
// read it before this kernel (the CUDA engine's remote reads). admits and staging have a row of
// max_selectable_blocks per pair.
template <class T>
__global__ void __launch_bounds__(kGatherThreads)
    gather_admits_kernel(CacheLayout g, int layer, DeviceBatch batch, const DeviceAdmit* admits,
                         const std::int32_t* admit_count, DeviceHostTier<T> host, T* pool, const T* staging) {
  const int p = static_cast<int>(blockIdx.x);
  const int a = static_cast<int>(blockIdx.y);
  if (a >= admit_count[p]) return;
  const int H = g.num_kv_heads();
  const int i = p / H;
  const int h = p % H;
  const int s = batch.seq_slot[i];
  const DeviceAdmit adm = admits[static_cast<std::int64_t>(p) * g.max_selectable_blocks + a];
  const bool remote = host.block_map[g.block_map_index(s, adm.block)] == kRemoteBlock;
  if (remote && staging == nullptr) return;  // not reachable: remote sequences always pass staging
  const T* src = remote ? staging + (static_cast<std::int64_t>(p) * g.max_selectable_blocks + a) * g.block_elems
                        : host.block(g, s, layer, h, adm.block);
  T* dst = pool + static_cast<std::int64_t>(g.slot_id(s, layer, h, g.selectable_slot(adm.slot))) * g.block_elems;
  block_copy(src, dst, static_cast<std::size_t>(g.block_elems) * sizeof(T));
}

// Grid: max_count. Thread block c copies copies[c] when c < *count.
template <int = 0>
__global__ void __launch_bounds__(kGatherThreads)
    gather_copies_kernel(const BlockCopy* copies, const std::int32_t* count) {
  const int c = static_cast<int>(blockIdx.x);
  if (c >= *count) return;
  const BlockCopy bc = copies[c];
  block_copy(bc.src, bc.dst, bc.bytes);
}

}  // namespace kernels
}  // namespace gpu
}  // namespace v0
}  // namespace oasiskv
