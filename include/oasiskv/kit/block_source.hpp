// Block sources: where a block's rows live when they are not resident: the local host tier
// (HostTier: pageable on the CPU backend, pinned on CUDA), which this concept states; an admitted
// sequence's prompt blocks in another process are read through RemoteBlockSource instead
// (remote_blocks.hpp, the UCX transport in ucx/). A source addresses one block of one (sequence
// slot, layer, kv head): K rows then V rows, CacheLayout::block_elems elements, the unit every
// copy moves.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>

namespace oasiskv {
inline namespace v0 {

template <class S, class T>
concept BlockSource = requires(const S& s, int seq_slot, int layer, int kv_head, std::int64_t block) {
  { s.block(seq_slot, layer, kv_head, block) } -> std::convertible_to<const T*>;
  { s.bytes_reserved() } -> std::convertible_to<std::size_t>;
};

}  // namespace v0
}  // namespace oasiskv
