// Bodies of Cache<Backend, T> (oasiskv/cache.hpp): the backend-neutral orchestration.
#pragma once

#include <algorithm>
#include <exception>
#include <string>
#include <utility>

#include "oasiskv/cache.hpp"  // the declarations (when this file is included on its own)
#include "oasiskv/detail/argument_checks.hpp"
#include "oasiskv/detail/checked.hpp"

namespace oasiskv {
inline namespace v0 {
namespace detail {
std::uint64_t next_cache_id() noexcept;  // src/block_table.cpp
}  // namespace detail

template <class B, KvElement T>
Cache<B, T>::Cache(const CacheConfig& config, const Options& options)
    : Cache(config, std::shared_ptr<const BudgetTable>{}, options) {}

template <class B, KvElement T>
Cache<B, T>::Cache(const CacheConfig& config, const BudgetProfile& profile, const Options& options)
    : Cache(config, BudgetTable::make(config, profile), options) {}

template <class B, KvElement T>
Cache<B, T>::Cache(const CacheConfig& config, std::shared_ptr<const BudgetTable> budgets, const Options& options)
    : id_(detail::next_cache_id()),
      budgets_(std::move(budgets)),
      layout_(budgets_ ? budgets_->apply(CacheLayout::from(config)) : CacheLayout::from(config)),
      engine_(layout_, options),
      table_(layout_),
      gate_(config.max_sequences, config.shape.num_layers),
      acquired_(static_cast<std::size_t>(config.shape.num_layers)),
      failed_(static_cast<std::size_t>(config.shape.num_layers)) {
  stats_.layers.resize(static_cast<std::size_t>(config.shape.num_layers));
  capture_.layers.assign(static_cast<std::size_t>(config.shape.num_layers), 0);
}

// ---- checks ---------------------------------------------------------------------------------

template <class B, KvElement T>
void Cache<B, T>::check_layer(int layer, const char* call) const {
  oasiskv::check_layer(layout_, layer, call);
  const std::string& f = failed_[static_cast<std::size_t>(layer)];
  if (!f.empty()) fail("{}: layer {} is failed since {}; call recover_layer({}) first", call, layer, f, layer);
}

template <class B, KvElement T>
int Cache<B, T>::slot_of(SeqId id, const char* call) const {
  return oasiskv::slot_of(table_, id, call);
}

template <class B, KvElement T>
std::vector<int> Cache<B, T>::resolve(std::span<const SeqId> batch, const char* call) const {
  return resolve_batch(table_, batch, call);
}

// Every size first (rows against the batch and the engine's cap, element type, null), then the
// values: a RowsView that overstates its rows is refused before a byte past the real ones is read.
template <class B, KvElement T>
std::int64_t Cache<B, T>::check_query_shape(const RowsView& q, std::size_t batch, const char* call) const {
  const std::int64_t per_sequence = query_rows_per_sequence(q, batch, call);
  if (per_sequence > engine_.max_query_rows()) {
    fail("{}: q has {} rows per sequence, more than this backend's max_query_rows = {}", call, per_sequence,
         engine_.max_query_rows());
  }
  check_rows_shape(q, dtype_of_v<T>, "q", q.rows, call, true);
  return per_sequence;
}

template <class B, KvElement T>
void Cache<B, T>::check_query_values(const RowsView& q, const char* call) const {
  // (The rows are capped by max_query_rows; checked all the same, a product that sizes a read.)
  engine_.check_input(q, "q", call,
                      detail::checked_product("q elements (rows x q row elements)", q.rows, layout_.q_row_elems));
}

template <class B, KvElement T>
std::int64_t Cache<B, T>::check_query_rows(const RowsView& q, std::size_t batch, const char* call) const {
  const std::int64_t per_sequence = check_query_shape(q, batch, call);
  check_query_values(q, call);
  return per_sequence;
}

// A ticket of another cache is refused, by every call that takes one, with that reason.
template <class B, KvElement T>
void Cache<B, T>::check_own_ticket(const Ticket& ticket, const char* call) const {
  if (ticket.id != 0 && ticket.cache != id_) {
    fail("{}: ticket {} was issued by another cache (cache {}), not by this one (cache {})", call, ticket.id,
         ticket.cache, id_);
  }
}

template <class B, KvElement T>
bool Cache<B, T>::under_attention(int slot, int layer) const noexcept {
  const auto& entries = acquired_[static_cast<std::size_t>(layer)].entries;
  return std::any_of(entries.begin(), entries.end(), [&](const ViewEntry& e) { return e.slot == slot; });
}

template <class B, KvElement T>
void Cache<B, T>::check_not_in_flight(std::span<const int> slots, int layer, const char* call) const {
  for (int s : slots) {
    if (under_attention(s, layer)) {
      fail("{}: sequence {} at layer {} is under attention (ticket {} acquired, not released)", call, table_.id(s),
           layer, acquired_[static_cast<std::size_t>(layer)].ticket);
    }
  }
}

// A failure of the backend while a call at `layer` enqueues work marks the layer failed.
template <class B, KvElement T>
template <class F>
auto Cache<B, T>::guarded(int layer, const char* call, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const std::exception& e) {
    failed_[static_cast<std::size_t>(layer)] = std::string(call) + " failed: " + e.what();
    throw;
  }
}

// Remembers what a graph capture changed on the host, so abandon_capture can undo it.
template <class B, KvElement T>
void Cache<B, T>::note_capture(int layer) {
  const std::uint64_t id = engine_.capture_id();
  if (id != capture_.id) {
    capture_.id = id;
    capture_.lengths.clear();
    capture_.remaps.clear();
    std::fill(capture_.layers.begin(), capture_.layers.end(), 0);
  }
  if (id != 0 && layer >= 0) capture_.layers[static_cast<std::size_t>(layer)] = 1;
}

// ---- append -----------------------------------------------------------------------------------

template <class B, KvElement T>
void Cache<B, T>::append(std::span<const SeqId> batch, int layer, std::span<const std::int32_t> rows_per_seq,
                         RowsView k, RowsView v) {
  constexpr const char* call = "append";
  check_layer(layer, call);
  const std::vector<int> slots = resolve(batch, call);
  const std::int64_t total = append_row_total(table_, layout_, batch, slots, layer, rows_per_seq, call);
  check_rows_shape(k, dtype_of_v<T>, "k", total, call, false);
  check_rows_shape(v, dtype_of_v<T>, "v", total, call, false);
  engine_.check_input(k, "k", call, total * layout_.row_elems);
  engine_.check_input(v, "v", call, total * layout_.row_elems);
  check_not_in_flight(slots, layer, call);

  std::vector<AppendEntry> entries(batch.size());
  for (std::size_t i = 0; i < batch.size(); ++i) {
    entries[i] = AppendEntry{slots[i], table_.length(slots[i], layer), rows_per_seq[i]};
  }
  const HostBlockPool& pool = engine_.host_tier().pool();
  if (const std::int64_t need = pool.blocks_needed(entries); need > pool.free_blocks()) {
    fail(
        "append: the host pool is exhausted: this append at layer {} needs {} more blocks ({} tokens each, new or "
        "copies of blocks shared by a fork), and {} of the pool's {} blocks are free (CacheConfig::host_pool_blocks); "
        "remove or truncate sequences first",
        layer, need, layout_.block_tokens(), pool.free_blocks(), pool.capacity());
  }
  engine_.enter(call, CallKind::decode);
  note_capture(layer);
  if (total > 0) {
    guarded(layer, call, [&] {
      remaps_.clear();
      engine_.map_blocks(entries, remaps_);
      if (capture_.id != 0) capture_.remaps.insert(capture_.remaps.end(), remaps_.begin(), remaps_.end());
      engine_.append(layer, entries, k, v);
    });
  }
  for (const AppendEntry& e : entries) {
    if (capture_.id != 0) capture_.lengths.try_emplace({e.slot, layer}, e.length);
    table_.set_length(e.slot, layer, e.length + e.rows);
  }
}

template <class B, KvElement T>
void Cache<B, T>::append(std::span<const SeqId> batch, int layer, RowsView k, RowsView v) {
  const std::vector<std::int32_t> ones(batch.size(), 1);
  append(batch, layer, ones, k, v);
}

// ---- prefetch ---------------------------------------------------------------------------------

template <class B, KvElement T>
void Cache<B, T>::check_plan_capacity(int layer) const {
  const int most = engine_.max_live_tickets_per_layer();
  if (most <= 0) return;
  std::string live, dead;
  int nlive = 0, nall = 0;
  for (const auto& [id, r] : tickets_) {
    if (r.layer != layer) continue;
    ++nall;
    std::string& list = r.live ? live : dead;
    list += (list.empty() ? "" : ", ") + std::to_string(id);
    nlive += r.live ? 1 : 0;
  }
  if (nlive >= most) {
    fail(
        "prefetch: layer {} already has {} outstanding tickets ({}), the most this backend holds "
        "(options.tickets_per_layer): acquire and release one first",
        layer, nlive, live);
  }
  if (nall >= most + 1) {
    fail(
        "prefetch: layer {} has no free ticket record: tickets {} are dead but their copies wait for older plans "
        "of their sequences to be released; release (or acquire newer tickets) first",
        layer, dead);
  }
}

template <class B, KvElement T>
Ticket Cache<B, T>::prefetch(std::span<const SeqId> batch, int layer, RowsView q_lookahead,
                             std::int64_t next_step_rows) {
  constexpr const char* call = "prefetch";
  check_layer(layer, call);
  const std::int64_t most_rows = std::min<std::int64_t>(layout_.config.max_tokens_per_sequence, INT32_MAX);
  if (next_step_rows < 1 || next_step_rows > most_rows) {
    fail("prefetch: next_step_rows must be in [1, {}], got {}", most_rows, next_step_rows);
  }
  const std::vector<int> slots = resolve(batch, call);
  const std::int64_t rows = check_query_rows(q_lookahead, batch.size(), call);
  check_plan_capacity(layer);
  if constexpr (ChecksPlans<Engine>) {
    engine_.check_plan(slots, call);  // what only the backend can refuse (CUDA: remote reads in a capture)
  }
  engine_.enter(call, CallKind::decode);
  note_capture(layer);

  Ticket ticket;
  ticket.id = next_ticket_;
  ticket.cache = id_;
  ticket.layer = layer;
  std::vector<PlanEntry> entries;
  Record record;
  record.layer = layer;
  std::uint64_t selected = 0;
  const int H = layout_.num_kv_heads();
  for (std::size_t i = 0; i < batch.size(); ++i) {
    const int s = slots[i];
    const std::int64_t len = table_.length(s, layer);
    const std::int64_t plan = table_.next_plan(s, layer);
    entries.push_back(PlanEntry{s, table_.generation(s), len, plan,
                                layout_.admit_cap(plan - table_.first_plan(s, layer)), next_step_rows,
                                plan == table_.first_plan(s, layer)});
    record.plans.push_back(
        detail::TicketPlan{s, table_.generation(s), table_.version(s), plan, detail::PlanState::pending});
    ticket.sequences.push_back(batch[i]);
    ticket.generations.push_back(table_.version(s));
    ticket.plans.push_back(plan);
    const std::int64_t n = layout_.next_step_candidates_end(len, next_step_rows) - layout_.sink_blocks;
    selected += static_cast<std::uint64_t>(layout_.layer_selected(layer, n));
  }
  record.engine_plan = guarded(layer, call, [&] { return engine_.plan(layer, entries, q_lookahead, rows, ticket.id); });
  // The plan is made: commit the host bookkeeping.
  ++next_ticket_;
  for (int s : slots) table_.advance_plan(s, layer);
  auto& st = stats_.layers[static_cast<std::size_t>(layer)];
  st.plans += static_cast<std::uint64_t>(batch.size()) * static_cast<std::uint64_t>(H);
  st.blocks_selected += selected;
  tickets_.emplace(ticket.id, std::move(record));
  guarded(layer, call, [&] { pump(layer); });
  return ticket;
}

// ---- acquire / release ------------------------------------------------------------------------

template <class B, KvElement T>
typename Cache<B, T>::Record& Cache<B, T>::find_ticket(const Ticket& t, const char* call) {
  auto it = tickets_.find(t.id);
  if (it != tickets_.end() && it->second.layer == t.layer && it->second.live) {
    for (const auto& p : it->second.plans) {
      if (p.plan_index <= table_.acquired_plan(p.slot, t.layer)) {
        fail(
            "{}: ticket {} is superseded: sequence {} at layer {} already served plan {}, newer than this "
            "ticket's plan {}",
            call, t.id, table_.id(p.slot), t.layer, table_.acquired_plan(p.slot, t.layer), p.plan_index);
      }
    }
    return it->second;
  }
  if (t.id >= next_ticket_) {
    fail("{}: ticket {} (layer {}) is unknown: this cache has issued tickets 1 to {} only", call, t.id, t.layer,
         next_ticket_ - 1);
  }
  // Not registered any more: say why, from the plan numbers it carries (its sequences are fresh).
  bool released = true;
  for (std::size_t i = 0; i < t.sequences.size(); ++i) {
    const int s = table_.find(t.sequences[i]);
    const std::int64_t served = table_.acquired_plan(s, t.layer);
    if (served > t.plans[i]) {
      fail(
          "{}: ticket {} is superseded: sequence {} at layer {} already served plan {}, newer than this "
          "ticket's plan {}",
          call, t.id, t.sequences[i], t.layer, served, t.plans[i]);
    }
    released = released && served == t.plans[i];
  }
  if (released) fail("{}: ticket {} (layer {}) was already acquired and released", call, t.id, t.layer);
  fail("{}: ticket {} (layer {}) is not a ticket this cache holds for that layer", call, t.id, t.layer);
}

template <class B, KvElement T>
LayerView<T> Cache<B, T>::acquire(const Ticket& ticket) {
  constexpr const char* call = "acquire";
  if (ticket.id == 0)
    fail("acquire: empty ticket (layer {}): call prefetch for this layer before acquire", ticket.layer);
  check_layer(ticket.layer, call);
  check_own_ticket(ticket, call);
  check_ticket_fresh(table_, ticket, call);
  const int layer = ticket.layer;
  auto& acq = acquired_[static_cast<std::size_t>(layer)];
  if (acq.ticket != 0) {
    fail("acquire: layer {} already has ticket {} acquired; release it before acquiring ticket {}", layer, acq.ticket,
         ticket.id);
  }
  Record& record = find_ticket(ticket, call);
  engine_.enter(call, CallKind::decode);
  note_capture(layer);

  for (const auto& p : record.plans) {
    table_.set_acquired_plan(p.slot, layer, p.plan_index);
    gate_.retire(p.slot, layer, p.plan_index - 1);  // older plans are superseded
  }
  std::vector<ViewEntry> entries;
  for (const auto& p : record.plans)
    entries.push_back(ViewEntry{p.slot, table_.id(p.slot), table_.length(p.slot, layer)});
  const LayerView<T> view = guarded(layer, call, [&] {
    pump(layer);  // every plan of this ticket has now started its copies
    stats_.layers[static_cast<std::size_t>(layer)].acquire_wait_ns += engine_.wait(record.engine_plan);
    return engine_.build_view(layer, record.engine_plan, entries);
  });
  check_remote_reads(entries);
  acq.ticket = ticket.id;
  acq.entries = std::move(entries);
  stats_.layers[static_cast<std::size_t>(layer)].acquires += 1;
  sweep_tickets();
  return view;
}

// A sequence whose remote reads failed (admit) would be attended without some of its blocks: its
// acquire throws instead. The ticket counts as served; the layer stays usable.
template <class B, KvElement T>
void Cache<B, T>::check_remote_reads(std::span<const ViewEntry> entries) const {
  if constexpr (ReportsSequenceFailure<Engine>) {
    for (const ViewEntry& e : entries) {
      if (const std::string why = engine_.sequence_failure(e.slot); !why.empty()) {
        fail(
            "acquire: sequence {} failed: a read of its remote blocks failed ({}); remove it (the other sequences "
            "of this ticket are intact: prefetch them again)",
            e.id, why);
      }
    }
  }
}

template <class B, KvElement T>
void Cache<B, T>::release(const Ticket& ticket) {
  constexpr const char* call = "release";
  oasiskv::check_layer(layout_, ticket.layer, call);
  const int layer = ticket.layer;
  check_own_ticket(ticket, call);
  auto& acq = acquired_[static_cast<std::size_t>(layer)];
  if (ticket.id == 0 || acq.ticket != ticket.id)
    fail("release: ticket {} is not acquired at layer {}", ticket.id, layer);
  engine_.enter(call, CallKind::decode);
  note_capture(layer);
  Record& record = tickets_.at(ticket.id);
  for (const auto& p : record.plans) {
    if (table_.alive(p.slot, p.generation)) gate_.retire(p.slot, layer, p.plan_index);
  }
  record.live = false;
  acq.ticket = 0;
  acq.entries.clear();
  engine_.release_view(layer);
  // A failed layer only lets its tickets go; recover_layer restarts it.
  if (failed_[static_cast<std::size_t>(layer)].empty()) guarded(layer, call, [&] { pump(layer); });
  sweep_tickets();
}

// ---- prediction quality -----------------------------------------------------------------------

template <class B, KvElement T>
void Cache<B, T>::observe(const Ticket& ticket, RowsView q_true) {
  constexpr const char* call = "observe";
  check_layer(ticket.layer, call);
  check_own_ticket(ticket, call);
  const auto& acq = acquired_[static_cast<std::size_t>(ticket.layer)];
  if (ticket.id == 0 || acq.ticket != ticket.id)
    fail("observe: ticket {} is not acquired at layer {}", ticket.id, ticket.layer);
  const std::int64_t rows = check_query_rows(q_true, acq.entries.size(), call);
  engine_.enter(call, CallKind::decode);
  note_capture(ticket.layer);
  std::uint64_t truth = 0;
  for (const ViewEntry& e : acq.entries) {
    const std::int64_t n = layout_.current_candidates_end(e.length) - layout_.sink_blocks;
    truth += static_cast<std::uint64_t>(layout_.layer_selected(ticket.layer, n));
  }
  guarded(ticket.layer, call, [&] { engine_.observe(ticket.layer, acq.entries, q_true, rows); });
  stats_.layers[static_cast<std::size_t>(ticket.layer)].observed_true_blocks += truth;
}

template <class B, KvElement T>
void Cache<B, T>::remainder(const Ticket& ticket, RowsView q, std::span<float> out,
                            std::span<float> lse) requires EstimatesRemainder<Engine> {
  constexpr const char* call = "remainder";
  check_layer(ticket.layer, call);
  if (layout_.config.remainder == RemainderEstimate::none) {
    fail(
        "remainder: CacheConfig::remainder is none: this cache keeps nothing to estimate from (set it to clusters "
        "or quantized)");
  }
  check_own_ticket(ticket, call);
  const auto& acq = acquired_[static_cast<std::size_t>(ticket.layer)];
  if (ticket.id == 0 || acq.ticket != ticket.id)
    fail("remainder: ticket {} is not acquired at layer {}", ticket.id, ticket.layer);
  const std::int64_t rows = check_query_shape(q, acq.entries.size(), call);
  const std::int64_t states =
      detail::checked_product("remainder: states (q rows x num_q_heads)", q.rows, layout_.num_q_heads());
  const std::int64_t values =
      detail::checked_product("remainder: output values (states x head_dim)", states, layout_.head_dim());
  if (static_cast<std::int64_t>(out.size()) != values) {
    fail("remainder: out has {} floats, but {} q rows x {} query heads x {} channels need {}", out.size(), q.rows,
         layout_.num_q_heads(), layout_.head_dim(), values);
  }
  if (static_cast<std::int64_t>(lse.size()) != states) {
    fail("remainder: lse has {} floats, but {} q rows x {} query heads need {}", lse.size(), q.rows,
         layout_.num_q_heads(), states);
  }
  if constexpr (ChecksOutputs<Engine>) {
    engine_.check_output(out.data(), "out", call, values);  // CUDA: device-writable memory
    engine_.check_output(lse.data(), "lse", call, states);
  }
  check_query_values(q, call);  // after every size: out and lse must match the rows q claims
  engine_.enter(call, CallKind::decode);
  guarded(ticket.layer, call, [&] { engine_.remainder(ticket.layer, acq.entries, q, rows, out.data(), lse.data()); });
}

template <class B, KvElement T>
std::vector<std::vector<std::int32_t>> Cache<B, T>::select_blocks(SeqId id, int layer, RowsView q) const {
  constexpr const char* call = "select_blocks";
  check_layer(layer, call);
  const int s = slot_of(id, call);
  const std::int64_t rows = check_query_rows(q, 1, call);
  engine_.enter(call, CallKind::host_only);
  return engine_.select_blocks(s, layer, table_.length(s, layer), q, rows);
}

// ---- statistics -------------------------------------------------------------------------------

template <class B, KvElement T>
const Statistics& Cache<B, T>::statistics() const {
  engine_.enter("statistics", CallKind::host_only);
  const std::uint64_t block_bytes = static_cast<std::uint64_t>(layout_.block_elems) * sizeof(T);
  for (int l = 0; l < layout_.num_layers(); ++l) {
    const EngineCounters c = engine_.counters(l);
    auto& st = stats_.layers[static_cast<std::size_t>(l)];
    st.blocks_fetched = c.blocks_fetched;
    st.bytes_fetched = c.blocks_fetched * block_bytes;
    st.remote_blocks_fetched = c.remote_blocks_fetched;
    st.remote_bytes_fetched = c.remote_blocks_fetched * block_bytes;
    st.admits_capped = c.admits_capped;
    st.observed_hits = c.observed_hits;
    st.copy_ns = c.copy_ns;
  }
  const auto& host = engine_.host_tier();
  stats_.host_blocks_total = static_cast<std::uint64_t>(host.pool().capacity());
  stats_.host_blocks_in_use = static_cast<std::uint64_t>(host.pool().blocks_in_use());
  stats_.host_bytes_in_use = host.bytes_in_use();
  return stats_;
}

template <class B, KvElement T>
void Cache<B, T>::reset_statistics() {
  engine_.enter("reset_statistics", CallKind::host_only);
  engine_.reset_counters();
  for (auto& l : stats_.layers) l = LayerStatistics{};
}

// ---- tickets and the gate ---------------------------------------------------------------------

// Starts, oldest ticket first, the copies of every plan of `layer` whose older plans are retired;
// drops those of removed sequences; frees dead tickets whose plans all started or were dropped.
template <class B, KvElement T>
void Cache<B, T>::pump(int layer) {
  std::vector<int> run;
  for (auto& [id, r] : tickets_) {
    if (r.layer != layer) continue;
    run.clear();
    for (std::size_t i = 0; i < r.plans.size(); ++i) {
      auto& p = r.plans[i];
      if (p.state != detail::PlanState::pending) continue;
      if (!table_.alive(p.slot, p.generation)) {
        p.state = detail::PlanState::dropped;
      } else if (gate_.open(p.slot, layer, p.plan_index)) {
        run.push_back(static_cast<int>(i));
      }
    }
    if (run.empty()) continue;
    engine_.start_copies(r.engine_plan, run);
    for (int i : run) r.plans[static_cast<std::size_t>(i)].state = detail::PlanState::started;
  }
  free_drained();
}

// Marks dead the tickets that can never be acquired (a sequence gone, or a newer plan served).
template <class B, KvElement T>
void Cache<B, T>::sweep_tickets() {
  for (auto& [id, r] : tickets_) {
    if (!r.live || acquired_[static_cast<std::size_t>(r.layer)].ticket == id) continue;
    r.live = std::none_of(r.plans.begin(), r.plans.end(), [&](const detail::TicketPlan& p) {
      return !table_.alive(p.slot, p.generation) || p.version != table_.version(p.slot) ||
             p.plan_index <= table_.acquired_plan(p.slot, r.layer);
    });
  }
  free_drained();
}

template <class B, KvElement T>
void Cache<B, T>::free_drained() {
  for (auto it = tickets_.begin(); it != tickets_.end();) {
    Record& r = it->second;
    for (auto& p : r.plans) {
      if (p.state == detail::PlanState::pending && !table_.alive(p.slot, p.generation))
        p.state = detail::PlanState::dropped;
    }
    if (!r.live && r.drained()) {
      engine_.free_plan(r.engine_plan);
      it = tickets_.erase(it);
    } else {
      ++it;
    }
  }
}

// ---- failures ---------------------------------------------------------------------------------

template <class B, KvElement T>
const std::string& Cache<B, T>::layer_failure(int layer) const {
  oasiskv::check_layer(layout_, layer, "layer_failure");
  return failed_[static_cast<std::size_t>(layer)];
}

template <class B, KvElement T>
void Cache<B, T>::recover_layer(int layer) {
  oasiskv::check_layer(layout_, layer, "recover_layer");
  const auto& acq = acquired_[static_cast<std::size_t>(layer)];
  if (acq.ticket != 0) fail("recover_layer: layer {} has ticket {} acquired: release it first", layer, acq.ticket);
  engine_.enter("recover_layer", CallKind::host_only);
  engine_.reset_layer(layer);
  for (auto it = tickets_.begin(); it != tickets_.end();) {
    if (it->second.layer == layer) {
      engine_.free_plan(it->second.engine_plan);
      it = tickets_.erase(it);
    } else {
      ++it;
    }
  }
  for (int s : table_.live_slots()) {
    const std::int64_t next = table_.next_plan(s, layer);
    gate_.retire(s, layer, next - 1);
    table_.set_acquired_plan(s, layer, next - 1);
    table_.set_first_plan(s, layer, next);
  }
  failed_[static_cast<std::size_t>(layer)].clear();
}

template <class B, KvElement T>
void Cache<B, T>::abandon_capture() {
  if (capture_.id == 0) fail("abandon_capture: no graph capture is in progress or has just ended");
  for (const auto& [key, length] : capture_.lengths) table_.set_length(key.first, key.second, length);
  engine_.undo_blocks(capture_.remaps);  // the captured appends never ran: their blocks go back
  capture_.remaps.clear();
  for (int l = 0; l < layout_.num_layers(); ++l) {
    if (capture_.layers[static_cast<std::size_t>(l)] == 0) continue;
    auto& acq = acquired_[static_cast<std::size_t>(l)];
    if (acq.ticket != 0) {
      acq.ticket = 0;
      acq.entries.clear();
      engine_.release_view(l);
    }
    failed_[static_cast<std::size_t>(l)].clear();
  }
  capture_.id = 0;  // recover_layer runs eagerly
  for (int l = 0; l < layout_.num_layers(); ++l) {
    if (capture_.layers[static_cast<std::size_t>(l)] != 0) recover_layer(l);
  }
  capture_.lengths.clear();
  std::fill(capture_.layers.begin(), capture_.layers.end(), 0);
}

}  // namespace v0
}  // namespace oasiskv
