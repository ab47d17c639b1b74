// BlockGather: runs a host-known list of block copies, by the zero-copy gather kernel or by one
// cudaMemcpyBatchAsync. Part of the GPU benchmark (bench/cuda), not of the library: the cache's
// decode path keeps its plans on the device and copies with gpu::gather_admits, and nothing in
// oasiskv::cuda needs a host-side copy list.
//
// NOT capturable: BlockGather::run (zero_copy_kernel) waits on the host (cudaEventSynchronize)
// for the launch that read a staging buffer two runs earlier before it rewrites that buffer, so
// it must not be called while its stream is being captured into a CUDA graph.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include <cuda_runtime_api.h>

#include "oasiskv/kit/block_copy.hpp"
#include "oasiskv/cuda/device_memory.hpp"

namespace oasiskv::gpu_bench {

// How BlockGather runs a host-known list of block copies. Both behind the same call:
//   zero_copy_kernel: the descriptors go to mapped pinned staging, which gpu::gather_copies reads;
//                     one launch, sources read zero-copy (pinned host) or from device memory.
//   dma_batch:        one cudaMemcpyBatchAsync (copy engines; no SMs used). Needs a stream other
//                     than the legacy default stream.
enum class GatherMethod : std::uint8_t { zero_copy_kernel, dma_batch };

// One cudaMemcpyBatchAsync for a host-known list (stream-ordered source access). Returns once
// the copies are enqueued.
void dma_batch_copy(std::span<const BlockCopy> copies, cudaStream_t stream);

// Staging is double-buffered: run() rewrites the buffer used two runs earlier, after a host wait
// on that run's event (see above: not capturable). Every resource is an RAII member, so a
// constructor that throws releases what it had acquired.
class BlockGather {
 public:
  // Throws oasiskv::Error for max_copies <= 0 or when a CUDA allocation fails.
  BlockGather(int max_copies, GatherMethod method);
  BlockGather(const BlockGather&) = delete;
  BlockGather& operator=(const BlockGather&) = delete;

  GatherMethod method() const noexcept { return method_; }
  int max_copies() const noexcept { return max_copies_; }
  // Enqueues the copies on `stream` (at most max_copies). zero_copy_kernel: host-waits for the run
  // two calls earlier, then one kernel launch. dma_batch: one cudaMemcpyBatchAsync.
  void run(std::span<const BlockCopy> copies, cudaStream_t stream);

 private:
  struct FreeHost {
    void operator()(void* p) const noexcept;
  };

  GatherMethod method_;
  int max_copies_;
  std::unique_ptr<void, FreeHost> staging_;  // pinned mapped: 2 x (count + max_copies descriptors)
  std::unique_ptr<gpu::Event> used_[2];           // the last launch that read each staging buffer
  int next_ = 0;
};

}  // namespace oasiskv::gpu_bench
