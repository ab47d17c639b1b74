// DeviceClustersRemainder<T>: `remainder = clusters` on the device (the twin of the CPU's
// cpu/detail/remainder/clusters.hpp). Every block's key and value sums (CacheLayout::moment_offset),
// folded by a companion of the append kernel, refolded on truncate, copied on fork; and
// KeyClusters' arrays (cpu/detail/remainder/key_clusters.hpp's layout), a segment clustered on the
// compute stream when an append fills it (bit for bit the CPU's k-means), forgotten, copied and
// reset as the CPU's are. Host code.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>

#include "oasiskv/cuda/check.hpp"
#include "oasiskv/cuda/detail/remainder/device_remainder.hpp"
#include "oasiskv/cuda/device_memory.hpp"
#include "oasiskv/detail/checked.hpp"

namespace oasiskv {
inline namespace v0 {
namespace gpu::detail {

template <KvElement T>
class DeviceClustersRemainder final : public DeviceRemainder<T> {
 public:
  explicit DeviceClustersRemainder(const RemainderContext<T>& ctx)
      : ctx_(ctx), layout_(*ctx.layout), moments_(static_cast<std::size_t>(layout_.remainder.moment_floats)) {
    if (layout_.max_blocks < kClusterSegmentBlocks) return;  // no sequence holds a segment: no clusters
    DeviceClusters& c = clusters_;
    c.segment_rows = kClusterSegmentBlocks * layout_.block_tokens();
    c.k = c.segment_rows / layout_.config.remainder_cluster_rows;
    c.segments = layout_.max_blocks / kClusterSegmentBlocks;
    using oasiskv::detail::checked_product;
    const std::int64_t units =
        checked_product("Cache<cuda>: cluster units (sequences x layers x kv heads x segments)",
                        layout_.config.max_sequences, layout_.num_layers(), layout_.num_kv_heads(), c.segments);
    sums_ = DeviceBuffer<float>(static_cast<std::size_t>(
        checked_product("Cache<cuda>: cluster sum floats", units, c.k, 2, layout_.head_dim())));
    counts_ = DeviceBuffer<std::int32_t>(static_cast<std::size_t>(units * c.k));
    ids_ = DeviceBuffer<std::uint8_t>(
        static_cast<std::size_t>(checked_product("Cache<cuda>: cluster row ids", units, c.segment_rows)));
    flags_ = DeviceBuffer<std::uint8_t>(static_cast<std::size_t>(units));
    scratch_ =
        DeviceBuffer<float>(static_cast<std::size_t>(layout_.num_kv_heads()) *
                            static_cast<std::size_t>(c.segment_rows) * static_cast<std::size_t>(layout_.head_dim()));
    c.sums = sums_.data();
    c.counts = counts_.data();
    c.ids = ids_.data();
    c.clustered = flags_.data();
    flags_.fill_async(0, ctx_.compute);
  }

  // The block sums on the device, and the key clusters (null pointers when no sequence holds a
  // segment): for tests.
  const float* moments() const noexcept { return moments_.data(); }
  const DeviceClusters& key_clusters() const noexcept { return clusters_; }

  void reset(int slot) override {
    if (clusters_.clustered == nullptr) return;  // nothing clustered (KeyClusters::reset)
    const std::int64_t first = clusters_.unit(layout_, slot, 0, 0, 0), end = clusters_.unit(layout_, slot + 1, 0, 0, 0);
    OASISKV_CUDA_CHECK(
        cudaMemsetAsync(clusters_.clustered + first, 0, static_cast<std::size_t>(end - first), ctx_.compute));
  }

  void appended(int layer, const DeviceBatch& batch, const std::int32_t* row_offset, const T* k, const T* v,
                std::span<const AppendEntry> entries) override {
    append_moments<T>(*ctx_.device_layout, layer, batch, row_offset, k, v, moments_.data(), ctx_.compute);
    if (clusters_.clustered == nullptr) return;
    // After append: its host rows. A segment with a remote block (an admitted prompt's) stays
    // unclustered here (its clustering, if any, came with the admission).
    for (const AppendEntry& e : entries) {
      const std::int64_t rows = clusters_.segment_rows;
      for (std::int64_t s = e.length / rows; s < (e.length + e.rows) / rows && s < clusters_.segments; ++s) {
        bool local = true;
        for (std::int64_t b = s * kClusterSegmentBlocks; b < (s + 1) * kClusterSegmentBlocks && local; ++b) {
          local = ctx_.pool->at(e.slot, b) != kRemoteBlock;
        }
        if (local) {
          cluster_segment<T>(*ctx_.device_layout, e.slot, layer, s, ctx_.host, clusters_, scratch_.data(),
                             ctx_.compute);
        }
      }
    }
  }

  void truncated(int slot, int layer, std::int64_t length) override {
    if (clusters_.clustered != nullptr) {  // KeyClusters::forget_from: the segments not wholly below `length`
      const std::int64_t first = length / clusters_.segment_rows;
      for (int h = 0; first < clusters_.segments && h < layout_.num_kv_heads(); ++h) {
        OASISKV_CUDA_CHECK(cudaMemsetAsync(clusters_.clustered + clusters_.unit(layout_, slot, layer, h, first), 0,
                                           static_cast<std::size_t>(clusters_.segments - first), ctx_.compute));
      }
    }
    rebuild_moments<T>(*ctx_.device_layout, slot, slot, layer, length, ctx_.host, moments_.data(), ctx_.compute);
  }

  void forked(int src, int dst, int layer, std::int64_t length) override {
    if (clusters_.clustered != nullptr) copy_clusters(src, dst, layer, length);
    rebuild_moments<T>(*ctx_.device_layout, src, dst, layer, length, ctx_.host, moments_.data(), ctx_.compute);
  }

  void estimate(int layer, const DeviceBatch& batch, const std::int32_t* indptr, const std::int32_t* block,
                const RowsView& q, std::int64_t rows, float* out, float* lse) override {
    if (q.dtype == DType::f32) {
      remainder<float>(*ctx_.device_layout, layer, batch, indptr, block, static_cast<const float*>(q.data),
                       static_cast<int>(rows), moments_.data(), out, lse, clusters_, ctx_.compute);
    } else {
      remainder<T>(*ctx_.device_layout, layer, batch, indptr, block, static_cast<const T*>(q.data),
                   static_cast<int>(rows), moments_.data(), out, lse, clusters_, ctx_.compute);
    }
  }

  void admit(int slot, const AdmissionMessage& m) override {
    const int H = layout_.num_kv_heads();
    const std::int64_t nb = layout_.blocks_for(m.length);
    const auto floats = static_cast<std::size_t>(nb) * 2 * static_cast<std::size_t>(layout_.head_dim());
    for (int l = 0; l < layout_.num_layers() && nb > 0; ++l) {
      for (int h = 0; h < H; ++h) {
        const std::size_t p = static_cast<std::size_t>(l) * static_cast<std::size_t>(H) + static_cast<std::size_t>(h);
        OASISKV_CUDA_CHECK(cudaMemcpy(moments_.data() + layout_.moment_offset(slot, l, h, 0),
                                      m.moments.data() + p * floats, floats * sizeof(float), cudaMemcpyHostToDevice));
      }
    }
    if (clusters_.clustered == nullptr || m.cluster_segments <= 0) return;
    // The prompt's key clusters (KeyClusters::assign), in the message's order [layer][kv head][segment].
    const DeviceClusters& c = clusters_;
    const auto rows = static_cast<std::size_t>(c.segment_rows), k = static_cast<std::size_t>(c.k);
    const auto d = static_cast<std::size_t>(layout_.head_dim()), n = static_cast<std::size_t>(m.cluster_segments);
    std::size_t u = 0;  // the message's unit
    for (int l = 0; l < layout_.num_layers(); ++l) {
      for (int h = 0; h < H; ++h, u += n) {
        const auto at = static_cast<std::size_t>(c.unit(layout_, slot, l, h, 0));
        OASISKV_CUDA_CHECK(
            cudaMemcpy(c.ids + at * rows, m.cluster_ids.data() + u * rows, n * rows, cudaMemcpyHostToDevice));
        OASISKV_CUDA_CHECK(cudaMemcpy(c.sums + at * k * 2 * d, m.cluster_sums.data() + u * k * 2 * d,
                                      n * k * 2 * d * sizeof(float), cudaMemcpyHostToDevice));
        OASISKV_CUDA_CHECK(cudaMemcpy(c.counts + at * k, m.cluster_counts.data() + u * k, n * k * sizeof(std::int32_t),
                                      cudaMemcpyHostToDevice));
        OASISKV_CUDA_CHECK(cudaMemset(c.clustered + at, 1, n));
      }
    }
  }

 private:
  // KeyClusters::copy: dst's segments wholly below `length` become src's, the rest unclustered.
  void copy_clusters(int src, int dst, int layer, std::int64_t length) {
    const DeviceClusters& c = clusters_;
    const std::int64_t whole = std::min<std::int64_t>(length / c.segment_rows, c.segments);
    const auto d = static_cast<std::size_t>(layout_.head_dim()), k = static_cast<std::size_t>(c.k);
    for (int h = 0; h < layout_.num_kv_heads(); ++h) {
      const auto a = static_cast<std::size_t>(c.unit(layout_, src, layer, h, 0));
      const auto b = static_cast<std::size_t>(c.unit(layout_, dst, layer, h, 0));
      const auto n = static_cast<std::size_t>(whole);
      if (n > 0) {
        OASISKV_CUDA_CHECK(
            cudaMemcpyAsync(c.clustered + b, c.clustered + a, n, cudaMemcpyDeviceToDevice, ctx_.compute));
        OASISKV_CUDA_CHECK(cudaMemcpyAsync(c.sums + b * k * 2 * d, c.sums + a * k * 2 * d,
                                           n * k * 2 * d * sizeof(float), cudaMemcpyDeviceToDevice, ctx_.compute));
        OASISKV_CUDA_CHECK(cudaMemcpyAsync(c.counts + b * k, c.counts + a * k, n * k * sizeof(std::int32_t),
                                           cudaMemcpyDeviceToDevice, ctx_.compute));
        const auto rows = static_cast<std::size_t>(c.segment_rows);
        OASISKV_CUDA_CHECK(
            cudaMemcpyAsync(c.ids + b * rows, c.ids + a * rows, n * rows, cudaMemcpyDeviceToDevice, ctx_.compute));
      }
      if (whole < c.segments) {
        OASISKV_CUDA_CHECK(
            cudaMemsetAsync(c.clustered + b + n, 0, static_cast<std::size_t>(c.segments - whole), ctx_.compute));
      }
    }
  }

  RemainderContext<T> ctx_;
  CacheLayout layout_;  // *ctx_.layout
  DeviceBuffer<float> moments_;
  DeviceBuffer<float> sums_, scratch_;  // scratch: the keys of the segment being clustered
  DeviceBuffer<std::int32_t> counts_;
  DeviceBuffer<std::uint8_t> ids_, flags_;
  DeviceClusters clusters_;  // points at the buffers above; null pointers when no segment fits
};

}  // namespace gpu::detail
}  // namespace v0
}  // namespace oasiskv
