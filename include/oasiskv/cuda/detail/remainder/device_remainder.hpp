// DeviceRemainder<T>: the CUDA engine's one seam to the remainder estimate (the twin of the CPU's
// cpu/detail/remainder/remainder_store.hpp): what an estimate keeps on the device, kept current by
// append, truncate and fork on the compute stream, and its kernel for Cache::remainder. One
// implementation per estimate (clusters.hpp, quantized.hpp), chosen once by make_device_remainder
// (make_device_remainder.hpp); with `none` the engine holds none. Host code: each hook enqueues
// kernels on the engine's compute stream, after the engine's own work on the rows and summaries.
#pragma once

#include <cstdint>
#include <span>

#include <cuda_runtime_api.h>

#include "oasiskv/admission.hpp"
#include "oasiskv/cache_engine.hpp"
#include "oasiskv/config.hpp"
#include "oasiskv/cuda/ops.hpp"
#include "oasiskv/kit/host_block_pool.hpp"
#include "oasiskv/view.hpp"

namespace oasiskv {
inline namespace v0 {
namespace gpu::detail {

// The engine's state every hook reads, fixed at the engine's construction.
template <KvElement T>
struct RemainderContext {
  const CacheLayout* layout = nullptr;         // host copy (a profile's tables in host memory)
  const CacheLayout* device_layout = nullptr;  // the kernels' copy
  DeviceHostTier<T> host;                      // the pinned host tier and the device block map
  const HostBlockPool* pool = nullptr;         // the host side of the map (remote blocks)
  const float* summaries = nullptr;            // device block summaries
  cudaStream_t compute = nullptr;
};

template <KvElement T>
class DeviceRemainder {
 public:
  virtual ~DeviceRemainder() = default;

  // A new sequence in `slot`.
  virtual void reset(int slot) = 0;
  // After append_kernel wrote the batch's rows (row_offset, k, v: as append's, on the device;
  // entries: the same append on the host).
  virtual void appended(int layer, const DeviceBatch& batch, const std::int32_t* row_offset, const T* k, const T* v,
                        std::span<const AppendEntry> entries) = 0;
  // After truncate_rows cut (slot, layer) to `length` rows.
  virtual void truncated(int slot, int layer, std::int64_t length) = 0;
  // After fork_rows made dst the first `length` rows of src at `layer`.
  virtual void forked(int src, int dst, int layer, std::int64_t length) = 0;
  // Cache::remainder over a built view (batch: its slots and lengths; indptr, block: its CSR
  // arrays on the device): q ([batch * rows][num_q_heads][head_dim], float or T), out and lse
  // device memory.
  virtual void estimate(int layer, const DeviceBatch& batch, const std::int32_t* indptr, const std::int32_t* block,
                        const RowsView& q, std::int64_t rows, float* out, float* lse) = 0;
  // An admitted sequence takes what the message carries for the estimate (synchronous: admit is
  // not a decode-path call; check_admission checked the message against this cache).
  virtual void admit(int slot, const AdmissionMessage& m) = 0;
};

}  // namespace gpu::detail
}  // namespace v0
}  // namespace oasiskv
