// HostTier: every row of every sequence (the source of truth). DeviceTier: the slot pool that
// holds the resident working set (ordinary memory on the CPU backend, HBM on the CUDA backend).
#pragma once

#include <cstddef>
#include <cstdint>

#include "oasiskv/backend.hpp"
#include "oasiskv/config.hpp"
#include "oasiskv/dtype.hpp"

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

// Host layout, block-major so one block of one kv head is one contiguous copy:
// [sequence slot][layer][kv head][block][K|V][block_tokens][head_dim].
template <KvElement T>
class HostTier {
 public:
  explicit HostTier(const CacheLayout& layout)
      : layout_(layout),
        memory_(static_cast<std::size_t>(layout.host_tier_elements()) * sizeof(T)) {}

  // Start of one block: K rows, then V rows at + block_tokens * head_dim.
  T* block(int seq_slot, int layer, int kv_head, std::int64_t block) noexcept {
    return base() + layout_.host_block_offset(seq_slot, layer, kv_head, block);
  }
  const T* block(int seq_slot, int layer, int kv_head, std::int64_t block) const noexcept {
    return const_cast<HostTier*>(this)->block(seq_slot, layer, kv_head, block);
  }
  // Key (value) row `token` of a sequence.
  const T* key(int seq_slot, int layer, int kv_head, std::int64_t token) const noexcept {
    const std::int64_t bt = layout_.config.block_tokens;
    return block(seq_slot, layer, kv_head, token / bt) + (token % bt) * layout_.config.shape.head_dim;
  }
  const T* value(int seq_slot, int layer, int kv_head, std::int64_t token) const noexcept {
    const std::int64_t bt = layout_.config.block_tokens;
    return key(seq_slot, layer, kv_head, token) + bt * layout_.config.shape.head_dim;
  }
  std::size_t bytes_reserved() const noexcept { return memory_.bytes(); }

 private:
  T* base() const noexcept { return reinterpret_cast<T*>(memory_.data()); }

  CacheLayout layout_;
  MemoryReservation memory_;
};

// The slot pool. Each (sequence slot, layer, kv head) owns budget_blocks consecutive slots, so
// no allocator runs in the decode step. One slot is one block: K then V, [block_tokens][head_dim].
// Layer pools are separate so a LayerView is a base pointer plus slot ids, as in a paged KV cache.
template <class Backend, KvElement T>
class DeviceTier;

template <KvElement T>
class DeviceTier<cpu, T> {
 public:
  explicit DeviceTier(const CacheLayout& layout)
      : layout_(layout),
        slots_per_layer_(static_cast<std::int64_t>(layout.config.max_sequences) *
                         layout.config.shape.num_kv_heads * layout.budget_blocks),
        memory_(static_cast<std::size_t>(layout.config.shape.num_layers) *
                static_cast<std::size_t>(slots_per_layer_) *
                static_cast<std::size_t>(layout.block_elems) * sizeof(T)) {}

  // Slot id within its layer's pool.
  std::int32_t slot_id(int seq_slot, int kv_head, int local_slot) const noexcept {
    return static_cast<std::int32_t>(
        (static_cast<std::int64_t>(seq_slot) * layout_.config.shape.num_kv_heads + kv_head) *
            layout_.budget_blocks +
        local_slot);
  }
  T* layer_pool(int layer) const noexcept {
    return reinterpret_cast<T*>(memory_.data()) + layer * slots_per_layer_ * layout_.block_elems;
  }
  T* slot(int layer, std::int32_t slot_id) const noexcept {
    return layer_pool(layer) + static_cast<std::int64_t>(slot_id) * layout_.block_elems;
  }
  std::int64_t slots_per_layer() const noexcept { return slots_per_layer_; }
  std::size_t bytes_reserved() const noexcept { return memory_.bytes(); }

 private:
  CacheLayout layout_;
  std::int64_t slots_per_layer_;
  MemoryReservation memory_;
};

}  // namespace v0
}  // namespace oasiskv
