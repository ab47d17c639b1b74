// HostBlockPool: the bookkeeping of the host tier as a pool of blocks. A pool block holds one
// block_tokens-token block of a sequence for every layer and kv head (one id per logical block,
// as vLLM's block ids), so a sequence maps its logical blocks to pool blocks once and its layers
// share the boundaries. Blocks are reference counted: fork shares a sequence's blocks, and a block
// held by more than one sequence is never written (the writer takes a fresh copy first: copy on
// write). Memory follows the blocks held; the pool's size is CacheConfig::host_pool_blocks.
//
// Host-only and backend-neutral: both engines keep their host tier's map here (the CUDA engine
// mirrors it on the device for its kernels). Not thread-safe: the Cache's thread calls it.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "oasiskv/config.hpp"
#include "oasiskv/hook_arguments.hpp"  // AppendEntry

namespace oasiskv {
inline namespace v0 {

inline constexpr std::int32_t kNoHostBlock = -1;
// A block of a sequence admitted from another process that stays there (remote_blocks.hpp): the
// map holds it, the pool does not. Only full blocks before the sequence's recent ring are remote,
// so no append, truncate or copy on write ever writes one.
inline constexpr std::int32_t kRemoteBlock = -2;

// One change of the block map: (slot, block) moved from pool block `from` (kNoHostBlock: it was
// unmapped) to `to`. A copy on write has from != kNoHostBlock: `to` must receive from's rows.
struct BlockRemap {
  int slot = 0;
  std::int64_t block = 0;
  std::int32_t from = kNoHostBlock;
  std::int32_t to = kNoHostBlock;
};

class HostBlockPool {
 public:
  explicit HostBlockPool(const CacheLayout& layout);

  std::int64_t capacity() const noexcept { return static_cast<std::int64_t>(refs_.size()); }
  std::int64_t free_blocks() const noexcept { return static_cast<std::int64_t>(free_.size()); }
  std::int64_t blocks_in_use() const noexcept { return capacity() - free_blocks(); }
  std::int32_t refcount(std::int32_t pool_block) const noexcept { return refs_[static_cast<std::size_t>(pool_block)]; }

  // Pool block of (slot, logical block), or kNoHostBlock. Mapped blocks of a slot are a prefix.
  std::int32_t at(int slot, std::int64_t block) const noexcept {
    return block < mapped_[static_cast<std::size_t>(slot)] ? map_[index(slot, block)] : kNoHostBlock;
  }
  std::int64_t mapped_blocks(int slot) const noexcept { return mapped_[static_cast<std::size_t>(slot)]; }
  // One past the slot's last remote block (0: none).
  std::int64_t remote_end(int slot) const noexcept;
  // The whole map, [max_sequences][max_blocks] (entries past a slot's mapped prefix are stale).
  std::span<const std::int32_t> map() const noexcept { return map_; }

  // Fresh pool blocks an append of `entries` takes: its unmapped blocks and its copies on write.
  std::int64_t blocks_needed(std::span<const AppendEntry> entries) const;
  // Of those, the copies on write: a shared block written by w sequences of the append, held by
  // r, takes min(w, r - 1) copies (the last writer then holds it alone and writes it in place).
  std::int64_t copies_on_write(std::span<const AppendEntry> entries) const;
  // Maps every block the entries write, appending the changes to `changes` (the caller checked
  // blocks_needed against free_blocks; a copy on write leaves its rows to the caller).
  void map_for_append(std::span<const AppendEntry> entries, std::vector<BlockRemap>& changes);
  // Maps the slot's next logical block: to kRemoteBlock, or to a fresh pool block (returned; the
  // caller checked free_blocks). An admission builds a sequence's map this way.
  std::int32_t map_next(int slot, bool remote);
  // dst (which holds no block) maps its first `blocks` blocks to src's, one reference more each.
  void share(int src, int dst, std::int64_t blocks);
  // Unmaps the slot's blocks from `first` on; a block no one else holds returns to the pool.
  void release_from(int slot, std::int64_t first);
  // Undoes map_for_append's changes (newest first): an append that never ran (an abandoned
  // CUDA graph capture).
  void undo(std::span<const BlockRemap> changes);

 private:
  std::size_t index(int slot, std::int64_t block) const noexcept {
    return static_cast<std::size_t>(static_cast<std::int64_t>(slot) * max_blocks_ + block);
  }
  std::int32_t take();
  void drop(std::int32_t pool_block);

  std::int64_t block_tokens_ = 0;
  std::int64_t max_blocks_ = 0;
  std::vector<std::int32_t> map_;
  std::vector<std::int64_t> mapped_;  // per slot
  std::vector<std::int32_t> refs_;    // per pool block
  std::vector<std::int32_t> free_;    // a stack: the lowest id on top at first
};

}  // namespace v0
}  // namespace oasiskv
