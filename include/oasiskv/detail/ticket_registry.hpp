// The Cache's tickets and plan gate, the same for every backend.
//
// Gate. Plans of one (sequence, layer) are numbered 0, 1, 2, ... Plan j overwrites slots that
// attention over plan j-1's residency may still read, so its copies start only once every older
// plan of that (sequence, layer) is retired: released after attention, superseded by the acquire
// of a newer plan, or dropped with its sequence. Each (sequence, layer) plan is gated on its own:
// a ticket spans several sequences, and one sequence's unreleased plan must not hold back
// another's copies (a per-ticket gate let copies overtake each other, and can deadlock).
//
// Registry. A ticket is live while it can still be acquired. A dead ticket (released, stale or
// superseded) stays registered until each of its plans has started its copies or been dropped:
// later plans were made against the residency these copies produce, so they must still land.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <vector>

#include "oasiskv/detail/block_table.hpp"

namespace oasiskv {
inline namespace v0 {
namespace detail {

enum class PlanState : std::uint8_t { pending, started, dropped };

// One sequence's plan inside a ticket.
struct TicketPlan {
  int slot = 0;
  std::uint32_t generation = 0;  // the slot's incarnation (BlockTable::generation)
  std::uint32_t version = 0;     // the sequence's version (changes on truncate)
  std::int64_t plan_index = 0;
  PlanState state = PlanState::pending;
};

template <class EnginePlan>
struct TicketRecord {
  int layer = 0;
  bool live = true;
  std::vector<TicketPlan> plans;
  EnginePlan engine_plan;
  bool drained() const noexcept {
    return std::none_of(plans.begin(), plans.end(), [](const TicketPlan& p) { return p.state == PlanState::pending; });
  }
};

// Per (sequence slot, layer): the highest retired plan.
class PlanGate {
 public:
  PlanGate(int max_sequences, int num_layers)
      : layers_(num_layers),
        retired_(static_cast<std::size_t>(max_sequences) * static_cast<std::size_t>(num_layers), -1) {}
  void retire(int slot, int layer, std::int64_t plan) noexcept {
    auto& r = retired_[at(slot, layer)];
    r = std::max(r, plan);
  }
  bool open(int slot, int layer, std::int64_t plan) const noexcept { return plan <= retired_[at(slot, layer)] + 1; }
  void reset(int slot) noexcept {
    for (int l = 0; l < layers_; ++l) retired_[at(slot, l)] = -1;
  }

 private:
  std::size_t at(int slot, int layer) const noexcept {
    return static_cast<std::size_t>(slot) * static_cast<std::size_t>(layers_) + static_cast<std::size_t>(layer);
  }
  int layers_;
  std::vector<std::int64_t> retired_;
};

}  // namespace detail
}  // namespace v0
}  // namespace oasiskv
