// Cache<cuda, T>: the facade over the CUDA backend's device components. SKELETON.
//
// Status: the constructor builds every device component (pinned host tier, HBM slot pool,
// summaries, residency arrays, a copy stream and per-layer release/copy events) and the sequence
// lifecycle works; append, prefetch, acquire, release and observe are declared with the CPU
// facade's signatures but throw oasiskv::Error("... not implemented ...") for now. The kernels
// they will compose (oasiskv/cuda/ops.cuh) are implemented and tested against the CPU backend.
//
// Intended composition (DESIGN.md section 1), with no host synchronisation and no
// device-to-host copy on the decode path:
//   append:   per-call metadata (slots, lengths, row offsets) -> pinned staging -> cudaMemcpyAsync;
//             gpu::append on the compute stream (host tier via its mapped pointer).
//   prefetch: copy stream waits for an event recorded on the compute stream (summaries ready)
//             and for release_[layer]; score_blocks, segmented_top_k, plan_transfers (residency
//             kept on the device), gather_admits; records copied_[layer]. The post-plan residency
//             is snapshotted per ticket for acquire's view.
//   acquire:  compute stream waits for copied_[layer]; a view-building kernel writes the CSR
//             (indptr, slot, block, valid) on the device; LayerView points at device arrays.
//   release:  records release_[layer] on the compute stream.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "oasiskv/cache.hpp"
#include "oasiskv/cuda/components.cuh"
#include "oasiskv/cuda/ops.cuh"

namespace oasiskv {
inline namespace v0 {

template <KvElement T>
class Cache<cuda, T> {
 public:
  using element_type = T;

  // compute_stream: the engine's stream (attention runs there); the cache adds its copy stream.
  explicit Cache(const CacheConfig& config, cudaStream_t compute_stream = nullptr)
      : layout_(CacheLayout::from(config)),
        geometry_(gpu::Geometry::from(layout_)),
        compute_(compute_stream),
        host_(layout_),
        device_(layout_),
        summaries_(static_cast<std::size_t>(config.max_sequences) * static_cast<std::size_t>(config.shape.num_layers) *
                   static_cast<std::size_t>(config.shape.num_kv_heads) * static_cast<std::size_t>(layout_.max_blocks) *
                   2u * static_cast<std::size_t>(config.shape.head_dim)),
        res_block_(residency_size()),
        res_last_(residency_size()),
        table_(layout_) {
    OASISKV_CUDA_CHECK(cudaMemset(res_block_.data(), 0xff, res_block_.bytes()));  // kNoBlock
    OASISKV_CUDA_CHECK(cudaMemset(res_last_.data(), 0xff, res_last_.bytes()));    // -1
    for (int l = 0; l < config.shape.num_layers; ++l) {
      released_.emplace_back(std::make_unique<gpu::Event>());
      copied_.emplace_back(std::make_unique<gpu::Event>());
    }
  }

  const CacheLayout& layout() const noexcept { return layout_; }
  const gpu::PinnedHostTier<T>& host_tier() const noexcept { return host_; }
  const DeviceTier<cuda, T>& device_tier() const noexcept { return device_; }
  cudaStream_t copy_stream() const noexcept { return copy_.get(); }

  // ---- sequence lifecycle (host bookkeeping, as the CPU facade) --------------------------------
  void add_sequence(SeqId id) {
    if (table_.find(id) >= 0) fail("add_sequence: sequence {} is already in the cache", id);
    if (table_.free_slots() == 0) {
      fail("add_sequence: cannot add sequence {}: all {} sequence slots are in use (max_sequences)", id,
           layout_.config.max_sequences);
    }
    table_.add(id);
  }
  void remove_sequence(SeqId id) {
    const int s = table_.find(id);
    if (s < 0) fail("remove_sequence: sequence {} is not in the cache", id);
    table_.remove(s);
  }
  bool has_sequence(SeqId id) const noexcept { return table_.find(id) >= 0; }
  std::size_t num_sequences() const noexcept { return table_.num_sequences(); }

  // ---- decode step: NOT IMPLEMENTED YET (see the header comment) -------------------------------
  void append(std::span<const SeqId>, int, std::span<const std::int32_t>, RowsView, RowsView) { todo("append"); }
  void append(std::span<const SeqId>, int, RowsView, RowsView) { todo("append"); }
  Ticket prefetch(std::span<const SeqId>, int, RowsView) { todo("prefetch"); }
  LayerView<T> acquire(const Ticket&) { todo("acquire"); }
  void release(const Ticket&) { todo("release"); }
  void observe(const Ticket&, RowsView) { todo("observe"); }
  const Statistics& statistics() const noexcept { return stats_; }

 private:
  std::size_t residency_size() const noexcept {
    const auto& s = layout_.config.shape;
    return static_cast<std::size_t>(layout_.config.max_sequences) * static_cast<std::size_t>(s.num_layers) *
           static_cast<std::size_t>(s.num_kv_heads) * static_cast<std::size_t>(layout_.selectable_blocks);
  }
  [[noreturn]] static void todo(const char* call) {
    fail("Cache<cuda>::{} is not implemented yet: use the device operations in oasiskv/cuda/ops.cuh", call);
  }

  CacheLayout layout_;
  gpu::Geometry geometry_;
  cudaStream_t compute_;
  gpu::Stream copy_;
  gpu::PinnedHostTier<T> host_;
  DeviceTier<cuda, T> device_;
  gpu::DeviceBuffer<float> summaries_;
  gpu::DeviceBuffer<std::int32_t> res_block_;
  gpu::DeviceBuffer<std::int64_t> res_last_;
  std::vector<std::unique_ptr<gpu::Event>> released_, copied_;
  BlockTable table_;
  Statistics stats_;
};

}  // namespace v0
}  // namespace oasiskv
