// TransferPlan: the difference between the blocks selected for the next step and the blocks
// resident in one (sequence, layer, kv head)'s selectable slots.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

namespace oasiskv {
inline namespace v0 {

inline constexpr std::int32_t kNoBlock = -1;

// The selectable slots of one (sequence, layer, kv head): which logical block each holds
// (kNoBlock when free) and the step at which it was last selected.
struct SlotResidency {
  std::span<std::int32_t> block;
  std::span<std::int64_t> last_selected;
};

struct Admit {
  std::int32_t block = kNoBlock;    // logical block to copy in
  std::int32_t slot = 0;            // selectable slot it goes to
  std::int32_t evicted = kNoBlock;  // block it replaces, or kNoBlock for a free slot
};

struct TransferPlan {
  std::int64_t step = 0;
  std::vector<Admit> admits;             // highest score first
  std::vector<std::int32_t> kept_slots;  // selected and already resident: refreshed, not copied
  std::int32_t capped = 0;               // selected, not resident, over the fetch cap
};

// Builds plans; holds scratch so that the decode step does not allocate once warm.
class TransferPlanner {
 public:
  // `selected`: the selected blocks, best first, no duplicates. Rules: admits are the selected
  // blocks not resident, in selection order, at most `fetch_cap`; each takes the lowest free
  // slot, then the slot of the least-recently-selected resident block that is not selected
  // (ties: lower block index). O(S + K + V log V) for S selectable slots, K selected blocks and V
  // victims: a block -> slot table (scratch, as large as the largest block index seen) finds
  // the resident ones.
  void plan(std::span<const std::int32_t> selected, const SlotResidency& residency, int fetch_cap, std::int64_t step,
            TransferPlan& out) {
    out.step = step;
    out.admits.clear();
    out.kept_slots.clear();
    out.capped = 0;
    const auto slots = static_cast<std::int32_t>(residency.block.size());

    // slot_of_[block]: the slot holding it + 1, 0 when it is not resident; cleared again below.
    for (std::int32_t j = 0; j < slots; ++j) {
      const std::int32_t b = residency.block[j];
      if (b == kNoBlock) continue;
      if (static_cast<std::size_t>(b) >= slot_of_.size()) slot_of_.resize(static_cast<std::size_t>(b) + 1, 0);
      slot_of_[static_cast<std::size_t>(b)] = j + 1;
    }
    chosen_.assign(static_cast<std::size_t>(slots), 0);

    missing_.clear();
    for (std::int32_t b : selected) {
      const std::int32_t at = static_cast<std::size_t>(b) < slot_of_.size() ? slot_of_[static_cast<std::size_t>(b)] : 0;
      if (at != 0) {
        out.kept_slots.push_back(at - 1);
        chosen_[static_cast<std::size_t>(at - 1)] = 1;
      } else {
        missing_.push_back(b);
      }
    }
    for (std::int32_t j = 0; j < slots; ++j) {
      if (residency.block[j] != kNoBlock) slot_of_[static_cast<std::size_t>(residency.block[j])] = 0;
    }

    // Free slots first (ascending), then victims, least recently selected first.
    targets_.clear();
    for (std::int32_t j = 0; j < slots; ++j) {
      if (residency.block[j] == kNoBlock) targets_.push_back(j);
    }
    const std::size_t free_count = targets_.size();
    for (std::int32_t j = 0; j < slots; ++j) {
      if (residency.block[j] != kNoBlock && !chosen_[static_cast<std::size_t>(j)]) {
        targets_.push_back(j);
      }
    }
    std::sort(targets_.begin() + static_cast<std::ptrdiff_t>(free_count), targets_.end(),
              [&](std::int32_t a, std::int32_t b) {
                const auto la = residency.last_selected[a], lb = residency.last_selected[b];
                return la < lb || (la == lb && residency.block[a] < residency.block[b]);
              });

    const std::size_t n =
        std::min({missing_.size(), targets_.size(), static_cast<std::size_t>(std::max(fetch_cap, 0))});
    for (std::size_t i = 0; i < n; ++i) {
      out.admits.push_back(Admit{missing_[i], targets_[i], residency.block[targets_[i]]});
    }
    out.capped = static_cast<std::int32_t>(missing_.size() - n);
  }

 private:
  std::vector<std::int32_t> slot_of_;  // [block]: slot + 1 while plan() runs, else 0
  std::vector<char> chosen_;
  std::vector<std::int32_t> missing_;
  std::vector<std::int32_t> targets_;
};

// The residency after the plan's copies: admitted blocks in their slots, every selected block
// stamped with the plan's step.
inline void apply(const TransferPlan& plan, const SlotResidency& residency) {
  for (std::int32_t j : plan.kept_slots) residency.last_selected[j] = plan.step;
  for (const Admit& a : plan.admits) {
    residency.block[a.slot] = a.block;
    residency.last_selected[a.slot] = plan.step;
  }
}

}  // namespace v0
}  // namespace oasiskv
