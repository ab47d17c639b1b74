// Device components of the CUDA backend: RAII device memory, streams and events, the pinned host
// tier (chunked cudaHostRegister of an mmap'd region, pageable fallback), DeviceTier<cuda, T>
// (the slot pool in HBM) and BlockGather (a host-known list of block copies, run by the
// zero-copy gather kernel or by one cudaMemcpyBatchAsync).
//
// Host-only (g++ or nvcc). Non-template members are defined in cuda/runtime.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include "oasiskv/backend.hpp"
#include "oasiskv/config.hpp"
#include "oasiskv/dtype.hpp"
#include "oasiskv/prefetch_pipeline.hpp"
#include "oasiskv/tier.hpp"
#include "oasiskv/cuda/check.cuh"
#include "oasiskv/cuda/ops.cuh"

namespace oasiskv {
inline namespace v0 {
namespace gpu {

// cudaMalloc'd array of n elements; zero-filled on request.
template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t n, bool zero = true) : n_(n) {
    if (n == 0) return;
    void* p = nullptr;
    OASISKV_CUDA_CHECK(cudaMalloc(&p, n * sizeof(T)));
    data_ = static_cast<T*>(p);
    if (zero) {
      const cudaError_t err = cudaMemset(data_, 0, n * sizeof(T));
      if (err != cudaSuccess) {
        cudaFree(data_);
        data_ = nullptr;
        check(err, "cudaMemset", __FILE__, __LINE__);
      }
    }
  }
  ~DeviceBuffer() {
    if (data_ != nullptr) cudaFree(data_);
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : data_(std::exchange(o.data_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      if (data_ != nullptr) cudaFree(data_);
      data_ = std::exchange(o.data_, nullptr);
      n_ = std::exchange(o.n_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return n_; }
  std::size_t bytes() const noexcept { return n_ * sizeof(T); }

 private:
  T* data_ = nullptr;
  std::size_t n_ = 0;
};

// A non-blocking stream.
class Stream {
 public:
  Stream() { OASISKV_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
  ~Stream() {
    if (s_ != nullptr) cudaStreamDestroy(s_);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const noexcept { return s_; }
  operator cudaStream_t() const noexcept { return s_; }  // NOLINT: a stream handle

 private:
  cudaStream_t s_ = nullptr;
};

// An event without timing (cheapest to record and wait on).
class Event {
 public:
  explicit Event(bool timing = false) {
    OASISKV_CUDA_CHECK(cudaEventCreateWithFlags(&e_, timing ? cudaEventDefault : cudaEventDisableTiming));
  }
  ~Event() {
    if (e_ != nullptr) cudaEventDestroy(e_);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  cudaEvent_t get() const noexcept { return e_; }
  void record(cudaStream_t s) { OASISKV_CUDA_CHECK(cudaEventRecord(e_, s)); }
  void wait_on(cudaStream_t s) const { OASISKV_CUDA_CHECK(cudaStreamWaitEvent(s, e_, 0)); }

 private:
  cudaEvent_t e_ = nullptr;
};

// Host memory for the host tier: an mmap'd region registered with cudaHostRegister (mapped and
// portable) in chunks of at most max_chunk bytes (64 GiB: one registration of 512 GiB fails on
// r580+ drivers), each chunk a multiple of `align` bytes (pass the block size so no block
// straddles two registrations). Without a device, or when a registration fails, the sticky error
// is cleared, every chunk unregistered, and the region stays ordinary pageable memory with a
// warning on stderr: never a crash. device_data() is the address kernels read (zero-copy), or
// null when not pinned.
class PinnedRegion {
 public:
  static constexpr std::size_t kMaxChunk = std::size_t{64} << 30;

  PinnedRegion() = default;
  explicit PinnedRegion(std::size_t bytes, std::size_t align = 1, std::size_t max_chunk = kMaxChunk);
  ~PinnedRegion();
  PinnedRegion(PinnedRegion&& o) noexcept;
  PinnedRegion& operator=(PinnedRegion&& o) noexcept;
  PinnedRegion(const PinnedRegion&) = delete;
  PinnedRegion& operator=(const PinnedRegion&) = delete;

  std::byte* data() const noexcept { return data_; }
  std::byte* device_data() const noexcept { return pinned_ ? device_ : nullptr; }
  std::size_t bytes() const noexcept { return bytes_; }
  bool pinned() const noexcept { return pinned_; }
  std::size_t chunks() const noexcept { return chunks_.size(); }

 private:
  void release() noexcept;
  std::byte* data_ = nullptr;
  std::byte* device_ = nullptr;
  std::size_t bytes_ = 0;
  bool pinned_ = false;
  std::vector<std::pair<void*, std::size_t>> chunks_;  // registered chunks
};

// The host tier of the CUDA backend: HostTier's layout in a PinnedRegion.
template <KvElement T>
class PinnedHostTier {
 public:
  explicit PinnedHostTier(const CacheLayout& layout)
      : layout_(layout),
        memory_(static_cast<std::size_t>(layout.host_tier_elements()) * sizeof(T),
                static_cast<std::size_t>(layout.block_elems) * sizeof(T)) {}

  T* base() const noexcept { return reinterpret_cast<T*>(memory_.data()); }
  // Device-accessible base (mapped), or null when the memory could not be pinned.
  T* device_base() const noexcept { return reinterpret_cast<T*>(memory_.device_data()); }
  bool pinned() const noexcept { return memory_.pinned(); }
  T* block(int seq_slot, int layer, int kv_head, std::int64_t block) const noexcept {
    return base() + layout_.host_block_offset(seq_slot, layer, kv_head, block);
  }
  std::size_t bytes_reserved() const noexcept { return memory_.bytes(); }

 private:
  CacheLayout layout_;
  PinnedRegion memory_;
};

// How BlockGather runs a host-known list of block copies. Both behind the same call:
//   zero_copy_kernel: the descriptors go to pinned staging, which the gather kernel reads mapped;
//                     one launch, sources read zero-copy (pinned host) or from device memory.
//   dma_batch:        one cudaMemcpyBatchAsync (copy engines; no SMs used). Needs a stream other
//                     than the legacy default stream.
// Staging is double-buffered; reusing a buffer waits (host) for the launch that read it two runs
// earlier. The decode path of the cache does not use this class: its plans live on the device and
// go straight to gather_admits.
class BlockGather {
 public:
  BlockGather(int max_copies, GatherMethod method);
  ~BlockGather();
  BlockGather(const BlockGather&) = delete;
  BlockGather& operator=(const BlockGather&) = delete;

  GatherMethod method() const noexcept { return method_; }
  void run(std::span<const BlockCopy> copies, cudaStream_t stream);

 private:
  GatherMethod method_;
  int max_copies_;
  void* staging_ = nullptr;  // pinned: 2 x (count + max_copies descriptors)
  cudaEvent_t used_[2] = {nullptr, nullptr};
  int next_ = 0;
  std::vector<void*> dsts_;
  std::vector<const void*> srcs_;
  std::vector<std::size_t> sizes_;
};

// One cudaMemcpyBatchAsync for a host-known list (stream-ordered source access).
void dma_batch_copy(std::span<const BlockCopy> copies, cudaStream_t stream);

}  // namespace gpu

// The slot pool in HBM, with DeviceTier<cpu>'s slot numbering and layout.
template <KvElement T>
class DeviceTier<cuda, T> {
 public:
  explicit DeviceTier(const CacheLayout& layout)
      : layout_(layout),
        slots_per_layer_(static_cast<std::int64_t>(layout.config.max_sequences) *
                         layout.config.shape.num_kv_heads * layout.budget_blocks),
        memory_(static_cast<std::size_t>(layout.config.shape.num_layers) * static_cast<std::size_t>(slots_per_layer_) *
                static_cast<std::size_t>(layout.block_elems)) {}

  std::int32_t slot_id(int seq_slot, int kv_head, int local_slot) const noexcept {
    return static_cast<std::int32_t>(
        (static_cast<std::int64_t>(seq_slot) * layout_.config.shape.num_kv_heads + kv_head) * layout_.budget_blocks +
        local_slot);
  }
  T* layer_pool(int layer) const noexcept { return memory_.data() + layer * slots_per_layer_ * layout_.block_elems; }
  T* slot(int layer, std::int32_t slot_id) const noexcept {
    return layer_pool(layer) + static_cast<std::int64_t>(slot_id) * layout_.block_elems;
  }
  std::int64_t slots_per_layer() const noexcept { return slots_per_layer_; }
  std::size_t bytes_reserved() const noexcept { return memory_.bytes(); }

 private:
  CacheLayout layout_;
  std::int64_t slots_per_layer_;
  gpu::DeviceBuffer<T> memory_;
};

}  // namespace v0
}  // namespace oasiskv
