// SummaryStore: the CPU engine's block key summaries, per (sequence, layer, kv head, block) the
// channel-wise max and min of the block's keys, as in Quest. Updated on append, read by scoring
// (block_scorer.hpp; the formulas are kit/score_formulas.hpp, shared with the CUDA kernels).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "oasiskv/config.hpp"
#include "oasiskv/cpu/detail/cpu_kernels.hpp"
#include "oasiskv/dtype.hpp"
#include "oasiskv/kit/tier.hpp"

namespace oasiskv {
inline namespace v0 {

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
