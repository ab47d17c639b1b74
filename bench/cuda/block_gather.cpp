// BlockGather and dma_batch_copy (the GPU benchmark's host-known copy lists).
#include "block_gather.hpp"

#include <cstring>

#include "oasiskv/error.hpp"
#include "oasiskv/cuda/check.hpp"
#include "oasiskv/cuda/ops.hpp"

namespace oasiskv::gpu_bench {

void dma_batch_copy(std::span<const BlockCopy> copies, cudaStream_t stream) {
  if (copies.empty()) return;
  std::vector<void*> dsts(copies.size());
  std::vector<const void*> srcs(copies.size());
  std::vector<std::size_t> sizes(copies.size());
  for (std::size_t i = 0; i < copies.size(); ++i) {
    dsts[i] = copies[i].dst;
    srcs[i] = copies[i].src;
    sizes[i] = copies[i].bytes;
  }
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.flags = cudaMemcpyFlagDefault;
  std::size_t attr_index = 0;
  OASISKV_CUDA_CHECK(
      cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), copies.size(), &attr, &attr_index, 1, stream));
}

namespace {
struct StagingHeader {
  std::int32_t count;
  std::int32_t pad[3];
};
static_assert(sizeof(StagingHeader) % alignof(BlockCopy) == 0);
std::size_t staging_stride(int max_copies) {
  return sizeof(StagingHeader) + static_cast<std::size_t>(max_copies) * sizeof(BlockCopy);
}
}  // namespace

void BlockGather::FreeHost::operator()(void* p) const noexcept {
  if (p != nullptr) (void)cudaFreeHost(p);
}

BlockGather::BlockGather(int max_copies, GatherMethod method) : method_(method), max_copies_(max_copies) {
  if (max_copies <= 0) fail("BlockGather: max_copies must be positive, got {}", max_copies);
  if (method_ != GatherMethod::zero_copy_kernel) return;
  void* p = nullptr;
  OASISKV_CUDA_CHECK(cudaHostAlloc(&p, 2 * staging_stride(max_copies), cudaHostAllocMapped));
  staging_.reset(p);
  // If the second Event throws, staging_ and the first Event are members: released as the
  // constructor unwinds.
  for (auto& e : used_) e = std::make_unique<gpu::Event>();
}

void BlockGather::run(std::span<const BlockCopy> copies, cudaStream_t stream) {
  if (copies.size() > static_cast<std::size_t>(max_copies_)) {
    fail("BlockGather::run: {} copies, more than the {} it was made for", copies.size(), max_copies_);
  }
  if (copies.empty()) return;
  if (method_ == GatherMethod::dma_batch) {
    dma_batch_copy(copies, stream);
    return;
  }
  auto* base = static_cast<std::byte*>(staging_.get()) + static_cast<std::size_t>(next_) * staging_stride(max_copies_);
  // Host wait: the launch that read this buffer two runs ago (an event never recorded is complete).
  OASISKV_CUDA_CHECK(cudaEventSynchronize(used_[next_]->get()));
  auto* header = reinterpret_cast<StagingHeader*>(base);
  auto* desc = reinterpret_cast<BlockCopy*>(base + sizeof(StagingHeader));
  header->count = static_cast<std::int32_t>(copies.size());
  std::memcpy(static_cast<void*>(desc), copies.data(), copies.size() * sizeof(BlockCopy));
  gpu::gather_copies(desc, &header->count, static_cast<int>(copies.size()), stream);
  used_[next_]->record(stream);
  next_ ^= 1;
}

}  // namespace oasiskv::gpu_bench
