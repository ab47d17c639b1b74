// The backend-engine interface: what Cache<Backend, T> asks of a backend. The Cache owns
// everything backend-neutral (sequence lifecycle, argument checks, tickets, the per-(sequence,
// layer) plan gate, statistics, the view rules) and calls its engine through these hooks. The
// concept states them, so a backend that drifts from the contract fails to compile.
//
// Order of the hooks in a decode step (docs/architecture.md has the diagram):
//   append         -> engine.append             rows into the host tier, pinned slots, summaries
//   prefetch       -> engine.plan               score, top-K, transfer plan; copies not started
//   (gate opens)   -> engine.start_copies       the plan's copies of some of its sequences
//   acquire        -> engine.wait, build_view   order after the copies, then the CSR view
//   release        -> engine.release_view       (then newly opened gates start copies)
//   truncate       -> engine.truncate           per layer, after every plan of the sequence started;
//                     engine.release_blocks     then the host blocks past the new end
//   append         -> engine.map_blocks         first: host pool blocks for the rows (copy on write)
//   fork           -> engine.fork               blocks shared, summaries and pinned slots of dst
// Every hook is called after the Cache validated the call; a hook throws only for a failure of
// the backend itself (for example a CUDA launch error), and the Cache then marks the layer
// failed (see Cache::recover_layer). The optional hooks (admission, sequence failure, the
// remainder estimate, plan and output checks, stream joins) are the named concepts at the end.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "oasiskv/admission.hpp"
#include "oasiskv/config.hpp"
#include "oasiskv/dtype.hpp"
#include "oasiskv/hook_arguments.hpp"
#include "oasiskv/kit/host_block_pool.hpp"
#include "oasiskv/remote_blocks.hpp"
#include "oasiskv/statistics.hpp"
#include "oasiskv/view.hpp"

namespace oasiskv {
inline namespace v0 {

// The engine of a backend tag for element type T: specialised next to each engine.
template <class Backend, class T>
struct backend_engine;

// The geometry of a view of `batch_size` sequences at `layer`.
inline ViewGeometry view_geometry(const CacheLayout& layout, int layer, int batch_size) noexcept {
  ViewGeometry g;
  g.layer = layer;
  g.batch_size = batch_size;
  g.num_kv_heads = layout.num_kv_heads();
  g.head_dim = layout.head_dim();
  g.block_tokens = layout.block_tokens();
  g.slot_stride = layout.block_elems;
  return g;
}

// The LayerView an engine returns from build_view: its arrays over the layer's slot pool.
template <class T>
LayerView<T> make_layer_view(const CacheLayout& layout, int layer, const ViewArrays& a, const T* pool) noexcept {
  LayerView<T> v;
  v.geometry() = view_geometry(layout, layer, a.batch_size);
  v.seq_ids = a.seq_ids;
  v.seq_len = a.seq_len;
  v.indptr = a.indptr;
  v.slot = a.slot;
  v.block = a.block;
  v.valid_tokens = a.valid_tokens;
  v.pool = pool;
  return v;
}

template <class E>
concept CacheEngine = std::move_constructible<typename E::Plan> && std::default_initializable<typename E::Options> &&
    requires(E& e, const E& ce, const CacheLayout& layout, const typename E::Options& options, typename E::Plan& plan,
             const typename E::Plan& cplan, RowsView rows, int layer, int slot, std::uint32_t generation,
             std::span<const AppendEntry> appends, std::span<const PlanEntry> plans, std::span<const ViewEntry> views,
             std::span<const int> entry_indices, std::uint64_t ticket, std::int64_t rows_per_seq, std::int64_t length,
             const char* call, CallKind kind, std::vector<BlockRemap>& remaps, std::span<const BlockRemap> cremaps) {
  typename E::element_type;
  typename E::HostTier;
  {E(layout, options)};
  // Limits of the engine: query rows per sequence; tickets per layer (0: no limit).
  { ce.max_query_rows() } -> std::same_as<std::int64_t>;
  { ce.max_live_tickets_per_layer() } -> std::same_as<int>;
  // Before any state changes: refuses a call the engine cannot take now (CallKind::host_only
  // during graph capture); checks the memory of an input and, where the engine can read it,
  // its values (`elements` values of element type rows.dtype).
  { ce.enter(call, kind) } -> std::same_as<void>;
  // The id of the CUDA graph capture the calls are being recorded into, or 0 (eager).
  { ce.capture_id() } -> std::same_as<std::uint64_t>;
  { e.synchronize() } -> std::same_as<void>;
  { ce.check_input(rows, call, call, length) } -> std::same_as<void>;
  // Lifecycle. The slot's pending copies of other generations are dropped.
  { e.sequence_added(slot, generation) } -> std::same_as<void>;
  { e.sequence_removed(slot, generation) } -> std::same_as<void>;
  // Residency of one layer back to empty for every sequence (Cache::recover_layer).
  { e.reset_layer(layer) } -> std::same_as<void>;
  // Rows [length, old) of (slot, layer) dropped: the partial block's summary recomputed from its
  // rows, the recent ring rebuilt, resident blocks from length / block_tokens on freed.
  { e.truncate(slot, layer, length, length) } -> std::same_as<void>;
  // Host pool (host_block_pool.hpp). map_blocks: pool blocks for the rows of an append (the Cache
  // checked there are enough), copies on write made, changes appended to `remaps`;
  // undo_blocks: those changes undone (an abandoned capture); release_blocks: the slot's blocks
  // from a logical block on returned (truncate, remove); fork: dst (fresh) becomes the first
  // `length` tokens of src, at every layer.
  { e.map_blocks(appends, remaps) } -> std::same_as<void>;
  { e.undo_blocks(cremaps) } -> std::same_as<void>;
  { e.release_blocks(slot, length) } -> std::same_as<void>;
  { e.fork(slot, slot, length) } -> std::same_as<void>;
  // Decode path.
  { e.append(layer, appends, rows, rows) } -> std::same_as<void>;
  { e.plan(layer, plans, rows, rows_per_seq, ticket) } -> std::same_as<typename E::Plan>;
  { e.start_copies(plan, entry_indices) } -> std::same_as<void>;
  { e.wait(plan) } -> std::same_as<std::int64_t>;  // nanoseconds the host waited
  { e.build_view(layer, cplan, views) } -> std::same_as<LayerView<typename E::element_type>>;
  { e.release_view(layer) } -> std::same_as<void>;
  { e.free_plan(plan) } -> std::same_as<void>;
  { e.observe(layer, views, rows, rows_per_seq) } -> std::same_as<void>;
  { ce.select_blocks(slot, layer, length, rows, rows_per_seq) } -> std::same_as<std::vector<std::vector<std::int32_t>>>;
  // Statistics kept by the engine; may synchronise.
  { ce.counters(layer) } -> std::same_as<EngineCounters>;
  { e.reset_counters() } -> std::same_as<void>;
  { ce.host_tier() } -> std::same_as<const typename E::HostTier&>;
};

// ---- optional hooks: what a backend may add, each a named part of the contract ----------------
// The Cache offers the call (or the check) exactly when its engine has the hooks.

// The remote tier (Cache::admit; remote_blocks.hpp): a sequence from another process's prefill,
// its first plans read the message's lookahead queries where the engine keeps them
// (admission_queries), then the staged working-set rows are forgotten (finish_admission).
template <class E>
concept AdmittingEngine = requires(E& e, int slot, const AdmissionMessage& m, std::shared_ptr<RemoteBlockSource> source,
                                   std::span<const float> queries) {
  { e.admit(slot, m, source) } -> std::same_as<void>;
  { e.finish_admission(slot) } -> std::same_as<void>;
  { e.admission_queries(queries) } -> std::same_as<const float*>;
};

// Why a sequence's remote reads failed (empty: they did not): acquire refuses its views.
template <class E>
concept ReportsSequenceFailure = requires(const E& e, int slot) {
  { e.sequence_failure(slot) } -> std::same_as<std::string>;
};

// The remainder estimate (Cache::remainder, CacheConfig::remainder): the state over the blocks an
// acquired view of `layer` leaves out, for the true queries.
template <class E>
concept EstimatesRemainder = requires(E& e, int layer, std::span<const ViewEntry> views, RowsView q, std::int64_t rows,
                                      float* out) {
  { e.remainder(layer, views, q, rows, out, out) } -> std::same_as<void>;
};

// Checks of the backend's own before a plan or an output is taken (CUDA: remote reads during a
// graph capture; an output the device cannot write).
template <class E>
concept ChecksPlans = requires(const E& e, std::span<const int> slots, const char* call) {
  { e.check_plan(slots, call) } -> std::same_as<void>;
};
template <class E>
concept ChecksOutputs = requires(const E& e, float* p, const char* name, std::int64_t floats) {
  { e.check_output(p, name, name, floats) } -> std::same_as<void>;
};

// CUDA graph capture: the engine's second stream joined into the first around a capture.
template <class E>
concept JoinsStreams = requires(E& e) {
  { e.join() } -> std::same_as<void>;
};

}  // namespace v0
}  // namespace oasiskv
