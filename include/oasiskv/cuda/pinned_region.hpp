// PinnedRegion: host memory for the CUDA backend's host tier, pinned and mapped when it can be,
// ordinary pageable memory (with a warning) when it cannot.
//
// Host-only (g++ or nvcc). Defined in cuda/runtime.cpp.
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

namespace oasiskv {
inline namespace v0 {
namespace gpu {

// An mmap'd region registered with cudaHostRegister (mapped and portable) in chunks of at most
// max_chunk bytes (64 GiB: one registration of 512 GiB fails on r580+ drivers), each chunk a
// multiple of `align` bytes (pass the block size so no block straddles two registrations).
// Without a device, or when a registration fails, the sticky error is cleared, every chunk
// unregistered, and the region stays ordinary pageable memory with a warning on stderr: never a
// crash. device_data() is the address kernels read (zero-copy), or null when not pinned.
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

}  // namespace gpu
}  // namespace v0
}  // namespace oasiskv
