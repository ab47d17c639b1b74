// SummaryStore: the CPU engine's block key summaries, per (sequence, layer, kv head, block) the
// channel-wise max and min of the block's keys, as in Quest, and under the `runs` scorer each run's
// key sum. Updated on append, read by scoring (block_scorer.hpp; the formulas are
// kit/score_formulas.hpp, shared with the CUDA kernels).
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
        memory_(static_cast<std::size_t>(layout.summary_floats) * sizeof(float)),
        runs_(static_cast<std::size_t>(layout.run_floats) * sizeof(float)) {}

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
  // detail::fold_key (vectorised where the CPU allows, the same bits as the scalar loop). Under
  // the runs scorer, into its run's key sum too.
  template <class T>
  void add_key(int seq_slot, int layer, int kv_head, std::int64_t token, const T* key) noexcept {
    const std::int64_t bt = layout_.config.block_tokens;
    float* mx = base() + offset(seq_slot, layer, kv_head, token / bt);
    detail::fold_key(mx, mx + dim_, key, dim_, token % bt == 0);
    add_run_key(seq_slot, layer, kv_head, token, key);
  }
  // Under the runs scorer: adds key row `token` to its run's key sum (the run's first row resets
  // it), in row order, so a refold gives the same bits. Nothing under the other scorers.
  template <class T>
  void add_run_key(int seq_slot, int layer, int kv_head, std::int64_t token, const T* key) noexcept {
    if (layout_.score.runs == 0) return;
    const std::int64_t bt = layout_.config.block_tokens, rt = layout_.config.run_tokens;
    float* sum = runs_base() + layout_.run_offset(seq_slot, layer, kv_head, token / bt) + token % bt / rt * dim_;
    if (token % rt == 0) {
      for (int i = 0; i < dim_; ++i) sum[i] = to_float(key[i]);
    } else {
      for (int i = 0; i < dim_; ++i) sum[i] += to_float(key[i]);
    }
  }
  // Run key sums of one block (runs scorer): [run][head_dim].
  const float* runs(int seq_slot, int layer, int kv_head, std::int64_t block) const noexcept {
    return runs_base() + layout_.run_offset(seq_slot, layer, kv_head, block);
  }
  // dst's summaries of blocks [0, blocks) become src's (a fork).
  void copy_blocks(int src_slot, int dst_slot, int layer, int kv_head, std::int64_t blocks) noexcept {
    if (blocks <= 0) return;
    const std::size_t bytes = static_cast<std::size_t>(blocks) * 2 * static_cast<std::size_t>(dim_) * sizeof(float);
    std::memcpy(base() + offset(dst_slot, layer, kv_head, 0), base() + offset(src_slot, layer, kv_head, 0), bytes);
    if (layout_.score.runs == 0) return;
    const std::size_t run_bytes = static_cast<std::size_t>(blocks) * static_cast<std::size_t>(layout_.score.runs) *
                                  static_cast<std::size_t>(dim_) * sizeof(float);
    std::memcpy(runs_base() + layout_.run_offset(dst_slot, layer, kv_head, 0),
                runs_base() + layout_.run_offset(src_slot, layer, kv_head, 0), run_bytes);
  }

  // The summaries of blocks [0, blocks) from `src` ([blocks][max | min][head_dim]: an admission).
  void assign_blocks(int seq_slot, int layer, int kv_head, std::int64_t blocks, const float* src) noexcept {
    if (blocks <= 0) return;
    std::memcpy(base() + offset(seq_slot, layer, kv_head, 0), src,
                static_cast<std::size_t>(blocks) * 2 * static_cast<std::size_t>(dim_) * sizeof(float));
  }

  // The run key sums of blocks [0, blocks) from `src` ([blocks][run][head_dim]: an admission into
  // a runs cache).
  void assign_run_blocks(int seq_slot, int layer, int kv_head, std::int64_t blocks, const float* src) noexcept {
    if (blocks <= 0 || layout_.score.runs == 0) return;
    std::memcpy(runs_base() + layout_.run_offset(seq_slot, layer, kv_head, 0), src,
                static_cast<std::size_t>(blocks) * static_cast<std::size_t>(layout_.score.runs) *
                    static_cast<std::size_t>(dim_) * sizeof(float));
  }

  std::size_t bytes_reserved() const noexcept { return memory_.bytes() + runs_.bytes(); }

 private:
  float* base() const noexcept { return reinterpret_cast<float*>(memory_.data()); }
  float* runs_base() const noexcept { return reinterpret_cast<float*>(runs_.data()); }
  std::int64_t offset(int seq_slot, int layer, int kv_head, std::int64_t block) const noexcept {
    return layout_.summary_offset(seq_slot, layer, kv_head, block);
  }

  CacheLayout layout_;
  int dim_;
  MemoryReservation memory_;
  MemoryReservation runs_;  // runs scorer: run key sums (layout.run_floats); empty otherwise
};

}  // namespace v0
}  // namespace oasiskv
