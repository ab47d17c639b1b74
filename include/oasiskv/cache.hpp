// Cache<Backend, T>: the one facade an engine uses, for every backend. Sequence lifecycle, append,
// prefetch, acquire / attend / release, statistics. Calls come from one engine thread.
//
// Per layer and decode step:
//   cache.append(batch, l, k, v);                  // current rows -> host tier + pinned slots
//   Ticket next = cache.prefetch(batch, l, q_la);  // plan step t+1 from the lookahead queries
//   LayerView view = cache.acquire(previous[l]);   // residency planned in step t-1
//   attention(view, q, out);                       // the engine's kernel
//   cache.release(previous[l]); previous[l] = next;
//
// The Cache holds everything that does not depend on the backend (this file, detail/cache_impl.hpp
// and detail/cache_sequence_ops.hpp); its backend engine (cpu/engine.hpp, cuda/engine.hpp) holds
// the memory and does the work, through the hooks of cache_engine.hpp. docs/architecture.md has
// the picture.
//
// Backends. This header includes none: Cache<cpu, T> comes with oasiskv/cpu/cache.hpp (everything
// in host memory, copies on a worker thread), Cache<cuda, T> with oasiskv/cuda/cache.hpp (inputs
// and views in device memory, work on CUDA streams; see that header for its memory and stream
// contract).
//
// Failure. A call refused for bad input throws oasiskv::Error naming the value and changes
// nothing. If the backend itself fails while a call at layer l enqueues its work (a CUDA error),
// layer l is marked failed: every later call at l throws, naming the first failure, until
// recover_layer(l). The host tier never loses a row that an append committed.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "oasiskv/admission.hpp"
#include "oasiskv/backend.hpp"
#include "oasiskv/budget_profile.hpp"
#include "oasiskv/cache_engine.hpp"
#include "oasiskv/config.hpp"
#include "oasiskv/detail/block_table.hpp"
#include "oasiskv/detail/ticket_registry.hpp"
#include "oasiskv/dtype.hpp"
#include "oasiskv/error.hpp"
#include "oasiskv/remote_blocks.hpp"
#include "oasiskv/statistics.hpp"
#include "oasiskv/ticket.hpp"
#include "oasiskv/view.hpp"

namespace oasiskv {
inline namespace v0 {

template <class Backend, KvElement T>
class Cache {
 public:
  using element_type = T;
  using Engine = typename backend_engine<Backend, T>::type;
  using Options = typename Engine::Options;
  static_assert(CacheEngine<Engine>, "the backend engine does not implement the CacheEngine hooks");

  // Validates the config (oasiskv::Error naming the first bad value) and builds the backend.
  explicit Cache(const CacheConfig& config, const Options& options = {});
  // Budgets by (layer, kv head) from `profile` (budget_profile.hpp), validated against the config:
  // the slot pools are packed per (layer, kv head), each head's top-K and fetch cap follow its
  // budget, and the total stays the configured one. A uniform profile is the constructor above.
  // Both backends support every profile (admit too: the message's working set may come from a
  // prefill cache with another budget).
  Cache(const CacheConfig& config, const BudgetProfile& profile, const Options& options = {});

  const CacheLayout& layout() const noexcept { return layout_; }
  // Unique in the process: a Ticket names the cache that issued it.
  std::uint64_t id() const noexcept { return id_; }
  // The host tier (the source of truth): a pool of blocks, with its map in pool(). On CUDA its rows
  // are written by the GPU: synchronise before reading them on the host.
  const typename Engine::HostTier& host_tier() const noexcept { return engine_.host_tier(); }
  // Host bookkeeping: ids, generations, lengths, plan numbers (for inspection and tests).
  const BlockTable& block_table() const noexcept { return table_; }
  // The backend engine, for what only one backend has (CUDA streams, the CPU residency).
  Engine& backend() noexcept { return engine_; }
  const Engine& backend() const noexcept { return engine_; }

  // ---- sequence lifecycle -------------------------------------------------------------------
  void add_sequence(SeqId id);
  // Drops the sequence and its host blocks (those no fork still holds return to the pool); its
  // tickets become stale. Refused while its attention is in flight.
  void remove_sequence(SeqId id);
  // Drops the rows at positions >= length in every layer (a rollback of rejected drafts). The
  // block that becomes partial gets its summary recomputed from its rows, so every summary equals
  // that of a sequence that never had the dropped rows; resident blocks from it on are freed and the
  // recent ring is rebuilt from the host tier; host blocks past the end return to the pool. The sequence's outstanding
  // tickets become stale (their copies still land). Refused while one of its tickets is acquired, and during graph
  // capture. Work: proportional to the rows dropped plus a few blocks per layer and kv head.
  void truncate(SeqId id, std::int64_t length);
  // dst starts as the first `length` tokens of src (default: all of them; src's layers must then
  // have one length). Its full blocks are shared with src (reference counted, never written
  // while shared); the partial block is copied by the first append that writes it. dst gets its
  // own resident set: its first plan is uncapped, like a new sequence's. Takes no pool block, so
  // it cannot exhaust the pool (the copy on write can: append says so). Refused during capture.
  void fork(SeqId src, SeqId dst);
  void fork(SeqId src, SeqId dst, std::int64_t length);
  // Admits a sequence from another process's prefill (prefill-decode disaggregation): `message`
  // (decode_admission) carries its summaries (and, with `remainder = clusters`, the blocks' sums
  // and key clusters; a quantized cache refuses admissions: the message carries no codes), first working
  // set and lookahead queries; its prompt
  // blocks outside the sinks and the recent ring stay in the other process and are read from
  // `source` by the prefetch pipeline's copies (the prefill side's memory is the source of truth
  // for them). Checks the message against this cache (check_admission) and the host pool first:
  // a refusal admits nothing. Then makes the first plan of every layer from the message's
  // queries, its copies served by the working set's rows: returns its tickets, by layer, for the
  // first decode step to acquire. Such a sequence cannot be truncated or forked below its recent
  // ring (those rows are remote). If a remote read fails (the peer gone, a deadline), every later
  // acquire of a ticket holding the sequence throws an Error naming it: remove it; the other
  // sequences go on (prefetch them again). Both backends (on CUDA synchronous: not a decode-path call).
  std::vector<Ticket> admit(SeqId id, const AdmissionMessage& message,
                            std::shared_ptr<RemoteBlockSource> source) requires AdmittingEngine<Engine>;
  bool has_sequence(SeqId id) const noexcept { return table_.find(id) >= 0; }
  std::size_t num_sequences() const noexcept { return table_.num_sequences(); }
  std::int64_t sequence_length(SeqId id, int layer) const;

  // ---- append -------------------------------------------------------------------------------
  // Appends rows_per_seq[i] rows to batch[i] at `layer`. k and v: [total rows][kv_heads][head_dim]
  // of element type T, rows in batch order. Keys as attention uses them (normally after RoPE).
  void append(std::span<const SeqId> batch, int layer, std::span<const std::int32_t> rows_per_seq, RowsView k,
              RowsView v);
  // One row per sequence (a decode step).
  void append(std::span<const SeqId> batch, int layer, RowsView k, RowsView v);

  // ---- prefetch -----------------------------------------------------------------------------
  // Plans the resident set of the next step at `layer` from the lookahead queries
  // q_lookahead: [batch * R][num_q_heads][head_dim] (R >= 1 rows per sequence, in batch order),
  // element type T or float. Scoring, top-K and planning are made now; the copies start once the
  // older plans of these sequences at this layer are retired. next_step_rows: the rows each
  // sequence will append before this plan is acquired (1 for plain decoding, k + 1 to verify k
  // drafts): blocks that leave the recent ring meanwhile are candidates now.
  Ticket prefetch(std::span<const SeqId> batch, int layer, RowsView q_lookahead, std::int64_t next_step_rows = 1);

  // ---- acquire / release --------------------------------------------------------------------
  // Waits for the ticket's copies and returns the resident working set of its sequences at its
  // layer: sinks, the plan's selected blocks, and the recent ring (with this step's rows).
  // Older unacquired tickets of the same sequences and layer are superseded.
  LayerView<T> acquire(const Ticket& ticket);
  // Ends attention over an acquired ticket: its slots may now be overwritten by newer plans.
  void release(const Ticket& ticket);
  // acquire, attention(view), release: the view is released even when attention throws.
  template <class Attention>
  void attend(const Ticket& ticket, Attention&& attention) {
    const LayerView<T> view = acquire(ticket);
    try {
      attention(view);
    } catch (...) {
      release(ticket);
      throw;
    }
    release(ticket);
  }

  // ---- prediction quality -------------------------------------------------------------------
  // With the acquired ticket's sequences and the true queries of this step (same layout as
  // prefetch's), adds to recall statistics: the share of the blocks the selector would pick from
  // the true queries that are resident.
  void observe(const Ticket& ticket, RowsView q_true);
  // The blocks (best first) the selector would pick for `id`'s next step at `layer` from the
  // queries q ([R][num_q_heads][head_dim]), per kv head: the candidates prefetch would rank now.
  // Changes nothing (on CUDA: synchronous, not during graph capture).
  std::vector<std::vector<std::int32_t>> select_blocks(SeqId id, int layer, RowsView q) const;

  // ---- beyond the resident set ----------------------------------------------------------------
  // The estimate (CacheConfig::remainder) of what the acquired ticket's view leaves out: for the
  // true queries q of this step (observe's layout: [batch * R][num_q_heads][head_dim], element
  // type T or float), per (row, query head) the attention state over the blocks of the sequence
  // that the view does not hold (attention_state.hpp): lse[row][g] = log of the estimated
  // sum_t exp(scale q.k_t) over their keys (scale: layout().softmax_scale), out[row][g][:] the
  // estimated attention output over them. Merge it into the state of the attention over the view
  // with merge_state (the engine's kernel must then give the log-sum-exp of its scores at the same
  // scale). When the view holds every block (the budget covers the sequence): lse = -inf, out = 0.
  // out: [batch * R * num_q_heads * head_dim] floats, lse: [batch * R * num_q_heads]; call between
  // acquire and release (or inside attend). Refused when CacheConfig::remainder is none. Work:
  // clusters, per row and query head two head_dim-long passes over each non-resident block's (or
  // cluster's) sums, about 1 / block_tokens of dense attention over those blocks; quantized, the
  // attention over every non-resident row, decoded (O(context), each block decoded once per kv
  // head on the CPU). Both backends. On CUDA, q, out and lse are device memory (the spans only
  // carry pointer and size; pageable host memory is refused): the kernel is enqueued on the compute
  // stream, after the view's build and before what the engine enqueues next (its merge), with no
  // allocation and no host wait, so it can be captured in a CUDA graph like attend.
  void remainder(const Ticket& ticket, RowsView q, std::span<float> out,
                 std::span<float> lse) requires EstimatesRemainder<Engine>;

  // ---- statistics ---------------------------------------------------------------------------
  // On CUDA this synchronises (device counters are read back); not during graph capture.
  const Statistics& statistics() const;
  void reset_statistics();
  // Waits for every copy and kernel the cache queued (not during graph capture).
  void synchronize() { engine_.synchronize(); }
  // CUDA: ends the copy stream's work in the compute stream; call it before
  // cudaStreamBeginCapture and before cudaStreamEndCapture (oasiskv/cuda/cache.hpp).
  void join() requires JoinsStreams<Engine> { engine_.join(); }

  // ---- failures -----------------------------------------------------------------------------
  // The first failure recorded at `layer`, or an empty string.
  const std::string& layer_failure(int layer) const;
  // Makes a failed layer usable again: its tickets are dropped, every sequence's resident set at
  // the layer is emptied (its next plan is uncapped, like a new sequence's) and the failure
  // cleared. Host rows and lengths are untouched. Refused while a ticket is acquired at the layer.
  void recover_layer(int layer);
  // After a failed or discarded CUDA graph capture (the captured calls never ran on the device):
  // lengths go back to before the capture, tickets issued in it are dropped, and every layer it
  // touched is recovered. Throws if no capture is in progress or just ended.
  void abandon_capture();

 private:
  using Record = detail::TicketRecord<typename Engine::Plan>;
  struct Acquired {
    std::uint64_t ticket = 0;
    std::vector<ViewEntry> entries;
  };

  template <class F>
  auto guarded(int layer, const char* call, F&& f) -> decltype(f());
  void check_layer(int layer, const char* call) const;
  void fork_sequence(SeqId src, SeqId dst, std::int64_t length);
  void check_local_rows(int slot, std::int64_t length, const char* call) const;
  void check_remote_reads(std::span<const ViewEntry> entries) const;
  int slot_of(SeqId id, const char* call) const;
  std::vector<int> resolve(std::span<const SeqId> batch, const char* call) const;
  std::int64_t check_query_shape(const RowsView& q, std::size_t batch, const char* call) const;
  void check_query_values(const RowsView& q, const char* call) const;
  std::int64_t check_query_rows(const RowsView& q, std::size_t batch, const char* call) const;
  void check_own_ticket(const Ticket& ticket, const char* call) const;
  bool under_attention(int slot, int layer) const noexcept;  // in the ticket acquired at `layer`
  void check_not_in_flight(std::span<const int> slots, int layer, const char* call) const;
  Record& find_ticket(const Ticket& ticket, const char* call);
  void check_plan_capacity(int layer) const;
  void note_capture(int layer);
  void pump(int layer);
  void sweep_tickets();
  void free_drained();

  Cache(const CacheConfig& config, std::shared_ptr<const BudgetTable> budgets, const Options& options);

  std::uint64_t id_;
  std::shared_ptr<const BudgetTable> budgets_;  // what layout_ points at with a profile, or null
  CacheLayout layout_;
  Engine engine_;
  BlockTable table_;
  detail::PlanGate gate_;
  std::map<std::uint64_t, Record> tickets_;
  std::uint64_t next_ticket_ = 1;
  std::vector<Acquired> acquired_;   // per layer
  std::vector<std::string> failed_;  // per layer
  mutable Statistics stats_;
  // Graph capture in progress (engine.capture_id() != 0): lengths before it, per (slot, layer),
  // and the layers it touched.
  struct CaptureLog {
    std::uint64_t id = 0;
    std::map<std::pair<int, int>, std::int64_t> lengths;
    std::vector<char> layers;
    std::vector<BlockRemap> remaps;  // host pool changes of the captured appends
  } capture_;
  std::vector<BlockRemap> remaps_;  // scratch of append
};

}  // namespace v0
}  // namespace oasiskv

#include "oasiskv/detail/cache_impl.hpp"
#include "oasiskv/detail/cache_sequence_ops.hpp"
