// Cache: the facade an engine uses. Sequence lifecycle, append, prefetch, acquire / attend /
// release, statistics. Calls come from one engine thread; copies run in the PrefetchPipeline.
//
// Per layer and decode step:
//   cache.append(batch, l, k, v);                  // current rows -> host tier + pinned slots
//   Ticket next = cache.prefetch(batch, l, q_la);  // plan step t+1 from the lookahead queries
//   LayerView view = cache.acquire(previous[l]);   // residency planned in step t-1
//   attention(view, q, out);                       // the engine's kernel
//   cache.release(previous[l]); previous[l] = next;
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <span>
#include <unordered_map>
#include <vector>

#include "oasiskv/argument_checks.hpp"
#include "oasiskv/attention.hpp"
#include "oasiskv/backend.hpp"
#include "oasiskv/block_table.hpp"
#include "oasiskv/config.hpp"
#include "oasiskv/dtype.hpp"
#include "oasiskv/error.hpp"
#include "oasiskv/lookahead_selector.hpp"
#include "oasiskv/prefetch_pipeline.hpp"
#include "oasiskv/statistics.hpp"
#include "oasiskv/summary.hpp"
#include "oasiskv/ticket.hpp"
#include "oasiskv/tier.hpp"
#include "oasiskv/transfer_plan.hpp"

namespace oasiskv {
inline namespace v0 {

template <class Backend, KvElement T>
class Cache {
  static_assert(std::is_same_v<Backend, cpu>, "this build has the CPU backend only");

 public:
  using element_type = T;

  explicit Cache(const CacheConfig& config)
      : layout_(CacheLayout::from(config)),
        host_(layout_),
        device_(layout_),
        summaries_(layout_),
        table_(layout_),
        selector_(layout_),
        pipeline_(config.max_sequences, config.shape.num_layers),
        acquired_(static_cast<std::size_t>(config.shape.num_layers)) {
    stats_.layers.resize(static_cast<std::size_t>(config.shape.num_layers));
  }

  const CacheLayout& layout() const noexcept { return layout_; }
  const HostTier<T>& host_tier() const noexcept { return host_; }
  const BlockTable& block_table() const noexcept { return table_; }

  // ---- sequence lifecycle -------------------------------------------------------------------

  void add_sequence(SeqId id) {
    if (table_.find(id) >= 0) fail("add_sequence: sequence {} is already in the cache", id);
    if (table_.free_slots() == 0) {
      fail("add_sequence: cannot add sequence {}: all {} sequence slots are in use (max_sequences)",
           id, layout_.config.max_sequences);
    }
    const int s = table_.add(id);
    pipeline_.reset_sequence(s, table_.generation(s));
  }

  // Drops the sequence; its tickets become stale. Refused while its attention is in flight.
  void remove_sequence(SeqId id) {
    const int s = slot_of(id, "remove_sequence");
    for (std::size_t l = 0; l < acquired_.size(); ++l) {
      const auto& a = acquired_[l];
      if (a.ticket != 0 && std::find(a.slots.begin(), a.slots.end(), s) != a.slots.end()) {
        fail("remove_sequence: sequence {} is in ticket {}, acquired at layer {}: release it first",
             id, a.ticket, l);
      }
    }
    const std::uint32_t generation = table_.remove(s);
    pipeline_.reset_sequence(s, generation);
    sweep_tickets();
  }

  bool has_sequence(SeqId id) const noexcept { return table_.find(id) >= 0; }
  std::size_t num_sequences() const noexcept { return table_.num_sequences(); }
  std::int64_t sequence_length(SeqId id, int layer) const {
    check_layer(layer, "sequence_length");
    return table_.length(slot_of(id, "sequence_length"), layer);
  }

  // ---- append -------------------------------------------------------------------------------

  // Appends rows_per_seq[i] rows to batch[i] at `layer`. k and v: [total rows][kv_heads][head_dim]
  // of element type T, rows in batch order. Keys as attention uses them (normally after RoPE).
  void append(std::span<const SeqId> batch, int layer, std::span<const std::int32_t> rows_per_seq,
              RowsView k, RowsView v) {
    constexpr const char* call = "append";
    check_layer(layer, call);
    const std::vector<int> slots = resolve(batch, call);
    const std::int64_t total =
        append_row_total(table_, layout_, batch, slots, layer, rows_per_seq, call);
    check_rows(k, "k", total, call, false);
    check_rows(v, "v", total, call, false);
    check_not_in_flight(slots, layer, call);

    const int H = layout_.config.shape.num_kv_heads;
    const int d = layout_.config.shape.head_dim;
    const std::int64_t bt = layout_.config.block_tokens;
    const T* kp = static_cast<const T*>(k.data);
    const T* vp = static_cast<const T*>(v.data);
    std::int64_t row = 0;
    for (std::size_t i = 0; i < batch.size(); ++i) {
      const int s = slots[i];
      const std::int64_t len = table_.length(s, layer);
      const std::int64_t end = len + rows_per_seq[i];
      // Rows of blocks still pinned after this append are written through to their slots.
      const std::int64_t ring_first = layout_.ring_start(end);
      for (std::int64_t pos = len; pos < end; ++pos, ++row) {
        const std::int64_t b = pos / bt;
        const std::int64_t off = pos % bt;
        const bool pinned = b < layout_.sink_blocks || b >= ring_first;
        for (int h = 0; h < H; ++h) {
          const T* key = kp + (row * H + h) * d;
          const T* val = vp + (row * H + h) * d;
          T* hb = host_.block(s, layer, h, b);
          std::memcpy(hb + off * d, key, sizeof(T) * static_cast<std::size_t>(d));
          std::memcpy(hb + (bt + off) * d, val, sizeof(T) * static_cast<std::size_t>(d));
          summaries_.add_key(s, layer, h, pos, key);
          if (pinned) {
            T* slot = device_.slot(layer, device_.slot_id(s, h, layout_.pinned_slot(b)));
            std::memcpy(slot + off * d, key, sizeof(T) * static_cast<std::size_t>(d));
            std::memcpy(slot + (bt + off) * d, val, sizeof(T) * static_cast<std::size_t>(d));
          }
        }
      }
      table_.set_length(s, layer, end);
    }
  }

  // One row per sequence (a decode step).
  void append(std::span<const SeqId> batch, int layer, RowsView k, RowsView v) {
    const std::vector<std::int32_t> ones(batch.size(), 1);
    append(batch, layer, ones, k, v);
  }

  // ---- prefetch -----------------------------------------------------------------------------

  // Plans the resident set of the next step at `layer` from the lookahead queries
  // q_lookahead: [batch * R][num_q_heads][head_dim] (R >= 1 rows per sequence, in batch order),
  // element type T or float. Scoring, top-K and planning run now; the copies run in the
  // background once the previous ticket of this layer is released. The next step assumes one
  // more token: blocks leaving the recent ring then are candidates now.
  Ticket prefetch(std::span<const SeqId> batch, int layer, RowsView q_lookahead) {
    constexpr const char* call = "prefetch";
    check_layer(layer, call);
    const std::vector<int> slots = resolve(batch, call);
    const std::int64_t rows = check_query_rows(q_lookahead, batch.size(), call);

    const auto& shape = layout_.config.shape;
    const int H = shape.num_kv_heads;
    const int G = layout_.group_size;
    auto& st = stats_.layers[static_cast<std::size_t>(layer)];

    Ticket ticket;
    ticket.id = next_ticket_++;
    ticket.layer = layer;
    TicketRecord record;
    record.layer = layer;
    std::vector<PlanCopies> copies;
    for (std::size_t i = 0; i < batch.size(); ++i) {
      const int s = slots[i];
      const std::int64_t plan_index = table_.next_plan(s, layer);
      ticket.sequences.push_back(batch[i]);
      ticket.generations.push_back(table_.generation(s));
      PlanCopies pc{s, table_.generation(s), layer, plan_index, {}};
      TicketEntry entry{s, table_.generation(s), plan_index, {}};
      const std::int64_t len = table_.length(s, layer);
      const std::int64_t first = layout_.sink_blocks;
      const std::int64_t last = std::min(layout_.blocks_for(len), layout_.ring_start(len + 1));
      for (int h = 0; h < H; ++h) {
        gather_queries(q_lookahead, i, rows, h);
        selector_.score(summaries_, s, layer, h, first, std::max(first, last), queries_.data(),
                        static_cast<int>(rows) * G, scores_);
        LookaheadSelector::top_k(scores_, first, layout_.selectable_blocks, selected_);
        const SlotResidency res = table_.planned(s, layer, h);
        planner_.plan(selected_, res, layout_.admit_cap(plan_index), plan_index, plan_);
        apply(plan_, res);
        for (const Admit& a : plan_.admits) {
          pc.copies.push_back(BlockCopy{
              host_.block(s, layer, h, a.block),
              device_.slot(layer, device_.slot_id(s, h, selectable_local(a.slot))),
              static_cast<std::size_t>(layout_.block_elems) * sizeof(T)});
        }
        entry.residency.insert(entry.residency.end(), res.block.begin(), res.block.end());
        st.plans += 1;
        st.blocks_selected += selected_.size();
        st.blocks_fetched += plan_.admits.size();
        st.bytes_fetched += plan_.admits.size() * static_cast<std::uint64_t>(layout_.block_elems) * sizeof(T);
        st.admits_capped += static_cast<std::uint64_t>(plan_.capped);
      }
      table_.advance_plan(s, layer);
      copies.push_back(std::move(pc));
      record.entries.push_back(std::move(entry));
    }
    tickets_.emplace(ticket.id, std::move(record));
    pipeline_.submit(ticket.id, std::move(copies));
    return ticket;
  }

  // ---- acquire / release --------------------------------------------------------------------

  // Waits for the ticket's copies and returns the resident working set of its sequences at its
  // layer: sinks, the plan's selected blocks, and the recent ring (with this step's rows).
  // Older unacquired tickets of the same sequences and layer are superseded.
  LayerView<T> acquire(const Ticket& ticket) {
    constexpr const char* call = "acquire";
    if (ticket.id == 0) {
      fail("acquire: empty ticket (layer {}): call prefetch for this layer before acquire",
           ticket.layer);
    }
    check_layer(ticket.layer, call);
    check_fresh(ticket, call);
    auto& acq = acquired_[static_cast<std::size_t>(ticket.layer)];
    if (acq.ticket != 0) {
      fail("acquire: layer {} already has ticket {} acquired; release it before acquiring ticket {}",
           ticket.layer, acq.ticket, ticket.id);
    }
    auto it = tickets_.find(ticket.id);
    if (it == tickets_.end() || it->second.layer != ticket.layer) {
      fail("acquire: ticket {} (layer {}) is unknown, already released, or superseded by a newer "
           "ticket",
           ticket.id, ticket.layer);
    }
    const TicketRecord& record = it->second;
    for (const auto& e : record.entries) {
      if (e.plan_index <= table_.acquired_plan(e.slot, ticket.layer)) {
        fail("acquire: ticket {} is superseded: sequence {} at layer {} already served a newer plan",
             ticket.id, table_.id(e.slot), ticket.layer);
      }
    }

    for (const auto& e : record.entries) {
      table_.set_acquired_plan(e.slot, ticket.layer, e.plan_index);
      pipeline_.retire(e.slot, ticket.layer, e.plan_index - 1);
    }
    auto& st = stats_.layers[static_cast<std::size_t>(ticket.layer)];
    st.acquire_wait_ns += pipeline_.wait(ticket.id);
    st.acquires += 1;
    build_view(ticket, record, acq);
    sweep_tickets();
    return view_of(ticket.layer);
  }

  // Ends attention over an acquired ticket: its slots may now be overwritten by newer plans.
  void release(const Ticket& ticket) {
    check_layer(ticket.layer, "release");
    auto& acq = acquired_[static_cast<std::size_t>(ticket.layer)];
    if (ticket.id == 0 || acq.ticket != ticket.id) {
      fail("release: ticket {} is not acquired at layer {}", ticket.id, ticket.layer);
    }
    auto it = tickets_.find(ticket.id);
    for (const auto& e : it->second.entries) {
      if (table_.alive(e.slot, e.generation)) pipeline_.retire(e.slot, ticket.layer, e.plan_index);
    }
    tickets_.erase(it);
    acq.ticket = 0;
    acq.slots.clear();
  }

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
  void observe(const Ticket& ticket, RowsView q_true) {
    constexpr const char* call = "observe";
    check_layer(ticket.layer, call);
    const auto& acq = acquired_[static_cast<std::size_t>(ticket.layer)];
    if (ticket.id == 0 || acq.ticket != ticket.id) {
      fail("observe: ticket {} is not acquired at layer {}", ticket.id, ticket.layer);
    }
    const std::int64_t rows = check_query_rows(q_true, ticket.sequences.size(), call);
    const int H = layout_.config.shape.num_kv_heads;
    const int G = layout_.group_size;
    auto& st = stats_.layers[static_cast<std::size_t>(ticket.layer)];
    for (std::size_t i = 0; i < acq.slots.size(); ++i) {
      const int s = acq.slots[i];
      const std::int64_t len = acq.seq_len[i];
      const std::int64_t first = layout_.sink_blocks;
      const std::int64_t last = layout_.ring_start(len);
      for (int h = 0; h < H; ++h) {
        gather_queries(q_true, i, rows, h);
        selector_.score(summaries_, s, ticket.layer, h, first, std::max(first, last), queries_.data(),
                        static_cast<int>(rows) * G, scores_);
        LookaheadSelector::top_k(scores_, first, layout_.selectable_blocks, selected_);
        const auto p = static_cast<std::size_t>(i) * static_cast<std::size_t>(H) + static_cast<std::size_t>(h);
        const auto begin = acq.block.begin() + acq.indptr[p];
        const auto end = acq.block.begin() + acq.indptr[p + 1];
        for (std::int32_t b : selected_) {
          if (std::binary_search(begin, end, b)) st.observed_hits += 1;
        }
        st.observed_true_blocks += selected_.size();
      }
    }
  }

  // The blocks (best first) the selector would pick for `id`'s next step at `layer` from the
  // queries q ([R][num_q_heads][head_dim]), per kv head: the candidates prefetch would rank now.
  // In the one-token-per-step protocol these are also the candidates observe ranks at the next
  // step (after its append). Changes nothing.
  std::vector<std::vector<std::int32_t>> select_blocks(SeqId id, int layer, RowsView q) const {
    constexpr const char* call = "select_blocks";
    check_layer(layer, call);
    const int s = slot_of(id, call);
    const std::int64_t rows = check_query_rows(q, 1, call);
    const int H = layout_.config.shape.num_kv_heads;
    const std::int64_t len = table_.length(s, layer);
    const std::int64_t first = layout_.sink_blocks;
    const std::int64_t last = std::min(layout_.blocks_for(len), layout_.ring_start(len + 1));
    std::vector<std::vector<std::int32_t>> out(static_cast<std::size_t>(H));
    LookaheadSelector selector(layout_);  // own scratch: this call is const
    std::vector<float> queries, scores;
    for (int h = 0; h < H; ++h) {
      gather_queries(q, 0, rows, h, queries);
      selector.score(summaries_, s, layer, h, first, std::max(first, last), queries.data(),
                     static_cast<int>(rows) * layout_.group_size, scores);
      LookaheadSelector::top_k(scores, first, layout_.selectable_blocks, out[static_cast<std::size_t>(h)]);
    }
    return out;
  }

  const Statistics& statistics() const noexcept { return stats_; }
  void reset_statistics() {
    for (auto& l : stats_.layers) l = LayerStatistics{};
  }

 private:
  struct TicketEntry {
    int slot = 0;
    std::uint32_t generation = 0;
    std::int64_t plan_index = 0;
    std::vector<std::int32_t> residency;  // [kv_heads][selectable_blocks] after this plan
  };
  struct TicketRecord {
    int layer = 0;
    std::vector<TicketEntry> entries;
  };
  // The view of the ticket acquired at one layer, and the arrays behind it.
  struct Acquired {
    std::uint64_t ticket = 0;
    std::vector<int> slots;
    std::vector<SeqId> seq_ids;
    std::vector<std::int64_t> seq_len;
    std::vector<std::int32_t> indptr, slot, block, valid;
  };

  int selectable_local(std::int32_t j) const noexcept {
    return layout_.sink_blocks + layout_.ring_blocks + j;
  }

  void check_layer(int layer, const char* call) const { oasiskv::check_layer(layout_, layer, call); }
  int slot_of(SeqId id, const char* call) const { return oasiskv::slot_of(table_, id, call); }
  std::vector<int> resolve(std::span<const SeqId> batch, const char* call) const {
    return resolve_batch(table_, batch, call);
  }

  // Shape, element type, null pointer, and that every value is finite (the rows are on the host).
  void check_rows(const RowsView& r, const char* name, std::int64_t expected_rows, const char* call,
                  bool allow_float) const {
    check_rows_shape(r, dtype_of_v<T>, name, expected_rows, call, allow_float);
    const auto& s = layout_.config.shape;
    const int width = (name[0] == 'q' ? s.num_q_heads : s.num_kv_heads) * s.head_dim;
    const std::size_t n = static_cast<std::size_t>(expected_rows) * static_cast<std::size_t>(width);
    if (const std::int64_t j = find_non_finite(r.data, r.dtype, n); j >= 0) {
      fail("{}: {} holds a non-finite value ({}) at element {}", call, name,
           load_as_float(r.data, r.dtype, static_cast<std::size_t>(j)), j);
    }
  }

  std::int64_t check_query_rows(const RowsView& q, std::size_t batch, const char* call) const {
    const std::int64_t per_sequence = query_rows_per_sequence(q, batch, call);
    check_rows(q, "q", q.rows, call, true);
    return per_sequence;
  }

  void check_not_in_flight(const std::vector<int>& slots, int layer, const char* call) const {
    const auto& a = acquired_[static_cast<std::size_t>(layer)];
    oasiskv::check_not_in_flight(table_, a.ticket, a.slots, slots, layer, call);
  }

  void check_fresh(const Ticket& t, const char* call) const { check_ticket_fresh(table_, t, call); }

  // Lookahead queries of kv head h's group for batch entry i, as floats: [rows][group][head_dim].
  void gather_queries(const RowsView& q, std::size_t i, std::int64_t rows, int h) {
    gather_queries(q, i, rows, h, queries_);
  }
  void gather_queries(const RowsView& q, std::size_t i, std::int64_t rows, int h,
                      std::vector<float>& queries_) const {
    const auto& s = layout_.config.shape;
    const int G = layout_.group_size;
    const int d = s.head_dim;
    queries_.resize(static_cast<std::size_t>(rows * G * d));
    std::size_t o = 0;
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t row = static_cast<std::int64_t>(i) * rows + r;
      for (int g = 0; g < G; ++g) {
        const std::size_t base = static_cast<std::size_t>((row * s.num_q_heads + h * G + g) * d);
        for (int c = 0; c < d; ++c) queries_[o++] = load_as_float(q.data, q.dtype, base + static_cast<std::size_t>(c));
      }
    }
  }

  void build_view(const Ticket& ticket, const TicketRecord& record, Acquired& a) {
    const int H = layout_.config.shape.num_kv_heads;
    const int S = layout_.sink_blocks;
    const int K = layout_.selectable_blocks;
    const std::int64_t bt = layout_.config.block_tokens;
    a.ticket = ticket.id;
    a.slots.clear();
    a.seq_ids.assign(ticket.sequences.begin(), ticket.sequences.end());
    a.seq_len.clear();
    a.indptr.assign(1, 0);
    a.slot.clear();
    a.block.clear();
    a.valid.clear();
    std::vector<std::int32_t> chosen;
    for (const auto& e : record.entries) {
      const std::int64_t len = table_.length(e.slot, ticket.layer);
      const std::int64_t nb = layout_.blocks_for(len);
      const std::int64_t ring_first = layout_.ring_start(len);
      a.slots.push_back(e.slot);
      a.seq_len.push_back(len);
      for (int h = 0; h < H; ++h) {
        auto add = [&](std::int64_t b, int local) {
          a.slot.push_back(device_.slot_id(e.slot, h, local));
          a.block.push_back(static_cast<std::int32_t>(b));
          a.valid.push_back(static_cast<std::int32_t>(std::min(bt, len - b * bt)));
        };
        for (std::int64_t b = 0; b < std::min<std::int64_t>(S, nb); ++b) add(b, static_cast<int>(b));
        chosen.clear();
        for (int j = 0; j < K; ++j) {
          const std::int32_t b = e.residency[static_cast<std::size_t>(h * K + j)];
          if (b != kNoBlock && b >= S && b < ring_first) chosen.push_back(j);
        }
        std::sort(chosen.begin(), chosen.end(), [&](std::int32_t x, std::int32_t y) {
          return e.residency[static_cast<std::size_t>(h * K + x)] < e.residency[static_cast<std::size_t>(h * K + y)];
        });
        for (std::int32_t j : chosen) add(e.residency[static_cast<std::size_t>(h * K + j)], selectable_local(j));
        for (std::int64_t b = ring_first; b < nb; ++b) add(b, layout_.pinned_slot(b));
        a.indptr.push_back(static_cast<std::int32_t>(a.slot.size()));
      }
    }
  }

  LayerView<T> view_of(int layer) const {
    const auto& a = acquired_[static_cast<std::size_t>(layer)];
    LayerView<T> v;
    v.layer = layer;
    v.batch_size = static_cast<int>(a.slots.size());
    v.num_kv_heads = layout_.config.shape.num_kv_heads;
    v.head_dim = layout_.config.shape.head_dim;
    v.block_tokens = layout_.config.block_tokens;
    v.seq_ids = a.seq_ids.data();
    v.seq_len = a.seq_len.data();
    v.indptr = a.indptr.data();
    v.slot = a.slot.data();
    v.block = a.block.data();
    v.valid_tokens = a.valid.data();
    v.pool = device_.layer_pool(layer);
    v.slot_stride = layout_.block_elems;
    return v;
  }

  // Forgets tickets that can never be acquired: a sequence gone, or a newer plan served.
  void sweep_tickets() {
    for (auto it = tickets_.begin(); it != tickets_.end();) {
      const bool current = acquired_[static_cast<std::size_t>(it->second.layer)].ticket == it->first;
      const bool dead = !current && std::any_of(it->second.entries.begin(), it->second.entries.end(),
                                                [&](const TicketEntry& e) {
                                                  return !table_.alive(e.slot, e.generation) ||
                                                         e.plan_index <= table_.acquired_plan(e.slot, it->second.layer);
                                                });
      it = dead ? tickets_.erase(it) : std::next(it);
    }
  }

  CacheLayout layout_;
  HostTier<T> host_;
  DeviceTier<Backend, T> device_;
  SummaryStore summaries_;
  BlockTable table_;
  LookaheadSelector selector_;
  TransferPlanner planner_;
  PrefetchPipeline<Backend> pipeline_;
  std::map<std::uint64_t, TicketRecord> tickets_;
  std::uint64_t next_ticket_ = 1;
  std::vector<Acquired> acquired_;
  Statistics stats_;
  // Scratch reused by every step.
  std::vector<float> queries_, scores_;
  std::vector<std::int32_t> selected_;
  TransferPlan plan_;
};

}  // namespace v0
}  // namespace oasiskv
