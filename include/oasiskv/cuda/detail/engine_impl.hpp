// Bodies of CudaEngine<T> (oasiskv/cuda/engine.hpp). Host code.
#pragma once

#include <chrono>
#include <cstring>
#include <string>
#include <tuple>

#include "oasiskv/cuda/engine.hpp"

namespace oasiskv {
inline namespace v0 {

template <KvElement T>
CudaEngine<T>::CudaEngine(const CacheLayout& layout, const Options& options)
    : layout_(layout),
      options_([&] {
        if (options.max_query_rows < 1)
          fail("Cache<cuda>: options.max_query_rows must be positive, got {}", options.max_query_rows);
        if (options.tickets_per_layer < 1) {
          fail("Cache<cuda>: options.tickets_per_layer must be positive, got {}", options.tickets_per_layer);
        }
        if (options.query_staging_buffers < 1) {
          fail("Cache<cuda>: options.query_staging_buffers must be positive, got {}", options.query_staging_buffers);
        }
        if (layout.max_selectable_blocks > gpu::kMaxTopK) {
          fail("Cache<cuda>: {} selectable blocks per kv head is above the CUDA top-K limit of {}",
               layout.max_selectable_blocks, gpu::kMaxTopK);
        }
        return options;
      }()),
      device_([] {
        int d = 0;
        OASISKV_CUDA_CHECK(cudaGetDevice(&d));
        return d;
      }()),
      compute_(options.compute_stream),
      host_(layout,
            gpu::PinnedRegion(HostTier::bytes_for(layout), static_cast<std::size_t>(layout.block_elems) * sizeof(T))),
      block_map_(std::max<std::size_t>(1, host_.pool().map().size())),
      pool_(layout, gpu::DeviceBuffer<std::byte>(Pool::bytes_for(layout))),
      summaries_(static_cast<std::size_t>(layout.summary_floats)),
      run_sums_(static_cast<std::size_t>(layout.run_floats)),
      res_block_(std::max<std::size_t>(1, static_cast<std::size_t>(layout.residency_entries))),
      res_last_(std::max<std::size_t>(1, static_cast<std::size_t>(layout.residency_entries))),
      counters_(static_cast<std::size_t>(layout.num_layers()) * 3u),
      device_layout_(layout),
      host_counters_(static_cast<std::size_t>(layout.num_layers()) * 3u, 0) {
  if (layout_.profiled()) {
    const auto heads =
        static_cast<std::size_t>(layout_.num_layers()) * static_cast<std::size_t>(layout_.num_kv_heads());
    const auto layers = static_cast<std::size_t>(layout_.num_layers());
    head_budgets_ = gpu::DeviceBuffer<HeadBudget>(heads);
    layer_pools_ = gpu::DeviceBuffer<LayerSlots>(layers);
    OASISKV_CUDA_CHECK(
        cudaMemcpy(head_budgets_.data(), layout_.head_budgets, heads * sizeof(HeadBudget), cudaMemcpyHostToDevice));
    OASISKV_CUDA_CHECK(
        cudaMemcpy(layer_pools_.data(), layout_.layer_pools, layers * sizeof(LayerSlots), cudaMemcpyHostToDevice));
    device_layout_.head_budgets = head_budgets_.data();
    device_layout_.layer_pools = layer_pools_.data();
  }
  remainder_ = gpu::detail::make_device_remainder<T>(gpu::detail::RemainderContext<T>{&layout_, &device_layout_,
                                                                                      device_host(), &host_.pool(),
                                                                                      summaries_.data(), compute_});
  if (!host_.memory().pinned()) {
    fail(
        "Cache<cuda>: the host tier ({} bytes) could not be pinned and mapped (see the warning above); the CUDA "
        "backend gathers blocks from it zero-copy",
        host_.bytes_reserved());
  }
  remote_.resize(static_cast<std::size_t>(layout_.config.max_sequences));
  generation_.resize(static_cast<std::size_t>(layout_.config.max_sequences), 0);
  remote_blocks_read_ = std::make_unique<std::atomic<std::uint64_t>[]>(static_cast<std::size_t>(layout_.num_layers()));
  scratch_ = std::make_unique<gpu::detail::Scratch>(layout_, options_.max_query_rows);
  observe_scratch_ = std::make_unique<gpu::detail::Scratch>(layout_, options_.max_query_rows);
  staging_ =
      std::make_unique<gpu::detail::QueryStaging>(layout_, options_.max_query_rows, options_.query_staging_buffers);
  append_meta_ = gpu::DeviceBuffer<std::uint32_t>(gpu::detail::meta_words(layout_));
  select_meta_ = gpu::DeviceBuffer<std::uint32_t>(gpu::detail::meta_words(layout_));
  const int L = layout_.num_layers();
  records_.resize(static_cast<std::size_t>(L));
  for (int l = 0; l < L; ++l) {
    // One record more than tickets_per_layer: a dead ticket whose copies still wait for their
    // gate keeps its record until they start.
    for (int r = 0; r < options_.tickets_per_layer + 1; ++r)
      records_[static_cast<std::size_t>(l)].push_back(std::make_unique<Record>(layout_));
    views_.push_back(std::make_unique<gpu::detail::ViewBuffers>(layout_));
  }
  // Every stream-ordered initialisation on the compute stream, then wait: the copy stream forks
  // from the compute stream before it first touches any of these.
  res_block_.fill_async(0xff, compute_);  // kNoBlock
  res_last_.fill_async(0xff, compute_);   // -1
  counters_.fill_async(0, compute_);
  block_map_.fill_async(0, compute_);  // pool block 0: a read of an unmapped entry stays in the pool
  OASISKV_CUDA_CHECK(cudaStreamSynchronize(compute_));
}

template <KvElement T>
CudaEngine<T>::~CudaEngine() {
  // Work in flight reads and writes memory that is about to be freed; the caller's device is kept.
  int previous = 0;
  const bool known = cudaGetDevice(&previous) == cudaSuccess;
  if (cudaSetDevice(device_) == cudaSuccess) {
    (void)cudaStreamSynchronize(copy_.get());
    (void)cudaStreamSynchronize(compute_);
  }
  if (known) (void)cudaSetDevice(previous);
  (void)cudaGetLastError();
}

// ---- streams and capture ----

template <KvElement T>
unsigned long long CudaEngine<T>::stream_capture_id() const {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  OASISKV_CUDA_CHECK(cudaStreamGetCaptureInfo(compute_, &status, &id));
  return status == cudaStreamCaptureStatusNone ? 0 : (id == 0 ? ~0ull : id);
}

template <KvElement T>
void CudaEngine<T>::enter(const char* call, CallKind kind) const {
  gpu::DeviceGuard guard(device_);
  capture_ = stream_capture_id();
  if (kind == CallKind::host_only && capture_ != 0) {
    fail("{}: not allowed while the compute stream is being captured", call);
  }
  check_capture_ready(call);
}

// A capture must not start with copy-stream work of before it that the graph does not wait for.
template <KvElement T>
void CudaEngine<T>::check_capture_ready(const char* call) const {
  if (capture_ != 0 && copy_capture_ != capture_ && copy_unjoined_) {
    fail(
        "{}: the compute stream is being captured, but the cache's copy stream has work from before the capture: "
        "call join() before cudaStreamBeginCapture",
        call);
  }
}

// The copy stream waits for the compute stream's work so far.
template <KvElement T>
void CudaEngine<T>::fork_copy_stream() {
  fork_.record(compute_);
  fork_.wait_on(copy_.get());
  if (capture_ == 0) {
    copy_unjoined_ = true;
  } else {
    copy_capture_ = capture_;
  }
}

template <KvElement T>
void CudaEngine<T>::join() {
  gpu::DeviceGuard guard(device_);
  const unsigned long long id = stream_capture_id();
  if (id == 0) {
    join_.record(copy_.get());
    join_.wait_on(compute_);
    copy_unjoined_ = false;
  } else if (copy_capture_ == id) {
    join_.record(copy_.get());
    join_.wait_on(compute_);
  }
}

template <KvElement T>
void CudaEngine<T>::synchronize() {
  gpu::DeviceGuard guard(device_);
  if (stream_capture_id() != 0) fail("synchronize: not allowed while the compute stream is being captured");
  copy_.synchronize();
  OASISKV_CUDA_CHECK(cudaStreamSynchronize(compute_));
  copy_unjoined_ = false;
}

// Shape and type were checked by the Cache; the values are on the device and not read. Outside
// capture, pageable host memory is refused (kernels read the pointer).
template <KvElement T>
void CudaEngine<T>::check_input(const RowsView& r, const char* name, const char* call, std::int64_t elements) const {
  if (elements <= 0 || stream_capture_id() != 0) return;
  gpu::DeviceGuard guard(device_);
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, r.data) != cudaSuccess) {
    (void)cudaGetLastError();
  } else if (a.type == cudaMemoryTypeUnregistered) {
    fail(
        "{}: {} ({}) is pageable host memory: Cache<cuda> reads it on the device; pass device memory (or mapped "
        "pinned host memory)",
        call, name, r.data);
  } else if (a.type == cudaMemoryTypeDevice && a.device != device_) {
    fail("{}: {} ({}) is memory of device {}, but this cache lives on device {}", call, name, r.data, a.device,
         device_);
  }
}

// ---- lifecycle ----

template <KvElement T>
void CudaEngine<T>::sequence_added(int slot, std::uint32_t generation) {
  generation_[static_cast<std::size_t>(slot)] = generation;
  remote_failures_.clear(slot);
  remote_[static_cast<std::size_t>(slot)].reset();
  if (remainder_) {
    gpu::DeviceGuard guard(device_);
    remainder_->reset(slot);
  }
}

template <KvElement T>
void CudaEngine<T>::sequence_removed(int slot, std::uint32_t generation) {
  gpu::DeviceGuard guard(device_);
  generation_[static_cast<std::size_t>(slot)] = generation;
  remote_[static_cast<std::size_t>(slot)].reset();  // jobs still queued keep what they read from
  fork_copy_stream();                               // after every plan already queued on the copy stream
  if (layout_.max_selectable_blocks > 0)
    gpu::clear_residency(device_layout_, slot, -1, res_block_.data(), res_last_.data(), copy_.get());
}

template <KvElement T>
void CudaEngine<T>::reset_layer(int layer) {
  gpu::DeviceGuard guard(device_);
  fork_copy_stream();
  if (layout_.max_selectable_blocks > 0)
    gpu::clear_residency(device_layout_, -1, layer, res_block_.data(), res_last_.data(), copy_.get());
}

// Summary and ring on the compute stream (where append writes them); residency on the copy stream
// (after every plan and gather already queued: the Cache started this sequence's pending copies);
// then the compute stream waits for the copy stream, so no gather still reads rows that a later
// append overwrites.
template <KvElement T>
void CudaEngine<T>::truncate(int slot, int layer, std::int64_t /*old_length*/, std::int64_t length) {
  gpu::DeviceGuard guard(device_);
  gpu::truncate_rows<T>(device_layout_, slot, layer, length, device_host(), pool_.layer_pool(layer), summaries_.data(),
                        compute_);
  if (layout_.score.runs > 0) {
    gpu::rebuild_run_sums<T>(device_layout_, slot, slot, layer, length, device_host(), run_sums_.data(), compute_);
  }
  if (remainder_) remainder_->truncated(slot, layer, length);
  fork_copy_stream();
  gpu::truncate_residency(device_layout_, slot, layer, length / layout_.block_tokens(), res_block_.data(),
                          res_last_.data(), copy_.get());
  join_.record(copy_.get());
  join_.wait_on(compute_);
}

// ---- host pool ----

// Entries [first, first + count) of the slot's map to the device, on the compute stream.
template <KvElement T>
void CudaEngine<T>::upload_map(int slot, std::int64_t first, std::int64_t count) {
  if (count <= 0) return;
  const std::int32_t* from = host_.pool().map().data() + layout_.block_map_index(slot, first);
  gpu::upload_words(reinterpret_cast<std::uint32_t*>(block_map_.data() + layout_.block_map_index(slot, first)),
                    std::span(reinterpret_cast<const std::uint32_t*>(from), static_cast<std::size_t>(count)), compute_);
}

// The map changes go to the device before the append that writes through them; a copy on write
// clones the shared block first (after every earlier append into it: same stream). A gather queued
// before may be reading the shared block for this sequence (it can be full at another layer), and
// the other holder may write it once this one moved off: the compute stream waits for the copy
// stream first (join); later gathers read the new map.
template <KvElement T>
void CudaEngine<T>::map_blocks(std::span<const AppendEntry> entries, std::vector<BlockRemap>& changes) {
  gpu::DeviceGuard guard(device_);
  if (host_.pool().copies_on_write(entries) > 0) join();
  const std::size_t first = changes.size();
  host_.pool().map_for_append(entries, changes);
  for (std::size_t i = first; i < changes.size();) {
    std::size_t j = i + 1;  // a run of consecutive blocks of one slot
    while (j < changes.size() && changes[j].slot == changes[i].slot && changes[j].block == changes[j - 1].block + 1)
      ++j;
    for (std::size_t c = i; c < j; ++c) {
      if (changes[c].from != kNoHostBlock) {
        gpu::clone_host_block<T>(device_layout_, device_host().base, changes[c].from, changes[c].to, compute_);
      }
    }
    upload_map(changes[i].slot, changes[i].block, static_cast<std::int64_t>(j - i));
    i = j;
  }
}

template <KvElement T>
void CudaEngine<T>::fork(int src, int dst, std::int64_t length) {
  gpu::DeviceGuard guard(device_);
  const std::int64_t nb = layout_.blocks_for(length);
  host_.pool().share(src, dst, nb);
  remote_[static_cast<std::size_t>(dst)] = remote_[static_cast<std::size_t>(src)];  // remote blocks shared too
  upload_map(dst, 0, nb);
  for (int l = 0; l < layout_.num_layers(); ++l) {
    gpu::fork_rows<T>(device_layout_, src, dst, l, length, device_host(), pool_.layer_pool(l), summaries_.data(),
                      compute_);
    if (layout_.score.runs > 0) {
      gpu::rebuild_run_sums<T>(device_layout_, src, dst, l, length, device_host(), run_sums_.data(), compute_);
    }
    if (remainder_) remainder_->forked(src, dst, l, length);
  }
}

// ---- decode path ----

template <KvElement T>
void CudaEngine<T>::append(int layer, std::span<const AppendEntry> entries, RowsView k, RowsView v) {
  gpu::DeviceGuard guard(device_);
  gpu::detail::Words w;
  std::vector<std::int32_t> seq_slot, offset{0};
  std::vector<std::int64_t> before;
  for (const AppendEntry& e : entries) {
    seq_slot.push_back(e.slot);
    before.push_back(e.length);
    offset.push_back(offset.back() + static_cast<std::int32_t>(e.rows));
  }
  const std::size_t o_slot = w.add(seq_slot), o_len = w.add(before), o_off = w.add(offset);
  gpu::upload_words(append_meta_.data(), w.words, compute_);
  const gpu::DeviceBatch batch{static_cast<int>(entries.size()),
                               gpu::detail::word_at<std::int32_t>(append_meta_, o_slot),
                               gpu::detail::word_at<std::int64_t>(append_meta_, o_len)};
  gpu::append<T>(device_layout_, layer, batch, gpu::detail::word_at<std::int32_t>(append_meta_, o_off),
                 static_cast<const T*>(k.data), static_cast<const T*>(v.data), device_host(), pool_.layer_pool(layer),
                 summaries_.data(), compute_);
  if (layout_.score.runs > 0) {
    gpu::append_run_sums<T>(device_layout_, layer, batch, gpu::detail::word_at<std::int32_t>(append_meta_, o_off),
                            static_cast<const T*>(k.data), run_sums_.data(), compute_);
  }
  if (remainder_) {  // after append: its host rows and summaries
    remainder_->appended(layer, batch, gpu::detail::word_at<std::int32_t>(append_meta_, o_off),
                         static_cast<const T*>(k.data), static_cast<const T*>(v.data), entries);
  }
}

template <KvElement T>
typename CudaEngine<T>::Plan CudaEngine<T>::plan(int layer, std::span<const PlanEntry> entries, RowsView q,
                                                 std::int64_t rows, std::uint64_t ticket) {
  gpu::DeviceGuard guard(device_);
  auto& recs = records_[static_cast<std::size_t>(layer)];
  int index = -1;
  for (std::size_t r = 0; r < recs.size(); ++r) {
    if (!recs[r]->busy) {
      index = static_cast<int>(r);
      break;
    }
  }
  if (index < 0) fail("prefetch: layer {} has no free plan record (internal: the Cache checks capacity first)", layer);
  Record& rec = *recs[static_cast<std::size_t>(index)];
  const int B = static_cast<int>(entries.size());
  const int K = layout_.max_selectable_blocks;  // the selections' and admits' row stride

  // Stage the queries on the compute stream: the caller may overwrite q right after this call.
  auto& staged = staging_->next();
  if (staged.used && staged.capture == capture_) staged.consumed.wait_on(compute_);
  const std::size_t qbytes =
      static_cast<std::size_t>(q.rows) * static_cast<std::size_t>(layout_.q_row_elems) * dtype_size(q.dtype);
  OASISKV_CUDA_CHECK(cudaMemcpyAsync(staged.data.data(), q.data, qbytes, cudaMemcpyDefault, compute_));

  gpu::detail::Words w;
  std::vector<std::int32_t> seq_slot, caps;
  std::vector<std::int64_t> lens, steps;
  rec.host_slots.clear();
  rec.host_generations.clear();
  for (const PlanEntry& e : entries) {
    seq_slot.push_back(e.slot);
    lens.push_back(e.length);
    steps.push_back(e.plan_index);
    for (int h = 0; h < layout_.num_kv_heads(); ++h) {
      caps.push_back(layout_.profiled() ? layout_.admit_cap(e.first_plan ? 0 : 1, layer, h) : e.admit_cap);
    }
    rec.host_slots.push_back(e.slot);
    rec.host_generations.push_back(e.generation);
  }
  rec.remote_reads = false;
  rec.o_slot = w.add(seq_slot);
  rec.o_len = w.add(lens);
  const std::size_t o_steps = w.add(steps), o_caps = w.add(caps);
  fork_copy_stream();  // scoring reads the summaries appended and the queries staged on the compute stream
  gpu::upload_words(rec.meta.data(), w.words, copy_.get());
  const gpu::DeviceBatch batch = rec.batch(B);
  if (K > 0) {
    gpu::detail::Scratch& sc = *scratch_;
    score_and_select(sc, layer, batch, staged.data.data(), q.dtype, rows, gpu::Candidates::next_step, copy_.get(),
                     static_cast<int>(entries.front().next_rows));
    gpu::plan_transfers(device_layout_, layer, batch, gpu::detail::word_at<std::int64_t>(rec.meta, o_steps),
                        gpu::detail::word_at<std::int32_t>(rec.meta, o_caps), sc.sel.data(), sc.sel_count.data(), K,
                        res_block_.data(), res_last_.data(),
                        gpu::PlanBuffers{rec.admits.data(), rec.admit_count.data(), nullptr, nullptr,
                                         rec.capped.data()},
                        copy_.get());
    gpu::snapshot_plans(device_layout_, layer, batch, res_block_.data(), rec.snapshot.data(), rec.admit_count.data(),
                        rec.capped.data(), counters_.data() + 3 * layer, copy_.get());
  }
  staged.consumed.record(copy_.get());
  staged.used = true;
  staged.capture = capture_;
  rec.busy = true;
  rec.ticket = ticket;
  rec.layer = layer;
  rec.size = B;
  rec.copied_recorded = false;
  return Plan{index, layer};
}

template <KvElement T>
void CudaEngine<T>::start_copies(Plan& plan, std::span<const int> entries) {
  if (layout_.max_selectable_blocks <= 0 || entries.empty()) return;
  gpu::DeviceGuard guard(device_);
  Record& rec = record(plan);
  const int H = layout_.num_kv_heads();
  const auto stride = static_cast<std::size_t>(layout_.max_selectable_blocks);
  const gpu::DeviceHostTier<T> host = device_host();
  T* pool = pool_.layer_pool(plan.layer);
  fork_copy_stream();  // after the attention that read the victim slots
  const T* staging = start_remote_reads(rec, plan.layer, entries);
  if (static_cast<int>(entries.size()) == rec.size) {
    gpu::gather_admits<T>(device_layout_, plan.layer, rec.batch(rec.size), rec.admits.data(), rec.admit_count.data(),
                          host, pool, copy_.get(), staging);
  } else {
    for (int i : entries) {
      const std::size_t p0 = static_cast<std::size_t>(i) * static_cast<std::size_t>(H);
      gpu::gather_admits<T>(device_layout_, plan.layer, rec.batch(1, i), rec.admits.data() + p0 * stride,
                            rec.admit_count.data() + p0, host, pool, copy_.get(),
                            staging != nullptr ? staging + p0 * stride * static_cast<std::size_t>(layout_.block_elems)
                                               : nullptr);
    }
  }
  rec.copied.record(copy_.get());
  rec.copied_recorded = true;
  rec.copied_capture = capture_;
}

// The compute stream waits for the ticket's gathers; the host does not wait.
template <KvElement T>
std::int64_t CudaEngine<T>::wait(Plan& plan) {
  gpu::DeviceGuard guard(device_);
  Record& rec = record(plan);
  // A gather event from before this capture, or from a captured step, is already ordered (see
  // join() and the graph rules in oasiskv/cuda/cache.hpp).
  if (rec.copied_recorded && rec.copied_capture == capture_) rec.copied.wait_on(compute_);
  if (!rec.remote_reads || !rec.copied_recorded) return 0;
  // Remote reads: the host waits, so that acquire can say whether they failed.
  const auto start = std::chrono::steady_clock::now();
  OASISKV_CUDA_CHECK(cudaEventSynchronize(rec.copied.get()));
  rec.remote_reads = false;
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
}

template <KvElement T>
LayerView<T> CudaEngine<T>::build_view(int layer, const Plan& plan, std::span<const ViewEntry> entries) {
  gpu::DeviceGuard guard(device_);
  Record& rec = record(plan);
  auto& vb = *views_[static_cast<std::size_t>(layer)];
  gpu::detail::Words w;
  std::vector<SeqId> ids;
  std::vector<std::int64_t> lens;
  std::vector<std::int32_t> seq_slot;
  for (const ViewEntry& e : entries) {
    ids.push_back(e.id);
    lens.push_back(e.length);
    seq_slot.push_back(e.slot);
  }
  const std::size_t o_ids = w.add(ids), o_len = w.add(lens), o_slot = w.add(seq_slot);
  gpu::upload_words(vb.meta.data(), w.words, compute_);
  vb.seq_ids = gpu::detail::word_at<SeqId>(vb.meta, o_ids);
  vb.seq_len = gpu::detail::word_at<std::int64_t>(vb.meta, o_len);
  vb.seq_slot = gpu::detail::word_at<std::int32_t>(vb.meta, o_slot);
  vb.batch_size = static_cast<int>(entries.size());
  gpu::build_view(device_layout_, layer, gpu::DeviceBatch{vb.batch_size, vb.seq_slot, vb.seq_len}, rec.snapshot.data(),
                  vb.counts.data(), vb.indptr.data(), vb.slot.data(), vb.block.data(), vb.valid.data(), compute_);
  return make_layer_view<T>(layout_, layer,
                            ViewArrays{vb.batch_size, vb.seq_ids, vb.seq_len, vb.indptr.data(), vb.slot.data(),
                                       vb.block.data(), vb.valid.data()},
                            pool_.layer_pool(layer));
}

template <KvElement T>
void CudaEngine<T>::free_plan(Plan& plan) noexcept {
  if (plan.record < 0) return;
  Record& rec = record(plan);
  rec.busy = false;
  rec.ticket = 0;
  rec.copied_recorded = false;
  plan.record = -1;
}

// ---- prediction quality ----

template <KvElement T>
void CudaEngine<T>::score_and_select(gpu::detail::Scratch& sc, int layer, const gpu::DeviceBatch& batch, const void* q,
                                     DType qtype, std::int64_t rows, gpu::Candidates candidates, cudaStream_t stream,
                                     int next_rows) const {
  // The runs scorer reads the run key sums; quest and spread the min/max summaries.
  const float* summaries = layout_.score.runs > 0 ? run_sums_.data() : summaries_.data();
  if (qtype == DType::f32) {
    gpu::score_blocks<float>(device_layout_, layer, batch, static_cast<const float*>(q), static_cast<int>(rows),
                             summaries, sc.buffers(), stream, candidates, next_rows);
  } else {
    gpu::score_blocks<T>(device_layout_, layer, batch, static_cast<const T*>(q), static_cast<int>(rows), summaries,
                         sc.buffers(), stream, candidates, next_rows);
  }
  const int H = layout_.num_kv_heads();
  gpu::segmented_top_k(sc.scores.data(), sc.stride, sc.count.data(), sc.first.data(), batch.size * H,
                       layout_.max_selectable_blocks,
                       device_layout_.profiled() ? device_layout_.head_budgets + static_cast<std::ptrdiff_t>(layer) * H
                                                 : nullptr,
                       H, sc.sel.data(), sc.sel_count.data(), stream);
}

template <KvElement T>
void CudaEngine<T>::observe(int layer, std::span<const ViewEntry> entries, RowsView q, std::int64_t rows) {
  if (layout_.max_selectable_blocks <= 0) return;
  gpu::DeviceGuard guard(device_);
  const auto& vb = *views_[static_cast<std::size_t>(layer)];
  const int B = static_cast<int>(entries.size());
  score_and_select(*observe_scratch_, layer, gpu::DeviceBatch{B, vb.seq_slot, vb.seq_len}, q.data, q.dtype, rows,
                   gpu::Candidates::current, compute_);
  gpu::count_resident_hits(observe_scratch_->sel.data(), observe_scratch_->sel_count.data(),
                           layout_.max_selectable_blocks, B * layout_.num_kv_heads(), vb.indptr.data(), vb.block.data(),
                           counters_.data() + 3 * layer + 2, compute_);
}

// Synchronous: scores on the compute stream and reads the selection back.
template <KvElement T>
std::vector<std::vector<std::int32_t>> CudaEngine<T>::select_blocks(int slot, int layer, std::int64_t length,
                                                                    RowsView q, std::int64_t rows) const {
  const int H = layout_.num_kv_heads();
  const int K = layout_.max_selectable_blocks;  // the selection's row stride
  std::vector<std::vector<std::int32_t>> out(static_cast<std::size_t>(H));
  if (K == 0) return out;
  gpu::DeviceGuard guard(device_);
  gpu::detail::Words w;
  const std::vector<std::int32_t> seq_slot{slot};
  const std::vector<std::int64_t> lens{length};
  const std::size_t o_slot = w.add(seq_slot), o_len = w.add(lens);
  gpu::upload_words(select_meta_.data(), w.words, compute_);
  const gpu::DeviceBatch batch{1, gpu::detail::word_at<std::int32_t>(select_meta_, o_slot),
                               gpu::detail::word_at<std::int64_t>(select_meta_, o_len)};
  auto& sc = *observe_scratch_;
  score_and_select(sc, layer, batch, q.data, q.dtype, rows, gpu::Candidates::next_step, compute_);
  std::vector<std::int32_t> sel(static_cast<std::size_t>(H) * static_cast<std::size_t>(K)),
      count(static_cast<std::size_t>(H));
  OASISKV_CUDA_CHECK(
      cudaMemcpyAsync(sel.data(), sc.sel.data(), sel.size() * sizeof(std::int32_t), cudaMemcpyDeviceToHost, compute_));
  OASISKV_CUDA_CHECK(cudaMemcpyAsync(count.data(), sc.sel_count.data(), count.size() * sizeof(std::int32_t),
                                     cudaMemcpyDeviceToHost, compute_));
  OASISKV_CUDA_CHECK(cudaStreamSynchronize(compute_));
  for (int h = 0; h < H; ++h) {
    const auto begin = sel.begin() + static_cast<std::ptrdiff_t>(h) * K;
    out[static_cast<std::size_t>(h)].assign(begin, begin + count[static_cast<std::size_t>(h)]);
  }
  return out;
}

// ---- beyond the resident set ----

// On the compute stream, over the view build_view made for this layer (its sequence slots,
// lengths and CSR arrays are on the device already); out and lse are device memory (or mapped
// pinned host memory), filled when the stream gets there. No allocation, no host wait.
template <KvElement T>
void CudaEngine<T>::remainder(int layer, std::span<const ViewEntry> entries, RowsView q, std::int64_t rows, float* out,
                              float* lse) {
  gpu::DeviceGuard guard(device_);
  const auto& vb = *views_[static_cast<std::size_t>(layer)];
  const gpu::DeviceBatch batch{static_cast<int>(entries.size()), vb.seq_slot, vb.seq_len};
  remainder_->estimate(layer, batch, vb.indptr.data(), vb.block.data(), q, rows, out, lse);  // Cache refused `none`
}

// An output the device writes: pageable host memory and another device's memory are refused
// (outside capture, as check_input).
template <KvElement T>
void CudaEngine<T>::check_output(const float* p, const char* name, const char* call, std::int64_t floats) const {
  check_input(RowsView{p, DType::f32, 1}, name, call, floats);
}

// ---- statistics ----

// Layer 0 synchronises both streams and reads every layer's counters back; the other layers
// return what that read (Cache::statistics asks for layers in order).
template <KvElement T>
EngineCounters CudaEngine<T>::counters(int layer) const {
  if (layer == 0) {
    gpu::DeviceGuard guard(device_);
    copy_.synchronize();
    OASISKV_CUDA_CHECK(cudaStreamSynchronize(compute_));
    OASISKV_CUDA_CHECK(cudaMemcpy(host_counters_.data(), counters_.data(), counters_.bytes(), cudaMemcpyDeviceToHost));
  }
  const auto at = static_cast<std::size_t>(layer) * 3u;
  return EngineCounters{host_counters_[at], host_counters_[at + 1], host_counters_[at + 2],
                        remote_blocks_read_[static_cast<std::size_t>(layer)].load()};
}

template <KvElement T>
void CudaEngine<T>::reset_counters() {
  gpu::DeviceGuard guard(device_);
  synchronize();
  counters_.fill_async(0, compute_);
  OASISKV_CUDA_CHECK(cudaStreamSynchronize(compute_));
  for (int l = 0; l < layout_.num_layers(); ++l) remote_blocks_read_[static_cast<std::size_t>(l)] = 0;
}

}  // namespace v0
}  // namespace oasiskv
