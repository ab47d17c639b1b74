// Block key summaries: per (sequence, layer, kv head, block) the channel-wise max and min of the
// block's keys, as in Quest. Updated on append, read by scoring.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "oasiskv/config.hpp"
#include "oasiskv/cpu/detail/cpu_kernels.hpp"
#include "oasiskv/detail/tier.hpp"
#include "oasiskv/dtype.hpp"

namespace oasiskv {
inline namespace v0 {

// Lanes of the bound's sum. Fixed, so that every backend adds in the same order and computes
// bit-identical scores; eight independent chains also let the compiler vectorise.
inline constexpr int kScoreLanes = 8;

// Adds lane partial sums in a fixed tree: ((0+4)+(2+6)) + ((1+5)+(3+7)).
inline float sum_lanes(const float* lane) noexcept {
  return ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
}

// Quest's upper bound of q.k over every key k of a block: sum_i max(q_i * max_i, q_i * min_i).
// Channel i goes to lane i % 8. Each term bounds q_i * k_i and float rounding is monotone, so the
// bound is >= q.k summed in the same lane order (the test checks exactly that).
inline float quest_bound(const float* q, const float* key_max, const float* key_min, int head_dim) noexcept {
  float lane[kScoreLanes] = {};
  int i = 0;
  for (; i + kScoreLanes <= head_dim; i += kScoreLanes) {
    for (int j = 0; j < kScoreLanes; ++j) {
      lane[j] += std::max(q[i + j] * key_max[i + j], q[i + j] * key_min[i + j]);
    }
  }
  for (int j = 0; i < head_dim; ++i, ++j) lane[j] += std::max(q[i] * key_max[i], q[i] * key_min[i]);
  return sum_lanes(lane);
}

// Lanes of the spread score (block_scorer.hpp), channel i into lane i % 8 as
// quest_bound does. Every backend adds one channel with add() and the lanes with finish(), so the
// portable, AVX and CUDA kernels compute the same bits. centre = (max + min) * 0.5 and range =
// max - min per channel, as written here (no contraction: see src/cpu/cpu_kernels.cpp).
struct SpreadLanes {
  float centre[kScoreLanes] = {};  // q_i c_i
  float range[kScoreLanes] = {};   // |q_i| r_i
  void add(int j, float q, float mx, float mn) noexcept {
    const float c = (mx + mn) * 0.5f, r = mx - mn;
    centre[j] += q * c;
    range[j] += std::fabs(q) * r;
  }
  // q.c + half_alpha * sum |q_i| r_i
  float finish(float half_alpha) const noexcept { return sum_lanes(centre) + half_alpha * sum_lanes(range); }
};

template <class Lanes>
inline Lanes score_lanes(const float* q, const float* key_max, const float* key_min, int head_dim) noexcept {
  Lanes l;
  int i = 0;
  for (; i + kScoreLanes <= head_dim; i += kScoreLanes) {
    for (int j = 0; j < kScoreLanes; ++j) l.add(j, q[i + j], key_max[i + j], key_min[i + j]);
  }
  for (int j = 0; i < head_dim; ++i, ++j) l.add(j, q[i], key_max[i], key_min[i]);
  return l;
}

// BlockScore::spread of one block (config.hpp): q.c + 2 half_alpha * 0.5 sum |q_i| r_i.
inline float spread_score(const float* q, const float* key_max, const float* key_min, int head_dim,
                          float half_alpha) noexcept {
  return score_lanes<SpreadLanes>(q, key_max, key_min, head_dim).finish(half_alpha);
}

class SummaryStore {
 public:
  explicit SummaryStore(const CacheLayout& layout)
      : layout_(layout),
        dim_(layout.config.shape.head_dim),
        memory_(static_cast<std::size_t>(layout.summary_floats) * sizeof(float)) {}

  // Channel-wise max of the block's keys, then min at + head_dim.
  const float* block(int seq_slot, int layer, int kv_head, std::int64_t block) const noexcept {
    return base() + offset(seq_slot, layer, kv_head, block);
  }
  const float* key_max(int seq_slot, int layer, int kv_head, std::int64_t b) const noexcept {
    return block(seq_slot, layer, kv_head, b);
  }
  const float* key_min(int seq_slot, int layer, int kv_head, std::int64_t b) const noexcept {
    return block(seq_slot, layer, kv_head, b) + dim_;
  }

  // The block's summary to fold into directly (the CPU engine's append: detail::append_rows).
  float* mutable_block(int seq_slot, int layer, int kv_head, std::int64_t block) noexcept {
    return base() + offset(seq_slot, layer, kv_head, block);
  }

  // Folds key row `token` into its block's summary; the block's first row resets it. The fold is
  // detail::fold_key (vectorised where the CPU allows, the same bits as the scalar loop).
  template <class T>
  void add_key(int seq_slot, int layer, int kv_head, std::int64_t token, const T* key) noexcept {
    const std::int64_t bt = layout_.config.block_tokens;
    float* mx = base() + offset(seq_slot, layer, kv_head, token / bt);
    detail::fold_key(mx, mx + dim_, key, dim_, token % bt == 0);
  }
  // dst's summaries of blocks [0, blocks) become src's (a fork).
  void copy_blocks(int src_slot, int dst_slot, int layer, int kv_head, std::int64_t blocks) noexcept {
    if (blocks <= 0) return;
    const std::size_t bytes = static_cast<std::size_t>(blocks) * 2 * static_cast<std::size_t>(dim_) * sizeof(float);
    std::memcpy(base() + offset(dst_slot, layer, kv_head, 0), base() + offset(src_slot, layer, kv_head, 0), bytes);
  }

  // The summaries of blocks [0, blocks) from `src` ([blocks][max | min][head_dim]: an admission).
  void assign_blocks(int seq_slot, int layer, int kv_head, std::int64_t blocks, const float* src) noexcept {
    if (blocks <= 0) return;
    std::memcpy(base() + offset(seq_slot, layer, kv_head, 0), src,
                static_cast<std::size_t>(blocks) * 2 * static_cast<std::size_t>(dim_) * sizeof(float));
  }

  std::size_t bytes_reserved() const noexcept { return memory_.bytes(); }

 private:
  float* base() const noexcept { return reinterpret_cast<float*>(memory_.data()); }
  std::int64_t offset(int seq_slot, int layer, int kv_head, std::int64_t block) const noexcept {
    return layout_.summary_offset(seq_slot, layer, kv_head, block);
  }

  CacheLayout layout_;
  int dim_;
  MemoryReservation memory_;
};

}  // namespace v0
}  // namespace oasiskv
