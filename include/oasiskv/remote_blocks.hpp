// RemoteBlockSource: where the blocks of a sequence admitted from another process live (the
// remote tier). The Cache keeps such a sequence's prompt blocks there instead of in its host
// pool (HostBlockPool marks them kRemoteBlock) and its backend reads them inside the prefetch
// pipeline's background copies, under the same ticket rules as host copies. Transport-neutral:
// oasiskv::ucx implements it over UCX RMA (oasiskv/ucx/remote_tier.hpp); a test can implement it
// over plain memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace oasiskv {
inline namespace v0 {

// One read: `bytes` at the remote address `remote` (as the admission message gives it) into `local`.
struct RemoteBlockRead {
  void* local = nullptr;
  std::uint64_t remote = 0;
  std::size_t bytes = 0;
};

class RemoteBlockSource {
 public:
  virtual ~RemoteBlockSource() = default;
  // Reads every block, or throws oasiskv::Error saying why not (the peer gone, a deadline passed,
  // the request released); after a throw no `local` is written any more. Called from the
  // backend's copy thread, one call at a time per source; an implementation whose transport is
  // shared with other threads serialises it itself.
  virtual void read(std::span<const RemoteBlockRead> reads) = 0;
};

}  // namespace v0
}  // namespace oasiskv
