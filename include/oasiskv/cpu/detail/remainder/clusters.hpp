// ClustersRemainder<T>: `remainder = clusters` on the CPU. Every block keeps its key and value
// sums (BlockMoments); when an append fills a segment of kClusterSegmentBlocks blocks, its keys
// are clustered (KeyClusters, per layer and kv head). The estimate gives each cluster the centroid
// logit of its means weighted by its rows outside the view, and every block of a segment not
// clustered (the last, partial one; one cut by a truncate; an admitted prompt's that the prefill
// cache had not clustered) its own centroid (block_moments.hpp). The admission message carries
// the block sums and the clusters of the prompt's leading clustered segments.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "oasiskv/config.hpp"
#include "oasiskv/cpu/detail/remainder/block_moments.hpp"
#include "oasiskv/cpu/detail/remainder/key_clusters.hpp"
#include "oasiskv/cpu/detail/remainder/remainder_store.hpp"
#include "oasiskv/kit/host_block_pool.hpp"
#include "oasiskv/kit/tier.hpp"

namespace oasiskv {
inline namespace v0 {
namespace detail {

template <KvElement T>
class ClustersRemainder final : public RemainderStore<T> {
 public:
  ClustersRemainder(const CacheLayout& layout, const HostTier<T>& host)
      : layout_(layout), host_(host), moments_(layout), clusters_(layout) {}

  const BlockMoments& moments() const noexcept { return moments_; }
  const KeyClusters& key_clusters() const noexcept { return clusters_; }

  void appended(int slot, int layer, std::int64_t from, std::int64_t to) override {
    for (int h = 0; h < layout_.num_kv_heads(); ++h) fold_rows(slot, layer, h, from, to);
    clusters_.cluster_filled(
        slot, layer, from, to, [&](std::int64_t b) { return host_.pool().at(slot, b) != kRemoteBlock; },
        [&](int h, std::int64_t b) { return host_.block(slot, layer, h, b); });
  }
  void truncated(int slot, int layer, std::int64_t length) override {
    clusters_.forget_from(slot, layer, length);
    const std::int64_t bt = layout_.block_tokens();
    for (int h = 0; h < layout_.num_kv_heads(); ++h) fold_rows(slot, layer, h, length / bt * bt, length);
  }
  void forked(int src, int dst, int layer, std::int64_t length) override {
    clusters_.copy(src, dst, layer, length);
    const std::int64_t bt = layout_.block_tokens();
    for (int h = 0; h < layout_.num_kv_heads(); ++h) {
      moments_.copy_blocks(src, dst, layer, h, length / bt);
      fold_rows(dst, layer, h, length / bt * bt, length);  // the partial block: from its first rows
    }
  }
  void reset(int slot) override { clusters_.reset(slot); }

  void estimate(int slot, int layer, int kv_head, std::int64_t length, std::span<const std::int32_t> resident,
                const RowsView& q, std::int64_t entry, std::int64_t rows, float* out, float* lse) override {
    const int G = layout_.group_size, d = layout_.head_dim(), h = kv_head;
    const std::int64_t bt = layout_.block_tokens(), nb = layout_.blocks_for(length);
    sets_.clear();
    auto next = resident.begin();  // ascending
    for (std::int64_t b = 0; b < nb; ++b) {
      const bool in_view = next != resident.end() && *next == b;
      if (in_view) ++next;
      if (clusters_.clustered(slot, layer, h, b / kClusterSegmentBlocks)) continue;  // its clusters, below
      if (in_view) continue;
      sets_.push_back(
          CentroidSums{moments_.sums(slot, layer, h, b), static_cast<int>(std::min(bt, length - b * bt)), 0});
    }
    clusters_.add_estimate_blocks(slot, layer, h, nb, resident.data(), resident.data() + resident.size(), sets_);
    query_.resize(static_cast<std::size_t>(d));
    for (std::int64_t r = 0; r < rows; ++r) {
      for (int g = h * G; g < (h + 1) * G; ++g) {
        const std::int64_t state = (entry * rows + r) * layout_.num_q_heads() + g;
        for (int c = 0; c < d; ++c) {
          query_[static_cast<std::size_t>(c)] = load_as_float(q.data, q.dtype, static_cast<std::size_t>(state * d + c));
        }
        centroid_state(query_.data(), sets_, d, layout_.softmax_scale, out + state * d, lse[state], logits_);
      }
    }
  }

  void export_admission(int slot, std::int64_t length, AdmissionMessage& m) const override {
    const int d = layout_.head_dim();
    const std::int64_t nb = layout_.blocks_for(length);
    m.moment_vectors = 2;
    for (int l = 0; l < layout_.num_layers(); ++l) {
      for (int h = 0; h < layout_.num_kv_heads(); ++h) {
        if (nb == 0) continue;
        const float* s = moments_.sums(slot, l, h, 0);
        m.moments.insert(m.moments.end(), s, s + nb * 2 * d);
      }
    }
    // The prompt's key clusters: the leading segments clustered in every layer and kv head.
    m.cluster_rows = layout_.config.remainder_cluster_rows;
    m.cluster_segments = static_cast<std::int32_t>(clusters_.leading_clustered(slot));
    const int k = clusters_.clusters_per_segment();
    for (int l = 0; l < layout_.num_layers(); ++l) {
      for (int h = 0; h < layout_.num_kv_heads(); ++h) {
        for (std::int64_t s = 0; s < m.cluster_segments; ++s) {
          const std::uint8_t* ids = clusters_.ids(slot, l, h, s);
          m.cluster_ids.insert(m.cluster_ids.end(), ids, ids + clusters_.segment_rows());
          const float* sums = clusters_.sums(slot, l, h, s, 0);
          m.cluster_sums.insert(m.cluster_sums.end(), sums, sums + static_cast<std::ptrdiff_t>(k) * 2 * d);
          for (int c = 0; c < k; ++c) m.cluster_counts.push_back(clusters_.count(slot, l, h, s, c));
        }
      }
    }
  }

  void admit(int slot, const AdmissionMessage& m) override {
    const int H = layout_.num_kv_heads(), d = layout_.head_dim();
    const std::int64_t nb = layout_.blocks_for(m.length);
    const auto floats = static_cast<std::size_t>(nb) * 2 * static_cast<std::size_t>(d);
    for (int l = 0; l < layout_.num_layers(); ++l) {
      for (int h = 0; h < H; ++h) {
        const std::size_t p = static_cast<std::size_t>(l) * static_cast<std::size_t>(H) + static_cast<std::size_t>(h);
        moments_.assign_blocks(slot, l, h, nb, m.moments.data() + p * floats);
      }
    }
    const auto seg_rows = static_cast<std::size_t>(clusters_.segment_rows());
    const auto k = static_cast<std::size_t>(clusters_.clusters_per_segment());
    std::size_t u = 0;
    for (int l = 0; l < layout_.num_layers(); ++l) {
      for (int h = 0; h < H; ++h) {
        for (std::int64_t s = 0; s < m.cluster_segments; ++s, ++u) {
          clusters_.assign(slot, l, h, s, m.cluster_ids.data() + u * seg_rows,
                           m.cluster_sums.data() + u * k * 2 * static_cast<std::size_t>(d),
                           m.cluster_counts.data() + u * k);
        }
      }
    }
  }

 private:
  // Rows [from, to) of (slot, layer, h), read back from the host tier, into their blocks' sums.
  void fold_rows(int slot, int layer, int h, std::int64_t from, std::int64_t to) noexcept {
    for (std::int64_t t = from; t < to; ++t) {
      moments_.add_row(slot, layer, h, t, host_.key(slot, layer, h, t), host_.value(slot, layer, h, t));
    }
  }

  CacheLayout layout_;
  const HostTier<T>& host_;
  BlockMoments moments_;
  KeyClusters clusters_;
  std::vector<CentroidSums> sets_;  // scratch of estimate
  std::vector<float> query_, logits_;
};

}  // namespace detail
}  // namespace v0
}  // namespace oasiskv
