// HostTier: every row of every sequence (the source of truth), a pool of blocks. SlotPool: the resident working
// set (ordinary memory on the CPU backend, HBM on the CUDA backend). MemoryReservation: the CPU
// backend's memory for both.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>

#include "oasiskv/config.hpp"
#include "oasiskv/dtype.hpp"
#include "oasiskv/kit/host_block_pool.hpp"

namespace oasiskv {
inline namespace v0 {

// Zero-filled address space reserved up front and committed by the OS page by page on first
// touch, so capacity for long sequences costs nothing until rows arrive, and addresses never
// move (the copy engine reads blocks while the engine appends to other blocks).
class MemoryReservation {
 public:
  MemoryReservation() = default;
  explicit MemoryReservation(std::size_t bytes);  // throws oasiskv::Error when the OS refuses
  ~MemoryReservation();
  MemoryReservation(MemoryReservation&& other) noexcept;
  MemoryReservation& operator=(MemoryReservation&& other) noexcept;
  MemoryReservation(const MemoryReservation&) = delete;
  MemoryReservation& operator=(const MemoryReservation&) = delete;

  std::byte* data() const noexcept { return data_; }
  std::size_t bytes() const noexcept { return bytes_; }

 private:
  std::byte* data_ = nullptr;
  std::size_t bytes_ = 0;
};

// The host tier: every row of every sequence, the source of truth, as a pool of blocks
// (HostBlockPool: the block map, reference counts, the free list). A pool block is
// [layer][kv head][K|V][block_tokens][head_dim] (CacheLayout::host_block_offset), so one block of
// one (layer, kv head) is one contiguous copy. Memory: MemoryReservation on the CPU backend (pages
// are committed on first touch), a pinned region on CUDA; anything with data() (std::byte*) and
// bytes(). The owning engine changes the map (pool()); readers go through block/key/value.
template <KvElement T, class Memory = MemoryReservation>
class HostTier {
 public:
  HostTier(const CacheLayout& layout, Memory memory) : layout_(layout), memory_(std::move(memory)), pool_(layout) {}
  // Bytes the tier needs for `layout` (checked: CacheLayout::from bounded the element count).
  static std::size_t bytes_for(const CacheLayout& layout) noexcept {
    return static_cast<std::size_t>(layout.host_tier_elements) * sizeof(T);
  }

  // Start of one (layer, kv head) block of pool block p: K rows, then V rows at + block_tokens * head_dim.
  T* pool_block(std::int32_t p, int layer, int kv_head) const noexcept {
    return base() + layout_.host_block_offset(p, layer, kv_head);
  }
  // Start of logical block `block` of a sequence (it must be mapped: block < its blocks held).
  T* block(int seq_slot, int layer, int kv_head, std::int64_t block) const noexcept {
    return pool_block(pool_.at(seq_slot, block), layer, kv_head);
  }
  // Key (value) row `token` of a sequence.
  const T* key(int seq_slot, int layer, int kv_head, std::int64_t token) const noexcept {
    const std::int64_t bt = layout_.config.block_tokens;
    return block(seq_slot, layer, kv_head, token / bt) + (token % bt) * layout_.config.shape.head_dim;
  }
  const T* value(int seq_slot, int layer, int kv_head, std::int64_t token) const noexcept {
    return key(seq_slot, layer, kv_head, token) +
           static_cast<std::int64_t>(layout_.config.block_tokens) * layout_.config.shape.head_dim;
  }
  T* base() const noexcept { return reinterpret_cast<T*>(memory_.data()); }
  const Memory& memory() const noexcept { return memory_; }
  std::size_t bytes_reserved() const noexcept { return memory_.bytes(); }
  // Bytes of one pool block, and of the blocks held now.
  std::size_t pool_block_bytes() const noexcept {
    return static_cast<std::size_t>(layout_.pool_block_elems) * sizeof(T);
  }
  std::size_t bytes_in_use() const noexcept {
    return static_cast<std::size_t>(pool_.blocks_in_use()) * pool_block_bytes();
  }

  const HostBlockPool& pool() const noexcept { return pool_; }
  HostBlockPool& pool() noexcept { return pool_; }

 private:
  CacheLayout layout_;
  Memory memory_;
  HostBlockPool pool_;
};

// The slot pool: the resident working set (host memory on the CPU backend, HBM on CUDA). Each
// (sequence slot, layer, kv head) owns budget_blocks consecutive slots (its own budget with a
// BudgetProfile), so no allocator runs in
// the decode step. One slot is one block: K then V, [block_tokens][head_dim]. Layer pools are
// separate so a LayerView is a base pointer plus slot ids, as in a paged KV cache.
template <KvElement T, class Memory = MemoryReservation>
class SlotPool {
 public:
  SlotPool(const CacheLayout& layout, Memory memory) : layout_(layout), memory_(std::move(memory)) {}
  static std::size_t bytes_for(const CacheLayout& layout) noexcept {
    return static_cast<std::size_t>(layout.total_slots()) * static_cast<std::size_t>(layout.block_elems) * sizeof(T);
  }

  // With a budget profile the layers' pools differ in size (CacheLayout::layer_slots).
  T* layer_pool(int layer) const noexcept {
    return reinterpret_cast<T*>(memory_.data()) + layout_.layer_pool_offset(layer) * layout_.block_elems;
  }
  T* slot(int layer, std::int32_t slot_id) const noexcept {
    return layer_pool(layer) + static_cast<std::int64_t>(slot_id) * layout_.block_elems;
  }
  std::size_t bytes_reserved() const noexcept { return memory_.bytes(); }

 private:
  CacheLayout layout_;
  Memory memory_;
};

}  // namespace v0
}  // namespace oasiskv
