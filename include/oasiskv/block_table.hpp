// BlockTable: per sequence slot its id, generation and length per layer; per (sequence, layer,
// kv head) the planned residency of the selectable slots. Plain arrays, so a device backend can
// mirror them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "oasiskv/attention.hpp"
#include "oasiskv/config.hpp"
#include "oasiskv/transfer_plan.hpp"

namespace oasiskv {
inline namespace v0 {

class BlockTable {
 public:
  explicit BlockTable(const CacheLayout& layout)
      : layers_(layout.config.shape.num_layers),
        heads_(layout.config.shape.num_kv_heads),
        selectable_(layout.selectable_blocks),
        ids_(static_cast<std::size_t>(layout.config.max_sequences), 0),
        generation_(static_cast<std::size_t>(layout.config.max_sequences), 0),
        active_(static_cast<std::size_t>(layout.config.max_sequences), 0),
        length_(per_layer_size(layout), 0),
        next_plan_(per_layer_size(layout), 0),
        acquired_plan_(per_layer_size(layout), -1),
        block_(per_head_size(layout) * static_cast<std::size_t>(selectable_), kNoBlock),
        last_selected_(per_head_size(layout) * static_cast<std::size_t>(selectable_), -1) {
    for (int s = layout.config.max_sequences - 1; s >= 0; --s) free_.push_back(s);
  }

  // Slot of a live sequence, or -1.
  int find(SeqId id) const noexcept {
    const auto it = slot_of_.find(id);
    return it == slot_of_.end() ? -1 : it->second;
  }
  std::size_t free_slots() const noexcept { return free_.size(); }
  std::size_t num_sequences() const noexcept { return slot_of_.size(); }

  // Takes the lowest free slot; the sequence gets a generation never used before.
  int add(SeqId id) {
    const int s = free_.back();
    free_.pop_back();
    slot_of_.emplace(id, s);
    ids_[idx(s)] = id;
    generation_[idx(s)] = ++last_generation_;
    active_[idx(s)] = 1;
    return s;
  }

  // Frees the slot and clears its state; returns the slot's new generation (no sequence has it).
  std::uint32_t remove(int s) {
    slot_of_.erase(ids_[idx(s)]);
    active_[idx(s)] = 0;
    generation_[idx(s)] = ++last_generation_;
    const auto L = static_cast<std::size_t>(layers_);
    std::fill_n(length_.begin() + static_cast<std::ptrdiff_t>(idx(s) * L), L, 0);
    std::fill_n(next_plan_.begin() + static_cast<std::ptrdiff_t>(idx(s) * L), L, 0);
    std::fill_n(acquired_plan_.begin() + static_cast<std::ptrdiff_t>(idx(s) * L), L, -1);
    const std::size_t n = L * static_cast<std::size_t>(heads_) * static_cast<std::size_t>(selectable_);
    std::fill_n(block_.begin() + static_cast<std::ptrdiff_t>(idx(s) * n), n, kNoBlock);
    std::fill_n(last_selected_.begin() + static_cast<std::ptrdiff_t>(idx(s) * n), n, -1);
    free_.push_back(s);
    std::sort(free_.rbegin(), free_.rend());
    return generation_[idx(s)];
  }

  SeqId id(int s) const noexcept { return ids_[idx(s)]; }
  std::uint32_t generation(int s) const noexcept { return generation_[idx(s)]; }
  bool alive(int s, std::uint32_t generation) const noexcept {
    return active_[idx(s)] != 0 && generation_[idx(s)] == generation;
  }

  std::int64_t length(int s, int layer) const noexcept { return length_[li(s, layer)]; }
  void set_length(int s, int layer, std::int64_t n) noexcept { length_[li(s, layer)] = n; }

  // Plans of one (sequence, layer) are numbered from 0; the number is also the "step" that
  // least-recently-selected eviction compares.
  std::int64_t next_plan(int s, int layer) const noexcept { return next_plan_[li(s, layer)]; }
  void advance_plan(int s, int layer) noexcept { ++next_plan_[li(s, layer)]; }
  // Highest plan served by acquire, or -1.
  std::int64_t acquired_plan(int s, int layer) const noexcept { return acquired_plan_[li(s, layer)]; }
  void set_acquired_plan(int s, int layer, std::int64_t p) noexcept { acquired_plan_[li(s, layer)] = p; }

  // Residency of the selectable slots after every plan made so far (copies may be pending).
  SlotResidency planned(int s, int layer, int kv_head) noexcept {
    const std::size_t off = hi(s, layer, kv_head) * static_cast<std::size_t>(selectable_);
    return SlotResidency{std::span(block_).subspan(off, static_cast<std::size_t>(selectable_)),
                         std::span(last_selected_).subspan(off, static_cast<std::size_t>(selectable_))};
  }
  std::span<const std::int32_t> planned_blocks(int s, int layer, int kv_head) const noexcept {
    const std::size_t off = hi(s, layer, kv_head) * static_cast<std::size_t>(selectable_);
    return std::span(block_).subspan(off, static_cast<std::size_t>(selectable_));
  }

 private:
  static std::size_t per_layer_size(const CacheLayout& l) {
    return static_cast<std::size_t>(l.config.max_sequences) * static_cast<std::size_t>(l.config.shape.num_layers);
  }
  static std::size_t per_head_size(const CacheLayout& l) {
    return per_layer_size(l) * static_cast<std::size_t>(l.config.shape.num_kv_heads);
  }
  static std::size_t idx(int s) noexcept { return static_cast<std::size_t>(s); }
  std::size_t li(int s, int layer) const noexcept {
    return idx(s) * static_cast<std::size_t>(layers_) + static_cast<std::size_t>(layer);
  }
  std::size_t hi(int s, int layer, int h) const noexcept {
    return li(s, layer) * static_cast<std::size_t>(heads_) + static_cast<std::size_t>(h);
  }

  int layers_, heads_, selectable_;
  std::vector<SeqId> ids_;
  std::vector<std::uint32_t> generation_;
  std::vector<char> active_;
  std::vector<std::int64_t> length_, next_plan_, acquired_plan_;
  std::vector<std::int32_t> block_;
  std::vector<std::int64_t> last_selected_;
  std::unordered_map<SeqId, int> slot_of_;
  std::vector<int> free_;
  std::uint32_t last_generation_ = 0;
};

}  // namespace v0
}  // namespace oasiskv
