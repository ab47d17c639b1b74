// CudaEngine<T>: the CUDA backend of Cache<cuda, T> (the contract for users is in
// oasiskv/cuda/cache.hpp). Host code: it enqueues the kernels of oasiskv/cuda/ops.hpp on two
// streams, the engine's compute stream (append, query staging, views, observe) and its own copy
// stream (scoring, top-K, planning, gathers), and never synchronises the host on the decode path.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "oasiskv/admission.hpp"
#include "oasiskv/backend.hpp"
#include "oasiskv/cache_engine.hpp"
#include "oasiskv/config.hpp"
#include "oasiskv/cuda/check.hpp"
#include "oasiskv/cuda/detail/engine_buffers.hpp"
#include "oasiskv/cuda/detail/remainder/make_device_remainder.hpp"
#include "oasiskv/cuda/detail/remote_reads.hpp"
#include "oasiskv/cuda/device_memory.hpp"
#include "oasiskv/cuda/ops.hpp"
#include "oasiskv/cuda/pinned_region.hpp"
#include "oasiskv/dtype.hpp"
#include "oasiskv/error.hpp"
#include "oasiskv/kit/block_source.hpp"
#include "oasiskv/kit/tier.hpp"
#include "oasiskv/remote_blocks.hpp"

namespace oasiskv {
inline namespace v0 {

struct CudaOptions {
  // The engine's stream: append, the views and observe run there, and the engine's attention
  // must run there (or be ordered before release on it).
  cudaStream_t compute_stream = nullptr;
  // Query rows per sequence that prefetch, observe and select_blocks accept (lookahead rows):
  // scratch is sized for it at construction, since graph capture allows no allocation.
  int max_query_rows = 4;
  // Tickets per layer that may be outstanding (prefetched, not released, not dead).
  int tickets_per_layer = 2;
  // Staged lookahead-query buffers (a ring shared by all layers): how many prefetches the copy
  // stream may lag behind before prefetch makes the compute stream wait for scoring.
  int query_staging_buffers = 4;
};

template <KvElement T>
class CudaEngine {
 public:
  using element_type = T;
  using Options = CudaOptions;
  using HostTier = oasiskv::HostTier<T, gpu::PinnedRegion>;
  using Pool = SlotPool<T, gpu::DeviceBuffer<std::byte>>;
  static_assert(BlockSource<HostTier, T>);
  struct Plan {
    int record = -1;  // index into the layer's record pool
    int layer = 0;
  };

  CudaEngine(const CacheLayout& layout, const Options& options);
  ~CudaEngine();
  CudaEngine(const CudaEngine&) = delete;
  CudaEngine& operator=(const CudaEngine&) = delete;

  const HostTier& host_tier() const noexcept { return host_; }
  // The device mirror of host_tier().pool().map() (for tests).
  const std::int32_t* device_block_map() const noexcept { return block_map_.data(); }
  const Pool& slot_pool() const noexcept { return pool_; }
  // Block summaries on the device, SummaryStore's layout (for tests and engines' own kernels).
  const float* summaries() const noexcept { return summaries_.data(); }
  // Run key sums on the device (scorer runs; SummaryStore::runs' layout), null otherwise.
  const float* run_sums() const noexcept { return run_sums_.data(); }
  // What CacheConfig::remainder keeps on the device (cuda/detail/remainder/), or null with `none`.
  const gpu::detail::DeviceRemainder<T>* remainder_store() const noexcept { return remainder_.get(); }
  const Options& options() const noexcept { return options_; }
  int device() const noexcept { return device_; }
  cudaStream_t compute_stream() const noexcept { return options_.compute_stream; }
  cudaStream_t copy_stream() const noexcept { return copy_.get(); }
  // Ends the copy stream's work in the compute stream (an event): call it before
  // cudaStreamBeginCapture (eagerly) and before cudaStreamEndCapture (inside the capture).
  void join();

  // ---- hooks (cache_engine.hpp) ----
  std::int64_t max_query_rows() const noexcept { return options_.max_query_rows; }
  int max_live_tickets_per_layer() const noexcept { return options_.tickets_per_layer; }
  void enter(const char* call, CallKind kind) const;
  std::uint64_t capture_id() const noexcept { return capture_; }
  void synchronize();
  void check_input(const RowsView& r, const char* name, const char* call, std::int64_t elements) const;
  void sequence_added(int slot, std::uint32_t generation);
  void sequence_removed(int slot, std::uint32_t generation);
  // Remote tier (Cache::admit; oasiskv/cuda/detail/remote_reads.hpp): not during graph capture.
  void admit(int slot, const AdmissionMessage& message, std::shared_ptr<RemoteBlockSource> source);
  void finish_admission(int slot);
  // The admission message's lookahead queries copied to the device (on the compute stream) for
  // the first plans of Cache::admit; kept until the next admission, whose synchronize() comes first.
  const float* admission_queries(std::span<const float> q);
  std::string sequence_failure(int slot) const;
  void check_plan(std::span<const int> slots, const char* call) const;
  void reset_layer(int layer);
  void truncate(int slot, int layer, std::int64_t old_length, std::int64_t length);
  void map_blocks(std::span<const AppendEntry> entries, std::vector<BlockRemap>& changes);
  void undo_blocks(std::span<const BlockRemap> changes) { host_.pool().undo(changes); }
  void release_blocks(int slot, std::int64_t first_block) { host_.pool().release_from(slot, first_block); }
  void fork(int src, int dst, std::int64_t length);
  void append(int layer, std::span<const AppendEntry> entries, RowsView k, RowsView v);
  Plan plan(int layer, std::span<const PlanEntry> entries, RowsView q, std::int64_t rows, std::uint64_t ticket);
  void start_copies(Plan& plan, std::span<const int> entries);
  std::int64_t wait(Plan& plan);
  LayerView<T> build_view(int layer, const Plan& plan, std::span<const ViewEntry> entries);
  void release_view(int /*layer*/) noexcept {}
  void free_plan(Plan& plan) noexcept;
  void observe(int layer, std::span<const ViewEntry> entries, RowsView q, std::int64_t rows);
  std::vector<std::vector<std::int32_t>> select_blocks(int slot, int layer, std::int64_t length, RowsView q,
                                                       std::int64_t rows) const;
  // Cache::remainder: q, out and lse in device memory; enqueued on the compute stream.
  void remainder(int layer, std::span<const ViewEntry> entries, RowsView q, std::int64_t rows, float* out, float* lse);
  // Refuses an output buffer the device cannot write (pageable host memory, another device's).
  void check_output(const float* p, const char* name, const char* call, std::int64_t floats) const;
  EngineCounters counters(int layer) const;
  void reset_counters();

 private:
  using Record = gpu::detail::PlanRecord;
  Record& record(const Plan& p) const {
    return *records_[static_cast<std::size_t>(p.layer)][static_cast<std::size_t>(p.record)];
  }
  unsigned long long stream_capture_id() const;
  void check_capture_ready(const char* call) const;
  void fork_copy_stream();
  gpu::DeviceHostTier<T> device_host() const noexcept {
    return {reinterpret_cast<T*>(host_.memory().device_data()), block_map_.data()};
  }
  void upload_map(int slot, std::int64_t first, std::int64_t count);
  const T* start_remote_reads(Record& rec, int layer, std::span<const int> entries);
  void score_and_select(gpu::detail::Scratch& sc, int layer, const gpu::DeviceBatch& batch, const void* q, DType qtype,
                        std::int64_t rows, gpu::Candidates candidates, cudaStream_t stream, int next_rows = 1) const;

  CacheLayout layout_;  // the Cache's: a profile's tables in host memory
  Options options_;
  int device_ = 0;
  cudaStream_t compute_;
  gpu::Stream copy_;
  gpu::Event fork_, join_;
  HostTier host_;
  // The host pool's block map, mirrored on the device for the kernels (set on the compute stream
  // before the kernels that read it; entries are never cleared, so a stale read stays in the pool).
  gpu::DeviceBuffer<std::int32_t> block_map_;
  Pool pool_;
  gpu::DeviceBuffer<float> summaries_;
  gpu::DeviceBuffer<float> run_sums_;  // scorer runs only (layout.run_floats; empty otherwise)
  gpu::DeviceBuffer<std::int32_t> res_block_;
  gpu::DeviceBuffer<std::int64_t> res_last_;
  gpu::DeviceBuffer<unsigned long long> counters_;  // per layer: fetched, capped, observed hits
  // A budget profile's tables on the device, and a copy of layout_ pointing at them: what every
  // kernel gets (the same as layout_ without a profile).
  gpu::DeviceBuffer<HeadBudget> head_budgets_;
  gpu::DeviceBuffer<LayerSlots> layer_pools_;
  CacheLayout device_layout_;
  std::unique_ptr<gpu::detail::DeviceRemainder<T>> remainder_;  // CacheConfig::remainder's, or null
  std::unique_ptr<gpu::detail::Scratch> scratch_;               // copy stream (prefetch)
  std::unique_ptr<gpu::detail::Scratch> observe_scratch_;       // compute stream (observe, select_blocks)
  std::unique_ptr<gpu::detail::QueryStaging> staging_;
  gpu::DeviceBuffer<std::uint32_t> append_meta_, select_meta_;
  std::vector<std::vector<std::unique_ptr<Record>>> records_;     // per layer
  std::vector<std::unique_ptr<gpu::detail::ViewBuffers>> views_;  // per layer
  mutable std::vector<unsigned long long> host_counters_;
  mutable unsigned long long capture_ = 0;  // capture id of the call in progress (0: eager)
  unsigned long long copy_capture_ = 0;     // capture the copy stream last joined
  bool copy_unjoined_ = false;              // eager copy-stream work not yet joined
  // Remote tier: per sequence slot, where an admitted sequence's remote blocks are, and its
  // generation; failed reads; the pinned buffers of the host functions that read (they outlive
  // the copy stream's work: the destructor synchronises first).
  std::vector<std::shared_ptr<const gpu::detail::RemoteBlocks>> remote_;
  gpu::DeviceBuffer<float> admission_queries_;
  std::vector<std::uint32_t> generation_;
  gpu::detail::RemoteFailures remote_failures_;
  gpu::detail::PinnedBuffers remote_buffers_;
  std::unique_ptr<std::atomic<std::uint64_t>[]> remote_blocks_read_;  // per layer
};

template <class T>
struct backend_engine<cuda, T> {
  using type = CudaEngine<T>;
};
// The optional hooks the CUDA engine has (cache_engine.hpp): a drift fails here, not in a caller.
static_assert(CacheEngine<CudaEngine<float>> && AdmittingEngine<CudaEngine<float>> &&
              ReportsSequenceFailure<CudaEngine<float>> && EstimatesRemainder<CudaEngine<float>> &&
              ChecksPlans<CudaEngine<float>> && ChecksOutputs<CudaEngine<float>> && JoinsStreams<CudaEngine<float>>);

}  // namespace v0
}  // namespace oasiskv

#include "oasiskv/cuda/detail/engine_impl.hpp"
#include "oasiskv/cuda/detail/engine_remote.hpp"
