// PrefetchPipeline: runs the copies of transfer plans in the background and orders them against
// attention. CPU backend: one worker thread.
//
// Ordering rule. Plans of one (sequence, layer) are numbered 0, 1, 2, ... Plan j overwrites slots
// that attention over plan j-1's residency may still read, so its copies start only once every
// older plan of that (sequence, layer) is retired: released after attention, superseded by the
// acquire of a newer plan, or dropped with its sequence. Each (sequence, layer) plan is gated on
// its own: a ticket spans several sequences, and one sequence's unreleased plan must not hold back
// another's copies.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "oasiskv/backend.hpp"

namespace oasiskv {
inline namespace v0 {

struct BlockCopy {
  const void* src = nullptr;
  void* dst = nullptr;
  std::size_t bytes = 0;
};

// The copies of one plan of one (sequence, layer).
struct PlanCopies {
  int seq_slot = 0;
  std::uint32_t generation = 0;
  int layer = 0;
  std::int64_t plan_index = 0;
  std::vector<BlockCopy> copies;
};

template <class Backend>
class PrefetchPipeline;

template <>
class PrefetchPipeline<cpu> {
 public:
  PrefetchPipeline(int max_sequences, int num_layers);
  ~PrefetchPipeline();
  PrefetchPipeline(const PrefetchPipeline&) = delete;
  PrefetchPipeline& operator=(const PrefetchPipeline&) = delete;

  // Queues the copies of one ticket (one prefetch call), in order after earlier tickets.
  void submit(std::uint64_t ticket, std::vector<PlanCopies> plans);
  // Blocks until the ticket's copies are done (or dropped); returns the nanoseconds waited.
  std::int64_t wait(std::uint64_t ticket);
  // Plans of (seq_slot, layer) numbered <= plan_index will not be read again.
  void retire(int seq_slot, int layer, std::int64_t plan_index);
  // seq_slot now has `generation` (a sequence was added or removed). Pending copies for other
  // generations are dropped; returns after any copy in progress has finished.
  void reset_sequence(int seq_slot, std::uint32_t generation);
  // Tickets queued or running.
  std::size_t in_flight() const;

 private:
  struct Job {
    std::uint64_t ticket = 0;
    PlanCopies plan;
  };
  bool runnable(const Job& job) const;
  bool stale(const PlanCopies& p) const;
  void run();

  int num_layers_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Job> pending_;
  std::optional<std::uint64_t> running_;
  std::vector<std::uint32_t> generation_;  // per sequence slot
  std::vector<std::int64_t> retired_;      // per (sequence slot, layer): highest retired plan
  bool stop_ = false;
  std::thread worker_;
};

}  // namespace v0
}  // namespace oasiskv
