// CpuEngine<T>: the CPU backend of Cache<cpu, T>. Everything in host memory: the host tier, the
// slot pool, the summaries, the residency of the selectable slots; scoring, top-K and planning run
// at prefetch on the calling thread (or as tasks on the engine's pool: CpuOptions::parallel_for),
// the block copies on a CopyWorker thread (or in the caller) once the Cache's gate opens. It
// defines correctness: the CUDA engine selects, plans and copies exactly the same blocks.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "oasiskv/admission.hpp"

#include "oasiskv/backend.hpp"
#include "oasiskv/cache_engine.hpp"
#include "oasiskv/config.hpp"
#include "oasiskv/cpu/detail/copy_worker.hpp"
#include "oasiskv/cpu/detail/cpu_kernels.hpp"
#include "oasiskv/cpu/detail/lookahead_selector.hpp"
#include "oasiskv/cpu/detail/remainder/make_remainder_store.hpp"
#include "oasiskv/cpu/detail/summary_store.hpp"
#include "oasiskv/cpu/isa.hpp"
#include "oasiskv/cpu/parallel_for.hpp"
#include "oasiskv/dtype.hpp"
#include "oasiskv/error.hpp"
#include "oasiskv/kit/block_source.hpp"
#include "oasiskv/kit/host_block_pool.hpp"
#include "oasiskv/kit/tier.hpp"
#include "oasiskv/kit/transfer_plan.hpp"
#include "oasiskv/remote_blocks.hpp"
#include "oasiskv/view.hpp"

namespace oasiskv {
inline namespace v0 {

struct CpuOptions {
  // Where a plan's block copies run once the Cache's gate opens: on a worker thread of the cache's
  // own (true), so they overlap the engine's work; or (false) in the thread that opens the gate
  // (release, prefetch), before that call returns. A host whose cores the engine's own threads
  // already fill has no core for the worker: acquire then waits for the scheduler to run it, and
  // copying in the caller is faster (docs/performance.md measures both).
  bool copy_thread = true;
  // The engine's thread pool (parallel_for.hpp): prefetch plans each (sequence, kv head) as one of
  // its tasks, and copies that run in the caller are split over it. Empty: the calling thread.
  ParallelFor parallel_for{};
};

template <KvElement T>
class CpuEngine {
 public:
  using element_type = T;
  using Options = CpuOptions;
  using HostTier = oasiskv::HostTier<T>;
  static_assert(BlockSource<HostTier, T>);

  // One admitted block of a plan: its kv head, logical block and destination slot. The host
  // address is resolved when the copy starts: a copy on write may have moved the block since.
  struct PlannedCopy {
    int kv_head = 0;
    std::int32_t block = 0;
    T* dst = nullptr;
  };
  // A plan of one prefetch: per sequence, the copies and the residency after them ([kv head]
  // [the head's selectable blocks]).
  struct Plan {
    std::uint64_t ticket = 0;
    int layer = 0;
    std::vector<PlanEntry> entries;
    std::vector<std::vector<PlannedCopy>> copies;
    std::vector<std::vector<std::int32_t>> residency;
  };

  CpuEngine(const CacheLayout& layout, const Options& options)
      : layout_(layout),
        host_(layout, MemoryReservation(HostTier::bytes_for(layout))),
        slots_(layout, MemoryReservation(SlotPool<T>::bytes_for(layout))),
        summaries_(layout),
        remainder_(detail::make_remainder_store<T>(layout, host_, summaries_)),
        selector_(layout),
        block_(static_cast<std::size_t>(layout.residency_entries), kNoBlock),
        last_selected_(static_cast<std::size_t>(layout.residency_entries), -1),
        counters_(static_cast<std::size_t>(layout.num_layers())),
        views_(static_cast<std::size_t>(layout.num_layers())),
        remote_(static_cast<std::size_t>(layout.config.max_sequences)),
        staged_(static_cast<std::size_t>(layout.config.max_sequences)),
        worker_(layout.config.max_sequences, layout.num_layers(), options.copy_thread, options.parallel_for),
        parallel_for_(options.parallel_for) {
    // An OASISKV_CPU_ISA the kernels cannot honour (a typo, a level this CPU lacks) is refused here,
    // naming it, rather than running at another level than the one asked for.
    static_cast<void>(cpu_isa());
  }

  const HostTier& host_tier() const noexcept { return host_; }
  const SlotPool<T>& slot_pool() const noexcept { return slots_; }
  const SummaryStore& summaries() const noexcept { return summaries_; }
  // What CacheConfig::remainder keeps (cpu/detail/remainder/), or null with `none`.
  const detail::RemainderStore<T>* remainder_store() const noexcept { return remainder_.get(); }
  // Residency of the selectable slots after every plan made so far (copies may be pending).
  std::span<const std::int32_t> planned_blocks(int slot, int layer, int kv_head) const noexcept {
    return std::span(block_).subspan(static_cast<std::size_t>(layout_.residency_offset(slot, layer, kv_head)),
                                     static_cast<std::size_t>(layout_.head_selectable_blocks(layer, kv_head)));
  }
  // Plans queued or running on the copy worker.
  std::size_t copies_in_flight() const { return worker_.in_flight(); }

  // ---- hooks (cache_engine.hpp) ----

  // No query row can stand for more tokens than a sequence holds: the cap lets the Cache refuse an
  // overstated RowsView before it reads a byte of it.
  std::int64_t max_query_rows() const noexcept { return layout_.config.max_tokens_per_sequence; }
  int max_live_tickets_per_layer() const noexcept { return 0; }
  void enter(const char* /*call*/, CallKind /*kind*/) const noexcept {}
  std::uint64_t capture_id() const noexcept { return 0; }
  void synchronize() { worker_.drain(); }

  // The rows are on the host: every value must be finite.
  void check_input(const RowsView& r, const char* name, const char* call, std::int64_t elements) const {
    if (const std::int64_t j = detail::find_non_finite(r.data, r.dtype, static_cast<std::size_t>(elements)); j >= 0) {
      fail("{}: {} holds a non-finite value ({}) at element {}", call, name,
           load_as_float(r.data, r.dtype, static_cast<std::size_t>(j)), j);
    }
  }

  void sequence_added(int slot, std::uint32_t generation) {
    worker_.reset_sequence(slot, generation);
    if (remainder_) remainder_->reset(slot);
  }
  void sequence_removed(int slot, std::uint32_t generation) {
    worker_.reset_sequence(slot, generation);
    for (int l = 0; l < layout_.num_layers(); ++l) clear_residency(slot, l);
    remote_[static_cast<std::size_t>(slot)] = {};  // the last holder releases the remote request
    staged_[static_cast<std::size_t>(slot)] = {};
  }
  // Why the sequence's remote reads failed (its views may miss blocks), or empty.
  std::string sequence_failure(int slot) const { return worker_.failure(slot); }

  // ---- remote tier (remote_blocks.hpp) ----

  // A sequence admitted from another process (Cache::admit checked the message and the pool): its
  // sinks and recent ring local (host pool and pinned slots, from the message's rows), its other
  // prompt blocks remote, read from `source` by the copies of its plans; the rest of the working
  // set serves the first plans' copies, straight from the message (Cache::admit makes those plans
  // before it returns; finish_admission forgets the rows).
  void admit(int slot, const AdmissionMessage& m, std::shared_ptr<RemoteBlockSource> source) {
    const int H = layout_.num_kv_heads();
    const std::int64_t nb = layout_.blocks_for(m.length);
    const auto local = [&](std::int64_t b) { return layout_.pinned_block(b, m.length); };
    for (std::int64_t b = 0; b < nb; ++b) host_.pool().map_next(slot, !local(b));
    const auto bytes = static_cast<std::size_t>(layout_.block_elems) * sizeof(T);
    const auto summary_floats = static_cast<std::size_t>(nb) * 2 * static_cast<std::size_t>(layout_.head_dim());
    const auto run_floats = static_cast<std::size_t>(nb) * static_cast<std::size_t>(layout_.score.runs) *
                            static_cast<std::size_t>(layout_.head_dim());  // 0 without the runs scorer
    Staged& st = staged_[static_cast<std::size_t>(slot)];
    std::size_t listed = 0;
    for (int l = 0; l < layout_.num_layers(); ++l) {
      for (int h = 0; h < H; ++h) {
        const std::size_t p = static_cast<std::size_t>(l) * static_cast<std::size_t>(H) + static_cast<std::size_t>(h);
        summaries_.assign_blocks(slot, l, h, nb, m.summaries.data() + p * summary_floats);
        summaries_.assign_run_blocks(slot, l, h, nb, m.run_sums.data() + p * run_floats);
        for (std::int32_t j = 0; j < m.working_set_counts[p]; ++j, ++listed) {
          const std::int32_t b = m.working_set_blocks[listed];
          const std::byte* rows = m.working_set_rows.data() + listed * bytes;
          if (local(b)) {
            std::memcpy(host_.block(slot, l, h, b), rows, bytes);
            std::memcpy(slots_.slot(l, layout_.slot_id(slot, l, h, layout_.pinned_slot(b))), rows, bytes);
          } else {
            st.emplace(std::tuple(l, h, b), rows);
          }
        }
      }
    }
    if (remainder_) remainder_->admit(slot, m);  // check_admission: the message carries what it needs
    remote_[static_cast<std::size_t>(slot)] = RemoteBlocks{std::move(source), m.block_addresses};
  }
  // The admission's first plans are made and their copies started: later plans read the blocks
  // the working set held remotely.
  void finish_admission(int slot) { staged_[static_cast<std::size_t>(slot)] = {}; }
  // The admission message's lookahead queries, as the planning of Cache::admit reads them: here.
  const float* admission_queries(std::span<const float> q) const noexcept { return q.data(); }
  void reset_layer(int layer) {
    worker_.drain();  // copies already started land before the slots are declared free
    for (int s = 0; s < layout_.config.max_sequences; ++s) clear_residency(s, layer);
  }

  void truncate(int slot, int layer, std::int64_t old_length, std::int64_t length) {
    (void)old_length;
    worker_.drain();  // no copy still reads the rows that later appends will overwrite
    const std::int64_t cut = length / layout_.block_tokens();  // the first block whose rows change or vanish
    for (int h = 0; h < layout_.num_kv_heads(); ++h) {
      refold_partial(slot, layer, h, length);
      // The recent ring of the new length, from the host tier (its slots held newer blocks).
      fill_pinned(slot, layer, h, std::max<std::int64_t>(layout_.ring_start(length), layout_.sink_blocks), length);
      const SlotResidency res = residency_of(slot, layer, h);
      for (std::size_t j = 0; j < res.block.size(); ++j) {
        if (res.block[j] != kNoBlock && res.block[j] >= cut) {
          res.block[j] = kNoBlock;
          res.last_selected[j] = -1;
        }
      }
    }
    if (remainder_) remainder_->truncated(slot, layer, length);
  }

  // ---- host pool (host_block_pool.hpp) ----

  // Copy on write: the fresh block gets the shared one's rows (every layer). A copy in flight may
  // be reading the shared block for this sequence (the block can be full at another layer), and
  // the other holder may write it once this one moved off: the worker drains first.
  void map_blocks(std::span<const AppendEntry> entries, std::vector<BlockRemap>& changes) {
    if (host_.pool().copies_on_write(entries) > 0) worker_.drain();
    const std::size_t first = changes.size();
    host_.pool().map_for_append(entries, changes);
    for (std::size_t i = first; i < changes.size(); ++i) {
      const BlockRemap& r = changes[i];
      if (r.from != kNoHostBlock) {
        std::memcpy(host_.pool_block(r.to, 0, 0), host_.pool_block(r.from, 0, 0), host_.pool_block_bytes());
      }
    }
  }
  void undo_blocks(std::span<const BlockRemap> changes) { host_.pool().undo(changes); }
  // No copy reads the slot's blocks any more: truncate drained the worker, and removal reset it.
  void release_blocks(int slot, std::int64_t first_block) { host_.pool().release_from(slot, first_block); }

  // dst (a fresh sequence) becomes the first `length` tokens of src: blocks shared, summaries
  // copied (the partial block's refolded from its first rows), pinned slots filled.
  void fork(int src, int dst, std::int64_t length) {
    const std::int64_t nb = layout_.blocks_for(length);
    const std::int64_t cut = length / layout_.block_tokens();
    host_.pool().share(src, dst, nb);
    remote_[static_cast<std::size_t>(dst)] = remote_[static_cast<std::size_t>(src)];  // remote blocks are shared too
    for (int l = 0; l < layout_.num_layers(); ++l) {
      for (int h = 0; h < layout_.num_kv_heads(); ++h) {
        summaries_.copy_blocks(src, dst, l, h, cut);
        refold_partial(dst, l, h, length);
        fill_pinned(dst, l, h, 0, std::min<std::int64_t>(length, layout_.sink_blocks * layout_.block_tokens()));
        fill_pinned(dst, l, h, std::max<std::int64_t>(layout_.ring_start(length), layout_.sink_blocks), length);
      }
      if (remainder_) remainder_->forked(src, dst, l, length);
    }
  }

  // Per (sequence, block) run of rows, one kernel call for every kv head (detail::append_rows):
  // the rows to the host tier (streaming stores), through to the pinned slots, folded into the
  // summaries. A (layer, kv head)'s host block, slot and summary are each a fixed stride from
  // the previous head's.
  void append(int layer, std::span<const AppendEntry> entries, RowsView k, RowsView v) {
    const int H = layout_.num_kv_heads();
    const int d = layout_.head_dim();
    const std::int64_t bt = layout_.block_tokens();
    const T* kp = static_cast<const T*>(k.data);
    const T* vp = static_cast<const T*>(v.data);
    detail::AppendRows<T> a;
    a.row_stride = static_cast<std::int64_t>(H) * d;
    a.heads = H;
    a.d = d;
    a.value_offset = bt * d;
    a.host_head_stride = layout_.block_elems;
    a.slot_head_stride = static_cast<std::int64_t>(layout_.budget_blocks) * layout_.block_elems;
    a.summary_head_stride = layout_.summary_stride;
    std::int64_t row = 0;
    for (const AppendEntry& e : entries) {
      const std::int64_t end = e.length + e.rows;
      // Rows of blocks still pinned after this append are written through to their slots.
      const std::int64_t ring_first = layout_.ring_start(end);
      for (std::int64_t pos = e.length; pos < end;) {
        const std::int64_t b = pos / bt;
        const std::int64_t off = pos % bt;
        const std::int64_t n = std::min(end - pos, bt - off);  // rows of this block
        const bool pinned = b < layout_.sink_blocks || b >= ring_first;
        a.key = kp + row * a.row_stride;
        a.value = vp + row * a.row_stride;
        a.rows = static_cast<int>(n);
        a.host = host_.block(e.slot, layer, 0, b) + off * d;
        a.slot =
            pinned ? slots_.slot(layer, layout_.slot_id(e.slot, layer, 0, layout_.pinned_slot(b))) + off * d : nullptr;
        a.summary = summaries_.mutable_block(e.slot, layer, 0, b);
        a.reset_first = off == 0;
        if (!layout_.profiled()) {
          detail::append_rows(a);
        } else {
          // The heads' slots are no fixed stride apart: one head per call.
          detail::AppendRows<T> one = a;
          one.heads = 1;
          for (int h = 0; h < H; ++h) {
            one.key = a.key + static_cast<std::int64_t>(h) * d;
            one.value = a.value + static_cast<std::int64_t>(h) * d;
            one.host = a.host + h * a.host_head_stride;
            one.slot = pinned ? slots_.slot(layer, layout_.slot_id(e.slot, layer, h, layout_.pinned_slot(b))) + off * d
                              : nullptr;
            one.summary = a.summary + h * a.summary_head_stride;
            detail::append_rows(one);
          }
        }
        pos += n;
        row += n;
      }
    }
    detail::stream_fence();        // the streamed rows are visible before the copy worker may read them
    if (layout_.score.runs > 0) {  // the runs scorer's run sums, from the rows just written
      for (const AppendEntry& e : entries) {
        for (int h = 0; h < H; ++h) {
          for (std::int64_t pos = e.length; pos < e.length + e.rows; ++pos) {
            summaries_.add_run_key(e.slot, layer, h, pos, host_.key(e.slot, layer, h, pos));
          }
        }
      }
    }
    if (remainder_) {
      for (const AppendEntry& e : entries) remainder_->appended(e.slot, layer, e.length, e.length + e.rows);
    }
  }

  // Each (sequence, kv head) is one task (parallel_for): its scoring, top-K and plan read the
  // summaries and write only its own residency; the results are gathered in order.
  Plan plan(int layer, std::span<const PlanEntry> entries, RowsView q, std::int64_t rows, std::uint64_t ticket) {
    const int H = layout_.num_kv_heads();
    const int tasks = static_cast<int>(entries.size()) * H;
    while (static_cast<int>(head_plans_.size()) < tasks) head_plans_.push_back(std::make_unique<HeadPlan>(layout_));
    parallel_for_(tasks, [&](int t) {
      const std::size_t i = static_cast<std::size_t>(t / H);
      const int h = t % H;
      const PlanEntry& e = entries[i];
      HeadPlan& w = *head_plans_[static_cast<std::size_t>(t)];
      select(layer, e.slot, h, layout_.next_step_candidates_end(e.length, e.next_rows), q, i, rows, w.selector,
             w.queries, w.scores, w.selected);
      const SlotResidency res = residency_of(e.slot, layer, h);
      const int cap = layout_.profiled() ? layout_.admit_cap(e.first_plan ? 0 : 1, layer, h) : e.admit_cap;
      w.planner.plan(w.selected, res, cap, e.plan_index, w.plan);
      apply(w.plan, res);
    });
    auto& c = counters_[static_cast<std::size_t>(layer)];
    Plan out;
    out.ticket = ticket;
    out.layer = layer;
    out.entries.assign(entries.begin(), entries.end());
    for (std::size_t i = 0; i < entries.size(); ++i) {
      const PlanEntry& e = entries[i];
      std::vector<PlannedCopy> pc;
      std::vector<std::int32_t> residency;
      residency.reserve(static_cast<std::size_t>(layout_.layer_residency(layer)));
      for (int h = 0; h < H; ++h) {
        const TransferPlan& plan = head_plans_[i * static_cast<std::size_t>(H) + static_cast<std::size_t>(h)]->plan;
        for (const Admit& a : plan.admits) {
          pc.push_back(
              PlannedCopy{h, a.block,
                          slots_.slot(layer, layout_.slot_id(e.slot, layer, h, layout_.selectable_slot(a.slot)))});
        }
        const SlotResidency res = residency_of(e.slot, layer, h);
        residency.insert(residency.end(), res.block.begin(), res.block.end());
        c.blocks_fetched += plan.admits.size();
        c.admits_capped += static_cast<std::uint64_t>(plan.capped);
      }
      out.copies.push_back(std::move(pc));
      out.residency.push_back(std::move(residency));
    }
    return out;
  }

  // The host addresses are the block map's now; map_blocks drains the worker before a copy on
  // write, so no copy started here reads a block that moves while it runs.
  void start_copies(Plan& plan, std::span<const int> entries) {
    std::vector<PlanCopies> run;
    const auto bytes = static_cast<std::size_t>(layout_.block_elems) * sizeof(T);
    for (int i : entries) {
      const PlanEntry& e = plan.entries[static_cast<std::size_t>(i)];
      PlanCopies pc{e.slot, plan.layer, e.generation, {}, {}, {}};
      for (const PlannedCopy& c : plan.copies[static_cast<std::size_t>(i)]) {
        if (host_.pool().at(e.slot, c.block) != kRemoteBlock) {
          pc.copies.push_back(BlockCopy{host_.block(e.slot, plan.layer, c.kv_head, c.block), c.dst, bytes});
          continue;
        }
        // Staged rows exist only for an admission's first plan, which has no older plan whose
        // copies could still be queued for these slots: copied now.
        Staged& st = staged_[static_cast<std::size_t>(e.slot)];
        if (const auto it = st.find(std::tuple(plan.layer, c.kv_head, c.block)); it != st.end()) {
          std::memcpy(c.dst, it->second, bytes);
          continue;
        }
        const RemoteBlocks& r = remote_[static_cast<std::size_t>(e.slot)];
        pc.source = r.source;
        const auto head = static_cast<std::uint64_t>(plan.layer) * static_cast<std::uint64_t>(layout_.num_kv_heads()) +
                          static_cast<std::uint64_t>(c.kv_head);
        pc.remote.push_back(
            RemoteBlockRead{c.dst, r.addresses[static_cast<std::size_t>(c.block)] + head * bytes, bytes});
        counters_[static_cast<std::size_t>(plan.layer)].remote_blocks_fetched += 1;
      }
      run.push_back(std::move(pc));
    }
    worker_.submit(plan.ticket, std::move(run));
  }
  std::int64_t wait(Plan& plan) { return worker_.wait(plan.ticket); }
  void free_plan(Plan& /*plan*/) noexcept {}

  // The CSR view: per pair the sinks, the plan's blocks before the ring (ascending), the ring.
  LayerView<T> build_view(int layer, const Plan& plan, std::span<const ViewEntry> entries) {
    const int H = layout_.num_kv_heads();
    const int S = layout_.sink_blocks;
    const std::int64_t bt = layout_.block_tokens();
    View& a = views_[static_cast<std::size_t>(layer)];
    a.seq_ids.clear();
    a.seq_len.clear();
    a.indptr.assign(1, 0);
    a.slot.clear();
    a.block.clear();
    a.valid.clear();
    for (std::size_t i = 0; i < entries.size(); ++i) {
      const ViewEntry& e = entries[i];
      const std::vector<std::int32_t>& residency = plan.residency[i];
      const std::int64_t nb = layout_.blocks_for(e.length);
      const std::int64_t ring_first = layout_.ring_start(e.length);
      a.seq_ids.push_back(e.id);
      a.seq_len.push_back(e.length);
      std::size_t row_at = 0;  // the head's first entry in the plan's residency of the sequence
      for (int h = 0; h < H; ++h) {
        const int K = layout_.head_selectable_blocks(layer, h);
        auto add = [&](std::int64_t b, int local) {
          a.slot.push_back(layout_.slot_id(e.slot, layer, h, local));
          a.block.push_back(static_cast<std::int32_t>(b));
          a.valid.push_back(static_cast<std::int32_t>(std::min(bt, e.length - b * bt)));
        };
        for (std::int64_t b = 0; b < std::min<std::int64_t>(S, nb); ++b) add(b, static_cast<int>(b));
        const std::int32_t* row = residency.data() + row_at;
        row_at += static_cast<std::size_t>(K);
        chosen_.clear();
        for (int j = 0; j < K; ++j) {
          if (row[j] != kNoBlock && row[j] >= S && row[j] < ring_first) chosen_.push_back(j);
        }
        std::sort(chosen_.begin(), chosen_.end(), [&](std::int32_t x, std::int32_t y) { return row[x] < row[y]; });
        for (std::int32_t j : chosen_) add(row[j], layout_.selectable_slot(j));
        for (std::int64_t b = ring_first; b < nb; ++b) add(b, layout_.pinned_slot(b));
        a.indptr.push_back(static_cast<std::int32_t>(a.slot.size()));
      }
    }
    return make_layer_view<T>(layout_, layer,
                              ViewArrays{static_cast<int>(entries.size()), a.seq_ids.data(), a.seq_len.data(),
                                         a.indptr.data(), a.slot.data(), a.block.data(), a.valid.data()},
                              slots_.layer_pool(layer));
  }
  void release_view(int /*layer*/) noexcept {}

  // Hits: blocks the true queries would select that the acquired view holds.
  void observe(int layer, std::span<const ViewEntry> entries, RowsView q, std::int64_t rows) {
    const int H = layout_.num_kv_heads();
    const View& a = views_[static_cast<std::size_t>(layer)];
    auto& c = counters_[static_cast<std::size_t>(layer)];
    for (std::size_t i = 0; i < entries.size(); ++i) {
      for (int h = 0; h < H; ++h) {
        select(layer, entries[i].slot, h, layout_.current_candidates_end(entries[i].length), q, i, rows, selector_,
               queries_, scores_, selected_);
        const std::size_t p = i * static_cast<std::size_t>(H) + static_cast<std::size_t>(h);
        const auto begin = a.block.begin() + a.indptr[p];
        const auto end = a.block.begin() + a.indptr[p + 1];
        for (std::int32_t b : selected_) {
          if (std::binary_search(begin, end, b)) c.observed_hits += 1;
        }
      }
    }
  }

  std::vector<std::vector<std::int32_t>> select_blocks(int slot, int layer, std::int64_t length, RowsView q,
                                                       std::int64_t rows) const {
    LookaheadSelector selector(layout_);  // own scratch: this call is const
    std::vector<float> queries, scores;
    std::vector<std::vector<std::int32_t>> out(static_cast<std::size_t>(layout_.num_kv_heads()));
    for (int h = 0; h < layout_.num_kv_heads(); ++h) {
      select(layer, slot, h, layout_.next_step_candidates_end(length), q, 0, rows, selector, queries, scores,
             out[static_cast<std::size_t>(h)]);
    }
    return out;
  }

  // Cache::remainder: per batch entry and kv head, the store's estimate over the blocks of
  // [0, blocks_for(length)) that the acquired view of `layer` does not hold. out: [entries *
  // rows][q_heads][head_dim], lse: [entries * rows][q_heads]. Without a store Cache refused first.
  void remainder(int layer, std::span<const ViewEntry> entries, RowsView q, std::int64_t rows, float* out, float* lse) {
    const int H = layout_.num_kv_heads();
    const View& a = views_[static_cast<std::size_t>(layer)];
    for (std::size_t i = 0; i < entries.size(); ++i) {
      for (int h = 0; h < H; ++h) {
        const std::size_t p = i * static_cast<std::size_t>(H) + static_cast<std::size_t>(h);
        const std::span<const std::int32_t> resident(a.block.data() + a.indptr[p],
                                                     static_cast<std::size_t>(a.indptr[p + 1] - a.indptr[p]));
        remainder_->estimate(entries[i].slot, layer, h, entries[i].length, resident, q, static_cast<std::int64_t>(i),
                             rows, out, lse);
      }
    }
  }

  EngineCounters counters(int layer) const {
    EngineCounters c = counters_[static_cast<std::size_t>(layer)];
    c.copy_ns = worker_.busy_ns(layer);
    return c;
  }
  void reset_counters() {
    std::fill(counters_.begin(), counters_.end(), EngineCounters{});
    worker_.reset_busy();
  }

 private:
  // Where an admitted sequence's remote blocks are: its source and each logical block's address.
  struct RemoteBlocks {
    std::shared_ptr<RemoteBlockSource> source;
    std::vector<std::uint64_t> addresses;
  };
  // During an admission: its working-set rows of remote blocks (in the message), by (layer, kv
  // head, block).
  using Staged = std::map<std::tuple<int, int, std::int32_t>, const std::byte*>;
  struct View {
    std::vector<SeqId> seq_ids;
    std::vector<std::int64_t> seq_len;
    std::vector<std::int32_t> indptr, slot, block, valid;
  };

  SlotResidency residency_of(int slot, int layer, int h) noexcept {
    const auto off = static_cast<std::size_t>(layout_.residency_offset(slot, layer, h));
    const auto K = static_cast<std::size_t>(layout_.head_selectable_blocks(layer, h));
    return SlotResidency{std::span(block_).subspan(off, K), std::span(last_selected_).subspan(off, K)};
  }
  // The summary of the block that holds token length - 1, refolded from its rows in order (as
  // append folded them); nothing when the length is a block boundary.
  void refold_partial(int slot, int layer, int h, std::int64_t length) {
    const std::int64_t bt = layout_.block_tokens();
    for (std::int64_t pos = length / bt * bt; pos < length; ++pos) {
      summaries_.add_key(slot, layer, h, pos, host_.key(slot, layer, h, pos));
    }
  }
  // The pinned slots of blocks [first, blocks_for(end)) from the host tier.
  void fill_pinned(int slot, int layer, int h, std::int64_t first, std::int64_t end) {
    for (std::int64_t b = first; b < layout_.blocks_for(end); ++b) {
      std::memcpy(slots_.slot(layer, layout_.slot_id(slot, layer, h, layout_.pinned_slot(b))),
                  host_.block(slot, layer, h, b), static_cast<std::size_t>(layout_.block_elems) * sizeof(T));
    }
  }
  void clear_residency(int slot, int layer) {
    const auto off = static_cast<std::size_t>(layout_.residency_offset(slot, layer, 0));
    const auto n = static_cast<std::size_t>(layout_.layer_residency(layer));
    std::fill_n(block_.begin() + static_cast<std::ptrdiff_t>(off), n, kNoBlock);
    std::fill_n(last_selected_.begin() + static_cast<std::ptrdiff_t>(off), n, -1);
  }

  // Scores kv head h's candidates [sink_blocks, end) of a sequence against the queries of batch
  // entry i (its `rows` rows, every query head of the group) and takes the top K.
  void select(int layer, int slot, int h, std::int64_t end, const RowsView& q, std::size_t i, std::int64_t rows,
              LookaheadSelector& selector, std::vector<float>& queries, std::vector<float>& scores,
              std::vector<std::int32_t>& selected) const {
    const int G = layout_.group_size;
    const int d = layout_.head_dim();
    queries.resize(static_cast<std::size_t>(rows) * static_cast<std::size_t>(G) * static_cast<std::size_t>(d));
    // The group's G heads of a row are contiguous: one run of G * d elements per row.
    const auto run = static_cast<std::size_t>(G) * static_cast<std::size_t>(d);
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t row = static_cast<std::int64_t>(i) * rows + r;
      const auto base = static_cast<std::size_t>((row * layout_.num_q_heads() + h * G) * d);
      float* to = queries.data() + static_cast<std::size_t>(r) * run;
      auto convert = [&](const auto* from) {
        for (std::size_t c = 0; c < run; ++c) to[c] = to_float(from[base + c]);
      };
      switch (q.dtype) {
        case DType::f32: std::memcpy(to, static_cast<const float*>(q.data) + base, run * sizeof(float)); break;
        case DType::f16: convert(static_cast<const fp16_t*>(q.data)); break;
        case DType::bf16: convert(static_cast<const bf16_t*>(q.data)); break;
      }
    }
    const std::int64_t first = layout_.sink_blocks;
    selector.score(summaries_, slot, layer, h, first, std::max(first, end), queries.data(), static_cast<int>(rows) * G,
                   scores);
    LookaheadSelector::top_k(scores, first, layout_.head_selectable_blocks(layer, h), selected);
  }

  CacheLayout layout_;
  HostTier host_;
  SlotPool<T> slots_;
  SummaryStore summaries_;
  std::unique_ptr<detail::RemainderStore<T>> remainder_;  // CacheConfig::remainder's store, or null
  LookaheadSelector selector_;
  std::vector<std::int32_t> block_;
  std::vector<std::int64_t> last_selected_;
  std::vector<EngineCounters> counters_;  // per layer
  std::vector<View> views_;               // per layer
  std::vector<RemoteBlocks> remote_;      // per sequence slot
  std::vector<Staged> staged_;            // per sequence slot
  CopyWorker worker_;
  ParallelFor parallel_for_;
  // One (sequence, kv head) task of plan(): its selector, planner and scratch, reused every step.
  struct HeadPlan {
    explicit HeadPlan(const CacheLayout& layout) : selector(layout) {}
    LookaheadSelector selector;
    TransferPlanner planner;
    std::vector<float> queries, scores;
    std::vector<std::int32_t> selected;
    TransferPlan plan;
  };
  std::vector<std::unique_ptr<HeadPlan>> head_plans_;  // [task], made as batches first need them
  // Scratch reused by every step.
  std::vector<float> queries_, scores_;
  std::vector<std::int32_t> selected_, chosen_;
};

template <class T>
struct backend_engine<cpu, T> {
  using type = CpuEngine<T>;
};
// The optional hooks the CPU engine has (cache_engine.hpp): a drift fails here, not in a caller.
static_assert(CacheEngine<CpuEngine<float>> && AdmittingEngine<CpuEngine<float>> &&
              ReportsSequenceFailure<CpuEngine<float>> && EstimatesRemainder<CpuEngine<float>>);

}  // namespace v0
}  // namespace oasiskv
