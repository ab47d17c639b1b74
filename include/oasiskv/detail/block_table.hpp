// BlockTable: the host bookkeeping of the Cache, the same for every backend. Per sequence slot its
// id, generation and, per layer, its length, plan numbers and the first plan since its resident
// set was last empty. Residency itself (which block each slot holds) belongs to the backend
// engine: on the host for the CPU, on the device for CUDA.
#pragma once

#include <algorithm>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "oasiskv/config.hpp"
#include "oasiskv/view.hpp"

namespace oasiskv {
inline namespace v0 {

class BlockTable {
 public:
  explicit BlockTable(const CacheLayout& layout)
      : layers_(layout.config.shape.num_layers),
        ids_(static_cast<std::size_t>(layout.config.max_sequences), 0),
        generation_(static_cast<std::size_t>(layout.config.max_sequences), 0),
        version_(static_cast<std::size_t>(layout.config.max_sequences), 0),
        active_(static_cast<std::size_t>(layout.config.max_sequences), 0),
        length_(per_layer_size(layout), 0),
        next_plan_(per_layer_size(layout), 0),
        acquired_plan_(per_layer_size(layout), -1),
        first_plan_(per_layer_size(layout), 0) {
    for (int s = layout.config.max_sequences - 1; s >= 0; --s) free_.push_back(s);
  }

  // Slot of a live sequence, or -1.
  int find(SeqId id) const noexcept {
    const auto it = slot_of_.find(id);
    return it == slot_of_.end() ? -1 : it->second;
  }
  std::size_t free_slots() const noexcept { return free_.size(); }
  std::size_t num_sequences() const noexcept { return slot_of_.size(); }
  // Generation the next add or remove will give a slot (unique in the process).
  static std::uint32_t next_generation() noexcept;

  // Takes the lowest free slot; the sequence gets a generation never used before.
  int add(SeqId id) {
    const int s = free_.back();
    free_.pop_back();
    slot_of_.emplace(id, s);
    ids_[idx(s)] = id;
    generation_[idx(s)] = next_generation();
    version_[idx(s)] = generation_[idx(s)];
    active_[idx(s)] = 1;
    return s;
  }

  // Frees the slot and clears its state; returns the slot's new generation (no sequence has it).
  std::uint32_t remove(int s) {
    slot_of_.erase(ids_[idx(s)]);
    active_[idx(s)] = 0;
    generation_[idx(s)] = next_generation();
    version_[idx(s)] = generation_[idx(s)];
    const auto L = static_cast<std::ptrdiff_t>(layers_);
    const auto at = static_cast<std::ptrdiff_t>(idx(s)) * L;
    std::fill_n(length_.begin() + at, L, 0);
    std::fill_n(next_plan_.begin() + at, L, 0);
    std::fill_n(acquired_plan_.begin() + at, L, -1);
    std::fill_n(first_plan_.begin() + at, L, 0);
    free_.push_back(s);
    std::sort(free_.rbegin(), free_.rend());
    return generation_[idx(s)];
  }

  SeqId id(int s) const noexcept { return ids_[idx(s)]; }
  // The slot's incarnation: changes when a sequence is added or removed.
  std::uint32_t generation(int s) const noexcept { return generation_[idx(s)]; }
  // The sequence's version: its generation, or newer after a truncate. Tickets carry it.
  std::uint32_t version(int s) const noexcept { return version_[idx(s)]; }
  void truncated(int s) noexcept { version_[idx(s)] = next_generation(); }
  bool alive(int s, std::uint32_t generation) const noexcept {
    return active_[idx(s)] != 0 && generation_[idx(s)] == generation;
  }
  // Slots of the live sequences, ascending.
  std::vector<int> live_slots() const {
    std::vector<int> out;
    for (std::size_t s = 0; s < active_.size(); ++s) {
      if (active_[s] != 0) out.push_back(static_cast<int>(s));
    }
    return out;
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
  // The first plan made since the (sequence, layer)'s resident set was empty: it is not capped.
  std::int64_t first_plan(int s, int layer) const noexcept { return first_plan_[li(s, layer)]; }
  void set_first_plan(int s, int layer, std::int64_t p) noexcept { first_plan_[li(s, layer)] = p; }

 private:
  static std::size_t per_layer_size(const CacheLayout& l) {
    return static_cast<std::size_t>(l.config.max_sequences) * static_cast<std::size_t>(l.config.shape.num_layers);
  }
  static std::size_t idx(int s) noexcept { return static_cast<std::size_t>(s); }
  std::size_t li(int s, int layer) const noexcept {
    return idx(s) * static_cast<std::size_t>(layers_) + static_cast<std::size_t>(layer);
  }

  int layers_;
  std::vector<SeqId> ids_;
  std::vector<std::uint32_t> generation_, version_;
  std::vector<char> active_;
  std::vector<std::int64_t> length_, next_plan_, acquired_plan_, first_plan_;
  std::unordered_map<SeqId, int> slot_of_;
  std::vector<int> free_;
};

}  // namespace v0
}  // namespace oasiskv
