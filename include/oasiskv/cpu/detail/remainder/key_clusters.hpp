// KeyClusters: the key clusters of `remainder = clusters` on the CPU (clusters.hpp holds them).
// Each full segment of kClusterSegmentBlocks blocks of a (sequence slot, layer, kv head) may hold
// a clustering of its keys: per cluster the key sum, value sum and row count, and a one-byte
// cluster id per row. The estimate weighs each cluster by its rows outside the resident blocks,
// which it counts from the resident blocks' ids alone. Segments not clustered fall back to the
// block sums (block_moments.hpp). An admission brings the prompt's clusters in its message
// (assign); segments with remote rows are never clustered here.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "oasiskv/config.hpp"
#include "oasiskv/cpu/detail/remainder/block_moments.hpp"
#include "oasiskv/detail/checked.hpp"
#include "oasiskv/dtype.hpp"
#include "oasiskv/kit/key_clusters_format.hpp"
#include "oasiskv/kit/reserved_array.hpp"

namespace oasiskv {
inline namespace v0 {
namespace detail {

// Lloyd's k-means (L2) of `rows` key rows ([rows][d] floats) into k clusters: a fixed start (k
// rows spread over the segment by a stride coprime with typical periods), `iterations` rounds of
// assignment and update (an empty cluster keeps its centre). ids: [rows], the last assignment.
// Deterministic: the same rows give the same ids on every machine that rounds floats alike.
void kmeans_keys(const float* keys, int rows, int d, int k, int iterations, std::uint8_t* ids,
                 std::vector<float>& centres, std::vector<float>& scratch);

class KeyClusters {
 public:
  static constexpr int kIterations = kKeyClusterRounds;  // the rounds the CUDA clustering runs too

  explicit KeyClusters(const CacheLayout& layout)
      : enabled_(layout.config.remainder == RemainderEstimate::clusters),
        d_(layout.config.shape.head_dim),
        segment_rows_(kClusterSegmentBlocks * layout.config.block_tokens),
        k_(enabled_ ? segment_rows_ / layout.config.remainder_cluster_rows : 0),
        segments_(enabled_ ? layout.max_blocks / kClusterSegmentBlocks : 0),
        layers_(layout.config.shape.num_layers),
        kv_heads_(layout.config.shape.num_kv_heads) {
    if (!enabled_ || segments_ == 0) return;
    const std::int64_t units = checked_product("KeyClusters: segments (sequences x layers x kv heads x segments)",
                                               layout.config.max_sequences, layers_, kv_heads_, segments_);
    // Reserved, not committed: a segment's arrays take memory when it is clustered.
    sums_ = ReservedArray<float>(checked_product("KeyClusters: cluster sum floats", units, k_, 2, d_),
                                 "remainder = clusters: the cluster sums");
    counts_ = ReservedArray<std::int32_t>(checked_product("KeyClusters: cluster counts", units, k_),
                                          "remainder = clusters: the cluster counts");
    ids_ = ReservedArray<std::uint8_t>(checked_product("KeyClusters: row ids", units, segment_rows_),
                                       "remainder = clusters: the rows' cluster ids");
    clustered_.assign(static_cast<std::size_t>(units), 0);  // one byte per segment
  }

  bool enabled() const noexcept { return enabled_; }
  int clusters_per_segment() const noexcept { return k_; }
  int segment_rows() const noexcept { return segment_rows_; }
  std::int64_t segments() const noexcept { return segments_; }

  bool clustered(int slot, int layer, int kv_head, std::int64_t segment) const noexcept {
    return segment < segments_ && clustered_[static_cast<std::size_t>(unit(slot, layer, kv_head, segment))] != 0;
  }
  // Cluster c's [key sum | value sum] ([2][head_dim]) and row count.
  const float* sums(int slot, int layer, int kv_head, std::int64_t segment, int c) const noexcept {
    return sums_.data() + (unit(slot, layer, kv_head, segment) * k_ + c) * 2 * d_;
  }
  std::int32_t count(int slot, int layer, int kv_head, std::int64_t segment, int c) const noexcept {
    return counts_[static_cast<std::size_t>(unit(slot, layer, kv_head, segment) * k_ + c)];
  }
  // The cluster of each row of the segment: [segment rows].
  const std::uint8_t* ids(int slot, int layer, int kv_head, std::int64_t segment) const noexcept {
    return ids_.data() + unit(slot, layer, kv_head, segment) * segment_rows_;
  }

  // Clusters segment `segment` of (slot, layer, kv_head) from its rows as floats ([segment
  // rows][head_dim] keys and values).
  void cluster(int slot, int layer, int kv_head, std::int64_t segment, const float* keys, const float* values) {
    const std::int64_t u = unit(slot, layer, kv_head, segment);
    std::uint8_t* id = ids_.data() + u * segment_rows_;
    kmeans_keys(keys, segment_rows_, d_, k_, kIterations, id, centres_, scratch_);
    float* s = sums_.data() + u * k_ * 2 * d_;
    std::int32_t* n = counts_.data() + u * k_;
    std::memset(s, 0, static_cast<std::size_t>(k_) * 2 * static_cast<std::size_t>(d_) * sizeof(float));
    std::memset(n, 0, static_cast<std::size_t>(k_) * sizeof(std::int32_t));
    for (int r = 0; r < segment_rows_; ++r) {
      float* c = s + static_cast<std::int64_t>(id[r]) * 2 * d_;
      const float* kr = keys + static_cast<std::int64_t>(r) * d_;
      const float* vr = values + static_cast<std::int64_t>(r) * d_;
      for (int i = 0; i < d_; ++i) c[i] += kr[i];
      for (int i = 0; i < d_; ++i) c[d_ + i] += vr[i];
      n[id[r]] += 1;
    }
    clustered_[static_cast<std::size_t>(u)] = 1;
  }

  // Clusters every segment of (slot, layer) that an append of rows [from, to) filled, for every kv
  // head, unless one of its blocks is not local (local(b): false for an admitted prompt's remote
  // blocks). rows(h, b): the host tier's block b of kv head h ([K | V][block_tokens][head_dim] of T).
  template <class Local, class Rows>
  void cluster_filled(int slot, int layer, std::int64_t from, std::int64_t to, Local&& local, Rows&& rows) {
    if (!enabled_) return;
    const std::int64_t bt = segment_rows_ / kClusterSegmentBlocks;
    for (std::int64_t s = from / segment_rows_; s < to / segment_rows_ && s < segments_; ++s) {
      const std::int64_t first = s * kClusterSegmentBlocks;
      bool here = true;
      for (std::int64_t b = first; b < first + kClusterSegmentBlocks && here; ++b) here = local(b);
      if (!here) continue;
      keys_.resize(static_cast<std::size_t>(segment_rows_) * static_cast<std::size_t>(d_));
      values_.resize(keys_.size());
      for (int h = 0; h < kv_heads_; ++h) {
        for (std::int64_t b = first; b < first + kClusterSegmentBlocks; ++b) {
          const auto* block = rows(h, b);
          const auto at = static_cast<std::size_t>((b - first) * bt * d_);
          for (std::int64_t i = 0; i < bt * d_; ++i) {
            keys_[at + static_cast<std::size_t>(i)] = to_float(block[i]);
            values_[at + static_cast<std::size_t>(i)] = to_float(block[bt * d_ + i]);
          }
        }
        cluster(slot, layer, h, s, keys_.data(), values_.data());
      }
    }
  }

  // The clustered segments' part of Cache::remainder for (slot, layer, kv head) at `blocks` blocks:
  // each cluster with rows outside the resident blocks [res, res_end) (ascending), as a
  // CentroidSums of its sums weighted by that count (the caller leaves these segments' blocks out).
  void add_estimate_blocks(int slot, int layer, int kv_head, std::int64_t blocks, const std::int32_t* res,
                           const std::int32_t* res_end, std::vector<CentroidSums>& out) {
    if (!enabled_) return;
    const std::int64_t bt = segment_rows_ / kClusterSegmentBlocks;
    for (std::int64_t s = 0; s < blocks / kClusterSegmentBlocks; ++s) {
      if (!clustered(slot, layer, kv_head, s)) continue;
      resident_.assign(static_cast<std::size_t>(k_), 0);
      const std::uint8_t* id = ids(slot, layer, kv_head, s);
      for (; res != res_end && *res < (s + 1) * kClusterSegmentBlocks; ++res) {
        if (*res < s * kClusterSegmentBlocks) continue;
        const std::uint8_t* row = id + (*res - s * kClusterSegmentBlocks) * bt;
        for (std::int64_t r = 0; r < bt; ++r) resident_[row[r]] += 1;
      }
      for (int c = 0; c < k_; ++c) {
        const std::int32_t n = count(slot, layer, kv_head, s, c);
        const std::int32_t left = n - resident_[static_cast<std::size_t>(c)];
        if (left > 0) out.push_back(CentroidSums{sums(slot, layer, kv_head, s, c), n, left});
      }
    }
  }

  // How many leading segments of `slot` are clustered in every layer and kv head (what an
  // admission message sends).
  std::int64_t leading_clustered(int slot) const noexcept {
    std::int64_t n = segments_;
    for (int l = 0; l < layers_; ++l) {
      for (int h = 0; h < kv_heads_; ++h) {
        std::int64_t s = 0;
        while (s < n && clustered(slot, l, h, s)) ++s;
        n = s;
      }
    }
    return n;
  }
  // Segment `segment` of (slot, layer, kv_head) from another cache's clustering (an admission):
  // ids [segment rows], sums [clusters][2][head_dim], counts [clusters].
  void assign(int slot, int layer, int kv_head, std::int64_t segment, const std::uint8_t* ids_in, const float* sums_in,
              const std::int32_t* counts_in) noexcept {
    const std::int64_t u = unit(slot, layer, kv_head, segment);
    std::memcpy(ids_.data() + u * segment_rows_, ids_in, static_cast<std::size_t>(segment_rows_));
    std::memcpy(sums_.data() + u * k_ * 2 * d_, sums_in,
                static_cast<std::size_t>(k_) * 2 * static_cast<std::size_t>(d_) * sizeof(float));
    std::memcpy(counts_.data() + u * k_, counts_in, static_cast<std::size_t>(k_) * sizeof(std::int32_t));
    clustered_[static_cast<std::size_t>(u)] = 1;
  }

  // Segments of (slot, layer) that reach past `length` tokens lose their clustering (a truncate).
  void forget_from(int slot, int layer, std::int64_t length) noexcept {
    if (!enabled_) return;
    const std::int64_t first = length / segment_rows_;  // the first segment not wholly below length
    for (int h = 0; h < kv_heads_; ++h) {
      for (std::int64_t s = first; s < segments_; ++s)
        clustered_[static_cast<std::size_t>(unit(slot, layer, h, s))] = 0;
    }
  }
  // dst's segments of `layer` wholly below `length` become src's; the rest are not clustered (a fork).
  void copy(int src, int dst, int layer, std::int64_t length) noexcept {
    if (!enabled_) return;
    const std::int64_t whole = length / segment_rows_;
    for (int h = 0; h < kv_heads_; ++h) {
      for (std::int64_t s = 0; s < segments_; ++s) {
        const std::int64_t a = unit(src, layer, h, s), b = unit(dst, layer, h, s);
        clustered_[static_cast<std::size_t>(b)] = s < whole ? clustered_[static_cast<std::size_t>(a)] : 0;
        if (s >= whole || clustered_[static_cast<std::size_t>(a)] == 0) continue;
        std::memcpy(sums_.data() + b * k_ * 2 * d_, sums_.data() + a * k_ * 2 * d_,
                    static_cast<std::size_t>(k_) * 2 * static_cast<std::size_t>(d_) * sizeof(float));
        std::memcpy(counts_.data() + b * k_, counts_.data() + a * k_,
                    static_cast<std::size_t>(k_) * sizeof(std::int32_t));
        std::memcpy(ids_.data() + b * segment_rows_, ids_.data() + a * segment_rows_,
                    static_cast<std::size_t>(segment_rows_));
      }
    }
  }
  // A new sequence in `slot`: nothing clustered.
  void reset(int slot) noexcept {
    if (!enabled_) return;
    for (int l = 0; l < layers_; ++l) forget_from(slot, l, 0);
  }

 private:
  std::int64_t unit(int slot, int layer, int kv_head, std::int64_t segment) const noexcept {
    return ((static_cast<std::int64_t>(slot) * layers_ + layer) * kv_heads_ + kv_head) * segments_ + segment;
  }

  bool enabled_;
  int d_;
  int segment_rows_;
  int k_;
  std::int64_t segments_;
  int layers_, kv_heads_;
  ReservedArray<float> sums_;
  ReservedArray<std::int32_t> counts_;
  ReservedArray<std::uint8_t> ids_;
  std::vector<std::uint8_t> clustered_;
  std::vector<float> centres_, scratch_;  // k-means
  std::vector<float> keys_, values_;      // one segment's rows as floats
  std::vector<std::int32_t> resident_;    // resident rows per cluster (add_estimate_blocks)
};

}  // namespace detail
}  // namespace v0
}  // namespace oasiskv
