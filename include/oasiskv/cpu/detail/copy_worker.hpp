// CopyWorker: the CPU backend's copy engine, one worker thread that runs block copies in the
// order they were submitted, or (threaded = false) none: then submit runs them in the calling
// thread (and the engine's pool, when it lends one) before it returns. It does not decide when copies may start: the
// Cache's plan gate does (a plan's copies are submitted once every older plan of its (sequence, layer) is retired), so
// the worker only keeps submission order and drops the copies of removed sequences.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include <memory>
#include <string>

#include "oasiskv/cpu/parallel_for.hpp"
#include "oasiskv/kit/block_copy.hpp"
#include "oasiskv/remote_blocks.hpp"

namespace oasiskv {
inline namespace v0 {

// The copies of one plan of one (sequence, layer): local ones, then reads from the sequence's
// remote source (an admitted sequence's prompt blocks).
struct PlanCopies {
  int seq_slot = 0;
  int layer = 0;
  std::uint32_t generation = 0;
  std::vector<BlockCopy> copies;
  std::shared_ptr<RemoteBlockSource> source;
  std::vector<RemoteBlockRead> remote;
};

class CopyWorker {
 public:
  // parallel_for (the engine's pool) splits the copies that run in the calling thread (threaded
  // false); the worker thread never uses it.
  CopyWorker(int max_sequences, int layers, bool threaded, ParallelFor parallel_for = {});
  ~CopyWorker();
  CopyWorker(const CopyWorker&) = delete;
  CopyWorker& operator=(const CopyWorker&) = delete;

  // Queues the copies of (part of) one ticket, after everything submitted before.
  void submit(std::uint64_t ticket, std::vector<PlanCopies> plans);
  // Blocks until the ticket's copies submitted so far are done (or dropped); returns the
  // nanoseconds waited.
  std::int64_t wait(std::uint64_t ticket);
  // seq_slot now has `generation` (a sequence was added or removed): queued copies of other
  // generations are dropped; returns after a copy in progress has finished.
  void reset_sequence(int seq_slot, std::uint32_t generation);
  // Blocks until every queued copy is done.
  void drain();
  // Plans queued or running.
  std::size_t in_flight() const;
  // Why a remote read of seq_slot's current generation failed, or empty. A failed sequence's later
  // reads are skipped (its slots keep what they held); a new generation starts clean.
  std::string failure(int seq_slot) const;
  // Nanoseconds spent copying the plans of `layer` so far (Statistics: copy_ns).
  std::int64_t busy_ns(int layer) const noexcept;
  void reset_busy() noexcept;

 private:
  struct Job {
    std::uint64_t ticket = 0;
    PlanCopies plan;
  };
  void run();
  // Runs one job's copies and reads (the worker's lock not held); records a remote failure.
  void execute(Job& job, std::unique_lock<std::mutex>& lock);

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Job> pending_;
  std::optional<std::uint64_t> running_;
  std::vector<std::uint32_t> generation_;  // per sequence slot
  std::vector<std::string> failure_;       // per sequence slot, of its current generation
  bool stop_ = false;
  std::unique_ptr<std::atomic<std::int64_t>[]> busy_;  // per layer
  int layers_ = 0;
  ParallelFor parallel_for_;
  std::thread worker_;  // not started when the copies run in the caller
};

}  // namespace v0
}  // namespace oasiskv
