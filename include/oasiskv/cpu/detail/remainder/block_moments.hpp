// BlockMoments: per (sequence slot, layer, kv head, block) the sum of the block's key rows and of
// its value rows (CacheLayout::moment_offset: [key sum | value sum][head_dim] floats), the
// summary `remainder = clusters` estimates a block with when its segment is not clustered; and
// the centroid state over a set of such sums: a block (or key cluster) of n rows with mean key mu
// and mean value vbar weighs w = exp(log n + s q.mu) (RetroInfer's estimation zone: the mean key's
// score times the rows), and the state is lse = log sum w, out = sum w vbar / sum w.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "oasiskv/config.hpp"
#include "oasiskv/dtype.hpp"
#include "oasiskv/kit/reserved_array.hpp"

namespace oasiskv {
inline namespace v0 {
namespace detail {

// One set of rows for centroid_state: its [key sum | value sum][head_dim] and row count; with
// weight_rows (not 0), the rows it stands for when fewer than `rows` (a key cluster's rows
// outside the resident blocks): its mass is scaled by weight_rows / rows.
struct CentroidSums {
  const float* sums = nullptr;
  int rows = 0;
  int weight_rows = 0;
};

// The estimated attention state of query q over `sets`: out [head_dim], lse; no set: lse = -inf,
// out = 0. logits: scratch.
inline void centroid_state(const float* q, std::span<const CentroidSums> sets, int head_dim, float scale, float* out,
                           float& lse, std::vector<float>& logits) {
  for (int i = 0; i < head_dim; ++i) out[i] = 0.0f;
  lse = -INFINITY;
  if (sets.empty()) return;
  logits.resize(sets.size());
  float top = -INFINITY;
  for (std::size_t b = 0; b < sets.size(); ++b) {
    const CentroidSums& x = sets[b];
    float dot = 0.0f;
    for (int i = 0; i < head_dim; ++i) dot += q[i] * x.sums[i];
    logits[b] = std::log(static_cast<float>(x.rows)) + scale * dot * (1.0f / static_cast<float>(x.rows));
    if (x.weight_rows > 0 && x.weight_rows != x.rows) {
      logits[b] += std::log(static_cast<float>(x.weight_rows)) - std::log(static_cast<float>(x.rows));
    }
    top = logits[b] > top ? logits[b] : top;
  }
  float total = 0.0f;
  for (std::size_t b = 0; b < sets.size(); ++b) {
    const float w = std::exp(logits[b] - top);
    total += w;
    const float wv = w / static_cast<float>(sets[b].rows);  // the value sum to the mean value
    const float* vsum = sets[b].sums + head_dim;
    for (int i = 0; i < head_dim; ++i) out[i] += wv * vsum[i];
  }
  const float inv = 1.0f / total;
  for (int i = 0; i < head_dim; ++i) out[i] *= inv;
  lse = top + std::log(total);
}

class BlockMoments {
 public:
  explicit BlockMoments(const CacheLayout& layout)
      : layout_(layout),
        d_(layout.head_dim()),
        sums_(layout.remainder.moment_floats, "remainder = clusters: the block sums") {}

  // Block b's [key sum | value sum][head_dim].
  const float* sums(int slot, int layer, int kv_head, std::int64_t b) const noexcept {
    return sums_.data() + layout_.moment_offset(slot, layer, kv_head, b);
  }
  float* mutable_sums(int slot, int layer, int kv_head, std::int64_t b) noexcept {
    return sums_.data() + layout_.moment_offset(slot, layer, kv_head, b);
  }

  // Folds row `token` (key and value, head_dim each) into its block's sums; the block's first row
  // sets them. Sums in row order, so a refold from the same rows gives the same bits.
  template <class T>
  void add_row(int slot, int layer, int kv_head, std::int64_t token, const T* key, const T* value) noexcept {
    const std::int64_t bt = layout_.config.block_tokens;
    float* key_sum = mutable_sums(slot, layer, kv_head, token / bt);
    float* value_sum = key_sum + d_;
    if (token % bt == 0) {
      for (int i = 0; i < d_; ++i) key_sum[i] = to_float(key[i]);
      for (int i = 0; i < d_; ++i) value_sum[i] = to_float(value[i]);
    } else {
      for (int i = 0; i < d_; ++i) key_sum[i] += to_float(key[i]);
      for (int i = 0; i < d_; ++i) value_sum[i] += to_float(value[i]);
    }
  }

  // dst's blocks [0, blocks) of (layer, kv_head) take src's sums (a fork).
  void copy_blocks(int src, int dst, int layer, int kv_head, std::int64_t blocks) noexcept {
    if (blocks <= 0) return;
    std::memcpy(mutable_sums(dst, layer, kv_head, 0), sums(src, layer, kv_head, 0), bytes_of(blocks));
  }
  // (slot, layer, kv_head)'s blocks [0, blocks) from `src` ([block][key sum | value sum][head_dim]).
  void assign_blocks(int slot, int layer, int kv_head, std::int64_t blocks, const float* src) noexcept {
    if (blocks <= 0) return;
    std::memcpy(mutable_sums(slot, layer, kv_head, 0), src, bytes_of(blocks));
  }

 private:
  std::size_t bytes_of(std::int64_t blocks) const noexcept {
    return static_cast<std::size_t>(blocks) * 2 * static_cast<std::size_t>(d_) * sizeof(float);
  }

  CacheLayout layout_;
  int d_;
  ReservedArray<float> sums_;
};

}  // namespace detail
}  // namespace v0
}  // namespace oasiskv
