// Cache<cuda, T>: the facade of the CUDA backend, with the CPU facade's API and semantics
// (oasiskv/cache.hpp is the specification). Host code: compiles with g++ (or nvcc without fmt
// in the same TU: see check.cuh); the kernels it enqueues are in oasiskv/cuda/ops.cuh.
//
// Status: complete; compiled (sm_80, sm_90) and tested on machines without a GPU only where no
// device is needed. tests/cuda/test_cache.cpp drives it and Cache<cpu> with the same calls and
// requires identical views, slot contents and statistics, plus a CUDA-graph capture of a decode
// step; those tests run on a GPU (scripts/gpu-check).
//
// Memory. Every pointer the decode calls take is a DEVICE pointer (cudaMalloc'd, managed, or
// mapped pinned host memory): append's k and v, prefetch's q_lookahead, observe's q_true,
// select_blocks' q. acquire's LayerView points at DEVICE memory: seq_ids, seq_len, indptr, slot,
// block, valid_tokens and pool; it is valid from acquire until release, for work ordered on the
// compute stream. The host tier is pinned and mapped (required: the constructor fails if it
// cannot be pinned).
//
// Streams. `compute_stream` (constructor) is the engine's: append, acquire's view kernels and
// observe run there, and the engine's attention must run there (or be ordered before release on
// it). The cache owns a copy stream: prefetch's scoring, top-K, planning and the gathers of
// admitted blocks (zero-copy from the pinned host tier) run there. Every call that enqueues copy
// stream work first makes the copy stream wait for the compute stream's work so far (an event):
// summaries are then ready for scoring, and a gather enqueued by release runs after the attention
// that read the victim slots.
//
// Ordering (DESIGN.md section 1). A plan of (sequence, layer) is gathered once every older plan of
// that (sequence, layer) is retired (released, superseded by acquiring a newer plan, or its
// sequence removed), exactly as PrefetchPipeline<cpu> gates its copies. The gate opens on the
// host, in release or acquire, so the gather is enqueued then: in the decode protocol
//   append; next = prefetch(q_la); acquire(prev); attention; release(prev)
// prefetch scores and plans at once, and release(prev) enqueues next's gather (the previous
// ticket's release is not yet recorded when prefetch runs, so prefetch cannot wait for it). Each
// ticket records an event after its gathers; acquire makes the compute stream wait for it and
// then builds the view on the device. There is no host synchronisation and no device-to-host copy
// in append, prefetch, acquire, release or observe.
//
// Host bookkeeping stays on the host: lengths, generations, plan numbers, tickets. Per-call
// metadata (sequence slots, lengths, row offsets, plan numbers) reaches the device as kernel
// parameters (gpu::upload_words), never through host staging memory, so a captured graph holds
// the values themselves. The residency of the selectable slots lives on the device only.
//
// Differences from Cache<cpu> (each an oasiskv::Error where it is a refusal):
//   - No finiteness check of k, v or q (device data is not read on the host). Pageable host
//     pointers are refused (cudaPointerGetAttributes), outside stream capture only.
//   - At most options.tickets_per_layer (default 2, what the decode protocol needs) tickets per
//     layer may be outstanding: prefetched and not yet released nor dead (stale, superseded and
//     drained). prefetch refuses one more, naming the outstanding tickets.
//   - prefetch and observe take at most options.max_query_rows rows per sequence (the scratch
//     buffers are sized for it at construction; graph capture allows no allocation).
//   - statistics(): blocks_fetched, bytes_fetched, admits_capped and observed_hits are counted on
//     the device and read back by statistics(), which synchronises both streams (so it is not
//     noexcept, and not allowed during capture). acquire_wait_ns stays 0: acquire does not block
//     the host (the wait is on the GPU).
//   - select_blocks is synchronous (it reads the selection back). The first observe or
//     select_blocks allocates their scratch: make one outside stream capture.
//   - remove_sequence and add_sequence enqueue a residency reset on the copy stream; they and
//     statistics/reset_statistics/select_blocks are refused during stream capture.
//
// CUDA graphs. A decode step (append, prefetch, acquire, attention, release for every layer) can
// be captured with cudaStreamBeginCapture on the compute stream:
//   cache.join();                        // eager: orders earlier copy-stream work before the graph
//   cudaStreamBeginCapture(compute, ...);
//   ... the step's cache calls and the engine's kernels on `compute` ...
//   cache.join();                        // joins the copy stream into the capture
//   cudaStreamEndCapture(compute, &graph); instantiate (or cudaGraphExecUpdate); launch on compute.
// Constraints: the host bookkeeping advances when the calls are made (during capture), so a graph
// captures exactly ONE step and must be launched exactly once, on the compute stream, before any
// later call of the cache; replaying it again would redo that step's appends and plans against
// the newer state. (Capture each step, and use cudaGraphExecUpdate to avoid re-instantiation.)
// A call during capture while eager copy-stream work is not joined is refused (call join() before
// cudaStreamBeginCapture). Forgetting the join before cudaStreamEndCapture makes it fail with
// cudaErrorStreamCaptureUnjoined.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <unordered_set>
#include <vector>

#include "oasiskv/cache.hpp"
#include "oasiskv/cuda/components.cuh"
#include "oasiskv/cuda/ops.cuh"

namespace oasiskv {
inline namespace v0 {

struct CudaCacheOptions {
  // Query rows per sequence that prefetch, observe and select_blocks accept (lookahead rows).
  int max_query_rows = 4;
  // Tickets per layer that may be outstanding (prefetched, not released, not dead).
  int tickets_per_layer = 2;
};

template <KvElement T>
class Cache<cuda, T> {
 public:
  using element_type = T;

  // compute_stream: the engine's stream (append, view building and attention run there); the
  // cache adds its own copy stream. Throws oasiskv::Error without a device, when the host tier
  // cannot be pinned, or for a bad config or options.
  explicit Cache(const CacheConfig& config, cudaStream_t compute_stream = nullptr, CudaCacheOptions options = {})
      : layout_(CacheLayout::from(config)),
        geometry_(gpu::Geometry::from(layout_)),
        options_(checked(options)),
        compute_(compute_stream),
        host_(layout_),
        device_(layout_),
        summaries_(static_cast<std::size_t>(config.max_sequences) * static_cast<std::size_t>(config.shape.num_layers) *
                   static_cast<std::size_t>(config.shape.num_kv_heads) * static_cast<std::size_t>(layout_.max_blocks) *
                   2u * static_cast<std::size_t>(config.shape.head_dim)),
        res_block_(std::max<std::size_t>(1, residency_size())),
        res_last_(std::max<std::size_t>(1, residency_size())),
        counters_(static_cast<std::size_t>(config.shape.num_layers) * 3u),
        table_(layout_),
        retired_(static_cast<std::size_t>(config.max_sequences) * static_cast<std::size_t>(config.shape.num_layers), -1) {
    if (!host_.pinned()) {
      fail("Cache<cuda>: the host tier ({} bytes) could not be pinned and mapped (see the warning above); the "
           "CUDA backend gathers blocks from it zero-copy",
           host_.bytes_reserved());
    }
    if (layout_.selectable_blocks > gpu::kMaxTopK) {
      fail("Cache<cuda>: {} selectable blocks per kv head is above the CUDA top-K limit of {}",
           layout_.selectable_blocks, gpu::kMaxTopK);
    }
    OASISKV_CUDA_CHECK(cudaMemset(res_block_.data(), 0xff, res_block_.bytes()));  // kNoBlock
    OASISKV_CUDA_CHECK(cudaMemset(res_last_.data(), 0xff, res_last_.bytes()));    // -1
    const int B = config.max_sequences, L = config.shape.num_layers;
    const std::size_t pairs = static_cast<std::size_t>(B) * static_cast<std::size_t>(config.shape.num_kv_heads);
    const std::size_t K = static_cast<std::size_t>(std::max(layout_.selectable_blocks, 1));
    scratch_ = std::make_unique<Scratch>(*this);
    append_meta_ = gpu::DeviceBuffer<std::uint32_t>(meta_words());
    records_.resize(static_cast<std::size_t>(L));
    views_.resize(static_cast<std::size_t>(L));
    acquired_.resize(static_cast<std::size_t>(L));
    for (int l = 0; l < L; ++l) {
      auto& recs = records_[static_cast<std::size_t>(l)];
      // One record more than tickets_per_layer: a dead ticket whose gathers still wait for their
      // gate keeps its record until they are enqueued.
      for (int r = 0; r < options_.tickets_per_layer + 1; ++r) {
        auto rec = std::make_unique<Record>();
        rec->meta = gpu::DeviceBuffer<std::uint32_t>(meta_words());
        rec->admits = gpu::DeviceBuffer<gpu::DeviceAdmit>(pairs * static_cast<std::size_t>(geometry_.admit_stride));
        rec->admit_count = gpu::DeviceBuffer<std::int32_t>(pairs);
        rec->capped = gpu::DeviceBuffer<std::int32_t>(pairs);
        rec->snapshot = gpu::DeviceBuffer<std::int32_t>(pairs * K);
        rec->copied = std::make_unique<gpu::Event>();
        recs.push_back(std::move(rec));
      }
      auto& v = views_[static_cast<std::size_t>(l)];
      v.meta = gpu::DeviceBuffer<std::uint32_t>(meta_words());
      v.counts = gpu::DeviceBuffer<std::int32_t>(pairs);
      v.indptr = gpu::DeviceBuffer<std::int32_t>(pairs + 1);
      const std::size_t entries = pairs * static_cast<std::size_t>(layout_.budget_blocks);
      v.slot = gpu::DeviceBuffer<std::int32_t>(entries);
      v.block = gpu::DeviceBuffer<std::int32_t>(entries);
      v.valid = gpu::DeviceBuffer<std::int32_t>(entries);
    }
    stats_.layers.resize(static_cast<std::size_t>(L));
    OASISKV_CUDA_CHECK(cudaDeviceSynchronize());  // the memsets above, before any stream uses them
  }

  ~Cache() {
    // Work in flight reads and writes memory that is about to be freed.
    (void)cudaStreamSynchronize(copy_.get());
    (void)cudaStreamSynchronize(compute_);
    (void)cudaGetLastError();
  }
  Cache(const Cache&) = delete;
  Cache& operator=(const Cache&) = delete;

  const CacheLayout& layout() const noexcept { return layout_; }
  const CudaCacheOptions& options() const noexcept { return options_; }
  // The pinned host tier (the source of truth). Rows are written by the GPU: synchronise the
  // compute stream before reading them on the host.
  const gpu::PinnedHostTier<T>& host_tier() const noexcept { return host_; }
  const DeviceTier<cuda, T>& device_tier() const noexcept { return device_; }
  // Host bookkeeping: ids, generations, lengths, plan numbers. Its residency arrays are NOT used
  // by the CUDA backend (the residency lives on the device).
  const BlockTable& block_table() const noexcept { return table_; }
  cudaStream_t compute_stream() const noexcept { return compute_; }
  cudaStream_t copy_stream() const noexcept { return copy_.get(); }

  // ---- sequence lifecycle (host bookkeeping, as the CPU facade) --------------------------------

  void add_sequence(SeqId id) {
    if (table_.find(id) >= 0) fail("add_sequence: sequence {} is already in the cache", id);
    if (table_.free_slots() == 0) {
      fail("add_sequence: cannot add sequence {}: all {} sequence slots are in use (max_sequences)", id,
           layout_.config.max_sequences);
    }
    refuse_capture("add_sequence");
    const int s = table_.add(id);
    reset_retired(s);
  }

  // Drops the sequence; its tickets become stale and its pending gathers are dropped. Refused
  // while its attention is in flight.
  void remove_sequence(SeqId id) {
    const int s = slot_of(id, "remove_sequence");
    for (std::size_t l = 0; l < acquired_.size(); ++l) {
      const auto& a = acquired_[l];
      if (a.ticket != 0 && std::find(a.slots.begin(), a.slots.end(), s) != a.slots.end()) {
        fail("remove_sequence: sequence {} is in ticket {}, acquired at layer {}: release it first", id, a.ticket, l);
      }
    }
    refuse_capture("remove_sequence");
    capture_ = 0;
    // The slot's residency goes back to empty, after every plan already queued on the copy stream.
    fork();
    const std::size_t n = static_cast<std::size_t>(layout_.config.shape.num_layers) *
                          static_cast<std::size_t>(layout_.config.shape.num_kv_heads) *
                          static_cast<std::size_t>(layout_.selectable_blocks);
    if (n > 0) {
      const std::size_t off = static_cast<std::size_t>(s) * n;
      OASISKV_CUDA_CHECK(cudaMemsetAsync(res_block_.data() + off, 0xff, n * sizeof(std::int32_t), copy_.get()));
      OASISKV_CUDA_CHECK(cudaMemsetAsync(res_last_.data() + off, 0xff, n * sizeof(std::int64_t), copy_.get()));
    }
    table_.remove(s);
    reset_retired(s);
    sweep_tickets();
  }

  bool has_sequence(SeqId id) const noexcept { return table_.find(id) >= 0; }
  std::size_t num_sequences() const noexcept { return table_.num_sequences(); }
  std::int64_t sequence_length(SeqId id, int layer) const {
    check_layer(layer, "sequence_length");
    return table_.length(slot_of(id, "sequence_length"), layer);
  }

  // ---- append -------------------------------------------------------------------------------

  // Appends rows_per_seq[i] rows to batch[i] at `layer`. k and v: DEVICE pointers to
  // [total rows][kv_heads][head_dim] of element type T, rows in batch order. Runs on the compute
  // stream; rows_per_seq is read on the host.
  void append(std::span<const SeqId> batch, int layer, std::span<const std::int32_t> rows_per_seq, RowsView k,
              RowsView v) {
    constexpr const char* call = "append";
    capture_ = capture_id();
    check_layer(layer, call);
    const std::vector<int> slots = resolve(batch, call);
    const std::int64_t total =
        append_row_total(table_, layout_, batch, slots, layer, rows_per_seq, call);
    if (total > INT32_MAX) fail("append: {} rows in one call, more than {}", total, INT32_MAX);
    check_rows(k, "k", total, call, false);
    check_rows(v, "v", total, call, false);
    check_not_in_flight(slots, layer, call);
    check_capture_ready(call);
    if (total == 0) return;

    Words w;
    std::vector<std::int32_t> seq_slot(slots.begin(), slots.end());
    std::vector<std::int64_t> before;
    std::vector<std::int32_t> offset{0};
    for (std::size_t i = 0; i < batch.size(); ++i) {
      before.push_back(table_.length(slots[i], layer));
      offset.push_back(offset.back() + rows_per_seq[i]);
    }
    const std::size_t o_slot = w.add(seq_slot), o_len = w.add(before), o_off = w.add(offset);
    gpu::upload_words(append_meta_.data(), w.words, compute_);
    const gpu::DeviceBatch dbatch{static_cast<int>(batch.size()), at<std::int32_t>(append_meta_, o_slot),
                                  at<std::int64_t>(append_meta_, o_len)};
    gpu::append<T>(geometry_, layer, dbatch, at<std::int32_t>(append_meta_, o_off), static_cast<const T*>(k.data),
                   static_cast<const T*>(v.data), host_.device_base(), device_.layer_pool(layer), summaries_.data(),
                   compute_);
    for (std::size_t i = 0; i < batch.size(); ++i) {
      table_.set_length(slots[i], layer, before[i] + rows_per_seq[i]);
    }
  }

  // One row per sequence (a decode step).
  void append(std::span<const SeqId> batch, int layer, RowsView k, RowsView v) {
    const std::vector<std::int32_t> ones(batch.size(), 1);
    append(batch, layer, ones, k, v);
  }

  // ---- prefetch -----------------------------------------------------------------------------

  // Plans the resident set of the next step at `layer` from the lookahead queries (DEVICE
  // pointer) q_lookahead: [batch * R][num_q_heads][head_dim], 1 <= R <= options.max_query_rows,
  // element type T or float. Scoring, top-K and planning are enqueued now on the copy stream; the
  // gathers once the previous plans of these sequences at this layer are retired.
  Ticket prefetch(std::span<const SeqId> batch, int layer, RowsView q_lookahead) {
    constexpr const char* call = "prefetch";
    capture_ = capture_id();
    check_layer(layer, call);
    const std::vector<int> slots = resolve(batch, call);
    const std::int64_t rows = check_query_rows(q_lookahead, batch.size(), call);
    check_capture_ready(call);
    Record* rec = free_record(layer);

    const int B = static_cast<int>(batch.size());
    const int H = layout_.config.shape.num_kv_heads;
    const int K = layout_.selectable_blocks;
    auto& st = stats_.layers[static_cast<std::size_t>(layer)];
    Ticket ticket;
    ticket.id = next_ticket_;
    ticket.layer = layer;
    std::vector<Entry> entries;
    std::vector<std::int32_t> seq_slot;
    std::vector<std::int64_t> lens, steps;
    std::uint64_t selected = 0;
    for (std::size_t i = 0; i < batch.size(); ++i) {
      const int s = slots[i];
      const std::int64_t len = table_.length(s, layer);
      ticket.sequences.push_back(batch[i]);
      ticket.generations.push_back(table_.generation(s));
      entries.push_back(Entry{s, table_.generation(s), table_.next_plan(s, layer), State::pending});
      seq_slot.push_back(s);
      lens.push_back(len);
      steps.push_back(table_.next_plan(s, layer));
      const std::int64_t n = geometry_.candidates_end(len) - layout_.sink_blocks;
      selected += static_cast<std::uint64_t>(H) * static_cast<std::uint64_t>(std::min<std::int64_t>(K, n));
    }
    Words w;
    rec->o_slot = w.add(seq_slot);
    rec->o_len = w.add(lens);
    const std::size_t o_steps = w.add(steps);
    fork();
    gpu::upload_words(rec->meta.data(), w.words, copy_.get());
    const gpu::DeviceBatch dbatch = rec->batch(B);
    if (K > 0) {
      Scratch& sc = *scratch_;
      const gpu::ScoreBuffers sb{sc.scores.data(), sc.count.data(), sc.first.data(), sc.bounds.data(), sc.stride};
      if (q_lookahead.dtype == DType::f32) {
        gpu::score_blocks<float>(geometry_, layer, dbatch, static_cast<const float*>(q_lookahead.data),
                                 static_cast<int>(rows), summaries_.data(), sb, copy_.get());
      } else {
        gpu::score_blocks<T>(geometry_, layer, dbatch, static_cast<const T*>(q_lookahead.data), static_cast<int>(rows),
                             summaries_.data(), sb, copy_.get());
      }
      gpu::segmented_top_k(sc.scores.data(), sc.stride, sc.count.data(), sc.first.data(), B * H, K, sc.sel.data(),
                           sc.sel_count.data(), copy_.get());
      gpu::plan_transfers(geometry_, layer, dbatch, at<std::int64_t>(rec->meta, o_steps), sc.sel.data(),
                          sc.sel_count.data(), K, res_block_.data(), res_last_.data(),
                          gpu::PlanBuffers{rec->admits.data(), rec->admit_count.data(), nullptr, nullptr,
                                           rec->capped.data()},
                          copy_.get());
      gpu::snapshot_plans(geometry_, layer, dbatch, res_block_.data(), rec->snapshot.data(), rec->admit_count.data(),
                          rec->capped.data(), counters_.data() + 3 * layer, copy_.get());
    }
    // The plan is made (on the device): commit the host bookkeeping.
    ++next_ticket_;
    for (int s : slots) table_.advance_plan(s, layer);
    st.plans += static_cast<std::uint64_t>(B) * static_cast<std::uint64_t>(H);
    st.blocks_selected += selected;
    rec->ticket = ticket.id;
    rec->live = true;
    rec->entries = std::move(entries);
    rec->copied_recorded = false;
    tickets_.emplace(ticket.id, TicketInfo{layer, rec});
    pump(layer);
    return ticket;
  }

  // ---- acquire / release --------------------------------------------------------------------

  // Makes the compute stream wait for the ticket's gathers and builds, on the device, the
  // resident working set of its sequences at its layer: sinks, the plan's selected blocks, and
  // the recent ring (with this step's rows). Every array of the view is DEVICE memory. Older
  // unacquired tickets of the same sequences and layer are superseded. Does not block the host.
  LayerView<T> acquire(const Ticket& ticket) {
    constexpr const char* call = "acquire";
    capture_ = capture_id();
    if (ticket.id == 0) {
      fail("acquire: empty ticket (layer {}): call prefetch for this layer before acquire", ticket.layer);
    }
    check_layer(ticket.layer, call);
    check_fresh(ticket, call);
    auto& acq = acquired_[static_cast<std::size_t>(ticket.layer)];
    if (acq.ticket != 0) {
      fail("acquire: layer {} already has ticket {} acquired; release it before acquiring ticket {}", ticket.layer,
           acq.ticket, ticket.id);
    }
    auto it = tickets_.find(ticket.id);
    if (it == tickets_.end() || it->second.layer != ticket.layer) {
      fail("acquire: ticket {} (layer {}) is unknown, already released, or superseded by a newer ticket", ticket.id,
           ticket.layer);
    }
    Record& rec = *it->second.record;
    for (const auto& e : rec.entries) {
      if (e.plan_index <= table_.acquired_plan(e.slot, ticket.layer)) {
        fail("acquire: ticket {} is superseded: sequence {} at layer {} already served a newer plan", ticket.id,
             table_.id(e.slot), ticket.layer);
      }
    }
    check_capture_ready(call);

    const int layer = ticket.layer;
    for (const auto& e : rec.entries) {
      table_.set_acquired_plan(e.slot, layer, e.plan_index);
      retire(e.slot, layer, e.plan_index - 1);
    }
    pump(layer);  // every plan of this ticket is now gathered (enqueued)
    if (rec.copied_recorded && rec.copied_capture == capture_) rec.copied->wait_on(compute_);
    // (A gather event from before this capture, or from a captured step, is already ordered:
    // see join() and the graph rules in the header comment.)

    const int B = static_cast<int>(rec.entries.size());
    Words w;
    std::vector<SeqId> ids;
    std::vector<std::int64_t> lens;
    std::vector<std::int32_t> seq_slot;
    acq.slots.clear();
    acq.seq_len.clear();
    for (const auto& e : rec.entries) {
      ids.push_back(table_.id(e.slot));
      lens.push_back(table_.length(e.slot, layer));
      seq_slot.push_back(e.slot);
      acq.slots.push_back(e.slot);
      acq.seq_len.push_back(lens.back());
    }
    auto& vb = views_[static_cast<std::size_t>(layer)];
    const std::size_t o_ids = w.add(ids), o_len = w.add(lens), o_slot = w.add(seq_slot);
    gpu::upload_words(vb.meta.data(), w.words, compute_);
    vb.seq_ids = at<SeqId>(vb.meta, o_ids);
    vb.seq_len = at<std::int64_t>(vb.meta, o_len);
    vb.seq_slot = at<std::int32_t>(vb.meta, o_slot);
    vb.batch_size = B;
    gpu::build_view(geometry_, gpu::DeviceBatch{B, vb.seq_slot, vb.seq_len}, rec.snapshot.data(), vb.counts.data(),
                    vb.indptr.data(), vb.slot.data(), vb.block.data(), vb.valid.data(), compute_);
    acq.ticket = ticket.id;
    acq.record = &rec;
    stats_.layers[static_cast<std::size_t>(layer)].acquires += 1;
    sweep_tickets();
    return view_of(layer);
  }

  // Ends attention over an acquired ticket (the engine's attention must be ordered before this
  // call on the compute stream): newer plans of its sequences may now overwrite its slots, and
  // their gathers are enqueued on the copy stream, after the compute stream's work so far.
  void release(const Ticket& ticket) {
    check_layer(ticket.layer, "release");
    auto& acq = acquired_[static_cast<std::size_t>(ticket.layer)];
    if (ticket.id == 0 || acq.ticket != ticket.id) {
      fail("release: ticket {} is not acquired at layer {}", ticket.id, ticket.layer);
    }
    capture_ = capture_id();
    check_capture_ready("release");
    Record& rec = *acq.record;
    for (const auto& e : rec.entries) {
      if (table_.alive(e.slot, e.generation)) retire(e.slot, ticket.layer, e.plan_index);
    }
    tickets_.erase(ticket.id);
    rec.live = false;
    acq.ticket = 0;
    acq.record = nullptr;
    acq.slots.clear();
    acq.seq_len.clear();
    maybe_free(rec);
    pump(ticket.layer);
  }

  // acquire, attention(view), release: the view is released even when attention throws. The
  // callback enqueues its work on compute_stream().
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

  // Ends the copy stream's work in the compute stream (an event): call it before
  // cudaStreamBeginCapture (eagerly) and before cudaStreamEndCapture (inside the capture). Also
  // valid at any time eagerly (e.g. before reading the pool from another stream).
  void join() {
    const unsigned long long id = capture_id();
    if (id == 0) {
      join_.record(copy_.get());
      join_.wait_on(compute_);
      copy_unjoined_ = false;
    } else if (copy_capture_ == id) {
      join_.record(copy_.get());
      join_.wait_on(compute_);
    }
  }

  // ---- prediction quality -------------------------------------------------------------------

  // With the acquired ticket's sequences and the true queries of this step (DEVICE pointer, same
  // layout as prefetch's), adds to recall statistics: the share of the blocks the selector would
  // pick from the true queries that are resident. Runs on the compute stream; the hits are
  // counted on the device and read back by statistics().
  void observe(const Ticket& ticket, RowsView q_true) {
    constexpr const char* call = "observe";
    capture_ = capture_id();
    check_layer(ticket.layer, call);
    const auto& acq = acquired_[static_cast<std::size_t>(ticket.layer)];
    if (ticket.id == 0 || acq.ticket != ticket.id) {
      fail("observe: ticket {} is not acquired at layer {}", ticket.id, ticket.layer);
    }
    const std::int64_t rows = check_query_rows(q_true, ticket.sequences.size(), call);
    check_capture_ready(call);
    const int H = layout_.config.shape.num_kv_heads;
    const int K = layout_.selectable_blocks;
    const int B = static_cast<int>(acq.slots.size());
    auto& st = stats_.layers[static_cast<std::size_t>(ticket.layer)];
    std::uint64_t truth = 0;
    for (std::int64_t len : acq.seq_len) {
      const std::int64_t n = geometry_.ring_start(len) - layout_.sink_blocks;
      truth += static_cast<std::uint64_t>(H) * static_cast<std::uint64_t>(std::min<std::int64_t>(K, n));
    }
    if (K > 0) {
      Scratch& sc = observe_scratch(call);
      const auto& vb = views_[static_cast<std::size_t>(ticket.layer)];
      const gpu::DeviceBatch dbatch{B, vb.seq_slot, vb.seq_len};
      score_and_select(sc, ticket.layer, dbatch, q_true, rows, gpu::Candidates::current, compute_);
      gpu::count_resident_hits(sc.sel.data(), sc.sel_count.data(), K, B * H, vb.indptr.data(), vb.block.data(),
                               counters_.data() + 3 * ticket.layer + 2, compute_);
    }
    st.observed_true_blocks += truth;
  }

  // The blocks (best first) the selector would pick for `id`'s next step at `layer` from the
  // queries q (DEVICE pointer, [R][num_q_heads][head_dim]), per kv head. Changes nothing;
  // SYNCHRONOUS (reads the selection back), refused during stream capture.
  std::vector<std::vector<std::int32_t>> select_blocks(SeqId id, int layer, RowsView q) {
    constexpr const char* call = "select_blocks";
    check_layer(layer, call);
    const int s = slot_of(id, call);
    capture_ = capture_id();
    const std::int64_t rows = check_query_rows(q, 1, call);
    refuse_capture(call);
    const int H = layout_.config.shape.num_kv_heads;
    const int K = layout_.selectable_blocks;
    std::vector<std::vector<std::int32_t>> out(static_cast<std::size_t>(H));
    if (K == 0) return out;
    Scratch& sc = observe_scratch(call);
    Words w;
    const std::vector<std::int32_t> seq_slot{s};
    const std::vector<std::int64_t> lens{table_.length(s, layer)};
    const std::size_t o_slot = w.add(seq_slot), o_len = w.add(lens);
    gpu::upload_words(append_meta_.data(), w.words, compute_);
    const gpu::DeviceBatch dbatch{1, at<std::int32_t>(append_meta_, o_slot), at<std::int64_t>(append_meta_, o_len)};
    score_and_select(sc, layer, dbatch, q, rows, gpu::Candidates::next_step, compute_);
    std::vector<std::int32_t> sel(static_cast<std::size_t>(H) * static_cast<std::size_t>(K)), count(static_cast<std::size_t>(H));
    OASISKV_CUDA_CHECK(cudaMemcpyAsync(sel.data(), sc.sel.data(), sel.size() * sizeof(std::int32_t),
                                       cudaMemcpyDeviceToHost, compute_));
    OASISKV_CUDA_CHECK(cudaMemcpyAsync(count.data(), sc.sel_count.data(), count.size() * sizeof(std::int32_t),
                                       cudaMemcpyDeviceToHost, compute_));
    OASISKV_CUDA_CHECK(cudaStreamSynchronize(compute_));
    for (int h = 0; h < H; ++h) {
      const auto begin = sel.begin() + static_cast<std::ptrdiff_t>(h) * K;
      out[static_cast<std::size_t>(h)].assign(begin, begin + count[static_cast<std::size_t>(h)]);
    }
    return out;
  }

  // Synchronises both streams and reads the device counters back (not during stream capture).
  const Statistics& statistics() const {
    refuse_capture("statistics");
    synchronize();
    const auto L = static_cast<std::size_t>(layout_.config.shape.num_layers);
    std::vector<unsigned long long> c(3 * L);
    OASISKV_CUDA_CHECK(cudaMemcpy(c.data(), counters_.data(), c.size() * sizeof(unsigned long long),
                                  cudaMemcpyDeviceToHost));
    const std::uint64_t block_bytes = static_cast<std::uint64_t>(layout_.block_elems) * sizeof(T);
    for (std::size_t l = 0; l < L; ++l) {
      auto& st = stats_.layers[l];
      st.blocks_fetched = c[3 * l];
      st.bytes_fetched = c[3 * l] * block_bytes;
      st.admits_capped = c[3 * l + 1];
      st.observed_hits = c[3 * l + 2];
    }
    return stats_;
  }
  void reset_statistics() {
    refuse_capture("reset_statistics");
    synchronize();
    OASISKV_CUDA_CHECK(cudaMemset(counters_.data(), 0, counters_.bytes()));
    OASISKV_CUDA_CHECK(cudaDeviceSynchronize());
    for (auto& l : stats_.layers) l = LayerStatistics{};
  }

  // Waits for everything the cache enqueued (both streams). Not during capture.
  void synchronize() const {
    OASISKV_CUDA_CHECK(cudaStreamSynchronize(copy_.get()));
    OASISKV_CUDA_CHECK(cudaStreamSynchronize(compute_));
  }

 private:
  enum class State : std::uint8_t { pending, gathered, dropped };
  struct Entry {
    int slot = 0;
    std::uint32_t generation = 0;
    std::int64_t plan_index = 0;
    State state = State::pending;
  };
  // The device buffers of one prefetch: its metadata, plan (admits) and post-plan residency.
  // Busy from prefetch until its ticket is dead (released, stale or superseded) AND every entry
  // is gathered or dropped.
  struct Record {
    std::uint64_t ticket = 0;  // 0: free
    bool live = false;         // the ticket can still be acquired
    std::vector<Entry> entries;
    gpu::DeviceBuffer<std::uint32_t> meta;
    std::size_t o_slot = 0, o_len = 0;  // word offsets in meta
    gpu::DeviceBuffer<gpu::DeviceAdmit> admits;
    gpu::DeviceBuffer<std::int32_t> admit_count, capped, snapshot;
    std::unique_ptr<gpu::Event> copied;
    bool copied_recorded = false;
    unsigned long long copied_capture = 0;

    gpu::DeviceBatch batch(int n, int first = 0) const {
      return gpu::DeviceBatch{n, reinterpret_cast<const std::int32_t*>(meta.data() + o_slot) + first,
                              reinterpret_cast<const std::int64_t*>(meta.data() + o_len) + first};
    }
    bool drained() const {
      return std::none_of(entries.begin(), entries.end(), [](const Entry& e) { return e.state == State::pending; });
    }
  };
  struct TicketInfo {
    int layer = 0;
    Record* record = nullptr;
  };
  // The view arrays of one layer (valid while its ticket is acquired).
  struct ViewBuffers {
    gpu::DeviceBuffer<std::uint32_t> meta;
    gpu::DeviceBuffer<std::int32_t> counts, indptr, slot, block, valid;
    const SeqId* seq_ids = nullptr;
    const std::int64_t* seq_len = nullptr;
    const std::int32_t* seq_slot = nullptr;
    int batch_size = 0;
  };
  struct Acquired {
    std::uint64_t ticket = 0;
    Record* record = nullptr;
    std::vector<int> slots;
    std::vector<std::int64_t> seq_len;
  };
  // Scoring / top-K scratch of one stream.
  struct Scratch {
    explicit Scratch(const Cache& c) {
      const auto& L = c.layout_;
      const std::size_t pairs =
          static_cast<std::size_t>(L.config.max_sequences) * static_cast<std::size_t>(L.config.shape.num_kv_heads);
      stride = static_cast<int>(std::max<std::int64_t>(1, L.max_blocks - L.sink_blocks));
      scores = gpu::DeviceBuffer<float>(pairs * static_cast<std::size_t>(stride), false);
      count = gpu::DeviceBuffer<std::int32_t>(pairs);
      first = gpu::DeviceBuffer<std::int32_t>(pairs);
      if (L.config.reduction == GroupReduction::softmax_sum) {
        bounds = gpu::DeviceBuffer<float>(pairs * static_cast<std::size_t>(c.options_.max_query_rows) *
                                              static_cast<std::size_t>(L.group_size) * static_cast<std::size_t>(stride),
                                          false);
      }
      const std::size_t K = static_cast<std::size_t>(std::max(L.selectable_blocks, 1));
      sel = gpu::DeviceBuffer<std::int32_t>(pairs * K);
      sel_count = gpu::DeviceBuffer<std::int32_t>(pairs);
    }
    int stride = 1;
    gpu::DeviceBuffer<float> scores, bounds;
    gpu::DeviceBuffer<std::int32_t> count, first, sel, sel_count;
  };

  // Host values packed as 32-bit words for gpu::upload_words, each array 8-byte aligned.
  struct Words {
    std::vector<std::uint32_t> words;
    template <class V>
    std::size_t add(const std::vector<V>& v) {
      static_assert(sizeof(V) % 4 == 0);
      if (words.size() % 2 != 0) words.push_back(0);
      const std::size_t off = words.size();
      words.resize(off + v.size() * (sizeof(V) / 4));
      if (!v.empty()) std::memcpy(words.data() + off, v.data(), v.size() * sizeof(V));
      return off;
    }
  };
  template <class V>
  static V* at(const gpu::DeviceBuffer<std::uint32_t>& meta, std::size_t word) noexcept {
    return reinterpret_cast<V*>(meta.data() + word);
  }
  // Words of one call's metadata: at most 2 + 2 + 2 words per sequence, plus alignment.
  std::size_t meta_words() const noexcept { return 8 * static_cast<std::size_t>(layout_.config.max_sequences) + 16; }

  static CudaCacheOptions checked(const CudaCacheOptions& o) {
    if (o.max_query_rows < 1) fail("Cache<cuda>: options.max_query_rows must be positive, got {}", o.max_query_rows);
    if (o.tickets_per_layer < 1) {
      fail("Cache<cuda>: options.tickets_per_layer must be positive, got {}", o.tickets_per_layer);
    }
    return o;
  }
  std::size_t residency_size() const noexcept {
    const auto& s = layout_.config.shape;
    return static_cast<std::size_t>(layout_.config.max_sequences) * static_cast<std::size_t>(s.num_layers) *
           static_cast<std::size_t>(s.num_kv_heads) * static_cast<std::size_t>(layout_.selectable_blocks);
  }

  // ---- streams and capture ----

  // The id of the capture sequence the compute stream is in, or 0.
  unsigned long long capture_id() const {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    unsigned long long id = 0;
    OASISKV_CUDA_CHECK(cudaStreamGetCaptureInfo(compute_, &status, &id));
    return status == cudaStreamCaptureStatusNone ? 0 : (id == 0 ? ~0ull : id);
  }
  void refuse_capture(const char* call) const {
    if (capture_id() != 0) fail("{}: not allowed while the compute stream is being captured", call);
  }
  // A capture must not start with copy-stream work of before it that the graph does not wait for.
  void check_capture_ready(const char* call) const {
    if (capture_ != 0 && copy_capture_ != capture_ && copy_unjoined_) {
      fail("{}: the compute stream is being captured, but the cache's copy stream has work from before the "
           "capture: call join() before cudaStreamBeginCapture",
           call);
    }
  }
  // The copy stream waits for the compute stream's work so far.
  void fork() {
    fork_.record(compute_);
    fork_.wait_on(copy_.get());
    if (capture_ == 0) {
      copy_unjoined_ = true;
    } else {
      copy_capture_ = capture_;
    }
  }

  // ---- gathers: PrefetchPipeline<cpu>'s gating on the host ----

  void reset_retired(int s) {
    for (int l = 0; l < layout_.config.shape.num_layers; ++l) retired_[retired_index(s, l)] = -1;
  }
  std::size_t retired_index(int s, int layer) const noexcept {
    return static_cast<std::size_t>(s) * static_cast<std::size_t>(layout_.config.shape.num_layers) +
           static_cast<std::size_t>(layer);
  }
  void retire(int s, int layer, std::int64_t plan_index) {
    auto& r = retired_[retired_index(s, layer)];
    r = std::max(r, plan_index);
  }

  // Enqueues, oldest ticket first, the gathers of every plan of `layer` whose older plans are
  // retired; drops those of removed sequences; frees drained records of dead tickets.
  void pump(int layer) {
    auto& recs = records_[static_cast<std::size_t>(layer)];
    std::vector<Record*> order;
    for (auto& r : recs) {
      if (r->ticket != 0) order.push_back(r.get());
    }
    std::sort(order.begin(), order.end(), [](const Record* a, const Record* b) { return a->ticket < b->ticket; });
    const int H = layout_.config.shape.num_kv_heads;
    const int cap = geometry_.admit_stride;
    bool forked = false;
    for (Record* r : order) {
      std::vector<int> run;
      bool whole = true;
      for (std::size_t i = 0; i < r->entries.size(); ++i) {
        Entry& e = r->entries[i];
        if (e.state == State::pending && !table_.alive(e.slot, e.generation)) e.state = State::dropped;
        if (e.state != State::pending) {
          whole = false;
        } else if (e.plan_index <= retired_[retired_index(e.slot, layer)] + 1) {
          run.push_back(static_cast<int>(i));
        } else {
          whole = false;
        }
      }
      if (!run.empty() && layout_.selectable_blocks > 0) {
        if (!forked) {
          fork();
          forked = true;
        }
        T* pool = device_.layer_pool(layer);
        if (whole) {
          gpu::gather_admits<T>(geometry_, layer, r->batch(static_cast<int>(r->entries.size())), r->admits.data(),
                                r->admit_count.data(), host_.device_base(), pool, copy_.get());
        } else {
          for (int i : run) {
            const std::size_t p0 = static_cast<std::size_t>(i) * static_cast<std::size_t>(H);
            gpu::gather_admits<T>(geometry_, layer, r->batch(1, i), r->admits.data() + p0 * static_cast<std::size_t>(cap),
                                  r->admit_count.data() + p0, host_.device_base(), pool, copy_.get());
          }
        }
        r->copied->record(copy_.get());
        r->copied_recorded = true;
        r->copied_capture = capture_;
      }
      for (int i : run) r->entries[static_cast<std::size_t>(i)].state = State::gathered;
      maybe_free(*r);
    }
  }

  void maybe_free(Record& r) {
    if (!r.live && r.ticket != 0 && r.drained()) {
      r.ticket = 0;
      r.entries.clear();
      r.copied_recorded = false;
    }
  }

  Record* free_record(int layer) {
    auto& recs = records_[static_cast<std::size_t>(layer)];
    std::string live, dead;
    int nlive = 0;
    Record* free = nullptr;
    for (auto& r : recs) {
      if (r->ticket == 0) {
        if (free == nullptr) free = r.get();
      } else if (r->live) {
        live += (live.empty() ? "" : ", ") + std::to_string(r->ticket);
        ++nlive;
      } else {
        dead += (dead.empty() ? "" : ", ") + std::to_string(r->ticket);
      }
    }
    if (nlive >= options_.tickets_per_layer) {
      fail("prefetch: layer {} already has {} outstanding tickets ({}), the most Cache<cuda> holds "
           "(options.tickets_per_layer): acquire and release one first",
           layer, nlive, live);
    }
    if (free == nullptr) {
      fail("prefetch: layer {} has no free ticket record: tickets {} are dead but their gathers wait for older "
           "plans of their sequences to be released; release (or acquire newer tickets) first",
           layer, dead);
    }
    return free;
  }

  // Forgets tickets that can never be acquired: a sequence gone, or a newer plan served.
  void sweep_tickets() {
    for (auto it = tickets_.begin(); it != tickets_.end();) {
      const int layer = it->second.layer;
      Record& r = *it->second.record;
      const bool current = acquired_[static_cast<std::size_t>(layer)].ticket == it->first;
      const bool dead = !current && std::any_of(r.entries.begin(), r.entries.end(), [&](const Entry& e) {
        return !table_.alive(e.slot, e.generation) || e.plan_index <= table_.acquired_plan(e.slot, layer);
      });
      if (dead) {
        r.live = false;
        it = tickets_.erase(it);
      } else {
        ++it;
      }
    }
    // Plans of removed sequences are never gathered; records of dead tickets may be drained now.
    for (auto& recs : records_) {
      for (auto& r : recs) {
        if (r->ticket == 0) continue;
        for (auto& e : r->entries) {
          if (e.state == State::pending && !table_.alive(e.slot, e.generation)) e.state = State::dropped;
        }
        maybe_free(*r);
      }
    }
  }

  // ---- scoring for observe / select_blocks ----

  Scratch& observe_scratch(const char* call) {
    if (!observe_scratch_) {
      if (capture_ != 0) fail("{}: the first observe or select_blocks allocates memory: make one outside capture", call);
      observe_scratch_ = std::make_unique<Scratch>(*this);
    }
    return *observe_scratch_;
  }
  void score_and_select(Scratch& sc, int layer, const gpu::DeviceBatch& batch, const RowsView& q, std::int64_t rows,
                        gpu::Candidates candidates, cudaStream_t stream) {
    const gpu::ScoreBuffers sb{sc.scores.data(), sc.count.data(), sc.first.data(), sc.bounds.data(), sc.stride};
    if (q.dtype == DType::f32) {
      gpu::score_blocks<float>(geometry_, layer, batch, static_cast<const float*>(q.data), static_cast<int>(rows),
                               summaries_.data(), sb, stream, candidates);
    } else {
      gpu::score_blocks<T>(geometry_, layer, batch, static_cast<const T*>(q.data), static_cast<int>(rows),
                           summaries_.data(), sb, stream, candidates);
    }
    gpu::segmented_top_k(sc.scores.data(), sc.stride, sc.count.data(), sc.first.data(),
                         batch.size * layout_.config.shape.num_kv_heads, layout_.selectable_blocks, sc.sel.data(),
                         sc.sel_count.data(), stream);
  }

  // ---- validation (the CPU facade's, without reading device data) ----

  void check_layer(int layer, const char* call) const { oasiskv::check_layer(layout_, layer, call); }
  int slot_of(SeqId id, const char* call) const { return oasiskv::slot_of(table_, id, call); }
  std::vector<int> resolve(std::span<const SeqId> batch, const char* call) const {
    return resolve_batch(table_, batch, call);
  }
  // Shape, element type, null, and (outside capture) that the memory is device-accessible. Values
  // are not checked (they are on the device).
  void check_rows(const RowsView& r, const char* name, std::int64_t expected_rows, const char* call,
                  bool allow_float) const {
    check_rows_shape(r, dtype_of_v<T>, name, expected_rows, call, allow_float);
    if (expected_rows > 0 && capture_ == 0) {
      cudaPointerAttributes a{};
      if (cudaPointerGetAttributes(&a, r.data) != cudaSuccess) {
        (void)cudaGetLastError();
      } else if (a.type == cudaMemoryTypeUnregistered) {
        fail("{}: {} ({}) is pageable host memory: Cache<cuda> reads it on the device; pass device memory (or "
             "mapped pinned host memory)",
             call, name, r.data);
      }
    }
  }
  std::int64_t check_query_rows(const RowsView& q, std::size_t batch, const char* call) const {
    const std::int64_t per_sequence = query_rows_per_sequence(q, batch, call);
    if (per_sequence > options_.max_query_rows) {
      fail("{}: q has {} rows per sequence, more than options.max_query_rows = {}", call, per_sequence,
           options_.max_query_rows);
    }
    check_rows(q, "q", q.rows, call, true);
    return per_sequence;
  }
  void check_not_in_flight(const std::vector<int>& slots, int layer, const char* call) const {
    const auto& a = acquired_[static_cast<std::size_t>(layer)];
    oasiskv::check_not_in_flight(table_, a.ticket, a.slots, slots, layer, call);
  }
  void check_fresh(const Ticket& t, const char* call) const { check_ticket_fresh(table_, t, call); }

  LayerView<T> view_of(int layer) const {
    const auto& vb = views_[static_cast<std::size_t>(layer)];
    LayerView<T> v;
    v.layer = layer;
    v.batch_size = vb.batch_size;
    v.num_kv_heads = layout_.config.shape.num_kv_heads;
    v.head_dim = layout_.config.shape.head_dim;
    v.block_tokens = layout_.config.block_tokens;
    v.seq_ids = vb.seq_ids;
    v.seq_len = vb.seq_len;
    v.indptr = vb.indptr.data();
    v.slot = vb.slot.data();
    v.block = vb.block.data();
    v.valid_tokens = vb.valid.data();
    v.pool = device_.layer_pool(layer);
    v.slot_stride = layout_.block_elems;
    return v;
  }

  CacheLayout layout_;
  gpu::Geometry geometry_;
  CudaCacheOptions options_;
  cudaStream_t compute_;
  gpu::Stream copy_;
  gpu::Event fork_, join_;
  gpu::PinnedHostTier<T> host_;
  DeviceTier<cuda, T> device_;
  gpu::DeviceBuffer<float> summaries_;
  gpu::DeviceBuffer<std::int32_t> res_block_;
  gpu::DeviceBuffer<std::int64_t> res_last_;
  gpu::DeviceBuffer<unsigned long long> counters_;  // per layer: fetched, capped, observed hits
  std::unique_ptr<Scratch> scratch_, observe_scratch_;
  gpu::DeviceBuffer<std::uint32_t> append_meta_;
  std::vector<std::vector<std::unique_ptr<Record>>> records_;  // per layer
  std::vector<ViewBuffers> views_;                             // per layer
  std::vector<Acquired> acquired_;                             // per layer
  BlockTable table_;
  std::vector<std::int64_t> retired_;  // per (sequence slot, layer): highest retired plan
  std::map<std::uint64_t, TicketInfo> tickets_;
  std::uint64_t next_ticket_ = 1;
  mutable Statistics stats_;
  unsigned long long capture_ = 0;       // capture id of the call in progress (0: eager)
  unsigned long long copy_capture_ = 0;  // capture the copy stream last joined
  bool copy_unjoined_ = false;           // eager copy-stream work not yet joined
};

}  // namespace v0
}  // namespace oasiskv
