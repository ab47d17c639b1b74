// Bodies of CudaEngine<T>'s key-cluster hooks (RemainderEstimate::clusters; oasiskv/cuda/engine.hpp):
// KeyClusters' arrays on the device (detail/key_clusters.hpp's layout), clustered, forgotten,
// copied and reset as the CPU engine's are. Host code.
#pragma once

#include <algorithm>
#include <cstdint>

#include "oasiskv/cuda/engine.hpp"  // the declarations (when this file is included on its own)
#include "oasiskv/detail/checked.hpp"
#include "oasiskv/detail/key_clusters.hpp"

namespace oasiskv {
inline namespace v0 {

// The arrays, when the estimate is clusters and a sequence holds at least one segment.
template <KvElement T>
void CudaEngine<T>::init_clusters() {
  static_assert(gpu::kClusterRounds == detail::KeyClusters::kIterations, "the device k-means runs the CPU's rounds");
  if (layout_.config.remainder == RemainderEstimate::clusters && layout_.max_blocks >= kClusterSegmentBlocks) {
    // KeyClusters' geometry and layout (detail/key_clusters.hpp).
    gpu::DeviceClusters& c = clusters_;
    c.segment_rows = kClusterSegmentBlocks * layout_.block_tokens();
    c.k = c.segment_rows / layout_.config.remainder_cluster_rows;
    c.segments = layout_.max_blocks / kClusterSegmentBlocks;
    const std::int64_t units = detail::checked_product("Cache<cuda>: cluster units (sequences x layers x kv heads x segments)",
                                                       layout_.config.max_sequences, layout_.num_layers(),
                                                       layout_.num_kv_heads(), c.segments);
    cluster_sums_ = gpu::DeviceBuffer<float>(static_cast<std::size_t>(
        detail::checked_product("Cache<cuda>: cluster sum floats", units, c.k, 2, layout_.head_dim())));
    cluster_counts_ = gpu::DeviceBuffer<std::int32_t>(static_cast<std::size_t>(units * c.k));
    cluster_ids_ = gpu::DeviceBuffer<std::uint8_t>(static_cast<std::size_t>(
        detail::checked_product("Cache<cuda>: cluster row ids", units, c.segment_rows)));
    cluster_flags_ = gpu::DeviceBuffer<std::uint8_t>(static_cast<std::size_t>(units));
    cluster_scratch_ = gpu::DeviceBuffer<float>(static_cast<std::size_t>(layout_.num_kv_heads()) *
                                                static_cast<std::size_t>(c.segment_rows) *
                                                static_cast<std::size_t>(layout_.head_dim()));
    c.sums = cluster_sums_.data();
    c.counts = cluster_counts_.data();
    c.ids = cluster_ids_.data();
    c.clustered = cluster_flags_.data();
    cluster_flags_.fill_async(0, compute_);
  }
}

// CpuEngine::cluster_completed_segments: a segment with a remote block (an admitted prompt's)
// stays unclustered here (its clustering, if any, came with the admission).
template <KvElement T>
void CudaEngine<T>::cluster_filled(int slot, int layer, std::int64_t from, std::int64_t to) {
  const std::int64_t rows = clusters_.segment_rows;
  for (std::int64_t s = from / rows; s < to / rows && s < clusters_.segments; ++s) {
    bool local = true;
    for (std::int64_t b = s * kClusterSegmentBlocks; b < (s + 1) * kClusterSegmentBlocks && local; ++b) {
      local = host_.pool().at(slot, b) != kRemoteBlock;
    }
    if (local) {
      gpu::cluster_segment<T>(device_layout_, slot, layer, s, device_host(), clusters_, cluster_scratch_.data(), compute_);
    }
  }
}

// KeyClusters::forget_from: the segments not wholly below `length`.
template <KvElement T>
void CudaEngine<T>::forget_clusters(int slot, int layer, std::int64_t length) {
  const std::int64_t first = length / clusters_.segment_rows;
  if (first >= clusters_.segments) return;
  for (int h = 0; h < layout_.num_kv_heads(); ++h) {
    OASISKV_CUDA_CHECK(cudaMemsetAsync(clusters_.clustered + clusters_.unit(layout_, slot, layer, h, first), 0,
                                       static_cast<std::size_t>(clusters_.segments - first), compute_));
  }
}

// KeyClusters::copy: dst's segments wholly below `length` become src's, the rest unclustered.
template <KvElement T>
void CudaEngine<T>::copy_clusters(int src, int dst, int layer, std::int64_t length) {
  const gpu::DeviceClusters& c = clusters_;
  const std::int64_t whole = std::min<std::int64_t>(length / c.segment_rows, c.segments);
  const auto d = static_cast<std::size_t>(layout_.head_dim()), k = static_cast<std::size_t>(c.k);
  for (int h = 0; h < layout_.num_kv_heads(); ++h) {
    const auto a = static_cast<std::size_t>(c.unit(layout_, src, layer, h, 0));
    const auto b = static_cast<std::size_t>(c.unit(layout_, dst, layer, h, 0));
    const auto n = static_cast<std::size_t>(whole);
    if (n > 0) {
      OASISKV_CUDA_CHECK(cudaMemcpyAsync(c.clustered + b, c.clustered + a, n, cudaMemcpyDeviceToDevice, compute_));
      OASISKV_CUDA_CHECK(cudaMemcpyAsync(c.sums + b * k * 2 * d, c.sums + a * k * 2 * d, n * k * 2 * d * sizeof(float),
                                         cudaMemcpyDeviceToDevice, compute_));
      OASISKV_CUDA_CHECK(cudaMemcpyAsync(c.counts + b * k, c.counts + a * k, n * k * sizeof(std::int32_t),
                                         cudaMemcpyDeviceToDevice, compute_));
      const auto rows = static_cast<std::size_t>(c.segment_rows);
      OASISKV_CUDA_CHECK(cudaMemcpyAsync(c.ids + b * rows, c.ids + a * rows, n * rows, cudaMemcpyDeviceToDevice, compute_));
    }
    if (whole < c.segments) {
      OASISKV_CUDA_CHECK(cudaMemsetAsync(c.clustered + b + n, 0, static_cast<std::size_t>(c.segments - whole), compute_));
    }
  }
}

}  // namespace v0
}  // namespace oasiskv
