// LookaheadSelector: scores every candidate block of one (sequence, layer, kv head) against the
// lookahead queries of that kv head's group and picks the top K.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "oasiskv/block_scorer.hpp"
#include "oasiskv/config.hpp"
#include "oasiskv/detail/cpu_kernels.hpp"
#include "oasiskv/summary.hpp"

namespace oasiskv {
inline namespace v0 {

// Orders blocks by score, highest first; equal scores go to the lower block index, so every
// backend selects exactly the same blocks. A NaN score never wins: it ranks below every number
// (-inf included), NaNs among themselves by block index. -0.0 and +0.0 are equal.
struct ScoreOrder {
  std::span<const float> scores;
  bool operator()(std::int32_t a, std::int32_t b) const noexcept {
    const float x = scores[static_cast<std::size_t>(a)], y = scores[static_cast<std::size_t>(b)];
    const bool nan_x = x != x, nan_y = y != y;  // NOLINT: NaN test that -ffast-math cannot drop
    if (nan_x || nan_y) return nan_x ? (nan_y && a < b) : true;
    return x > y || (x == y && a < b);
  }
};

template <BlockScorer Scorer = QuestBound>
class BasicLookaheadSelector {
 public:
  explicit BasicLookaheadSelector(const CacheLayout& layout) : layout_(layout) {}

  // Scores blocks [first, last) against `num_queries` query vectors (head_dim floats each: every
  // lookahead row times every query head of the group), reduced as the config says.
  // scores.size() becomes last - first. O((last - first) * num_queries * head_dim). Reuses
  // scratch, so one selector serves one thread.
  void score(const SummaryStore& summaries, int seq_slot, int layer, int kv_head,
             std::int64_t first, std::int64_t last, const float* queries, int num_queries,
             std::vector<float>& scores) {
    const int d = layout_.config.shape.head_dim;
    const auto n = static_cast<std::size_t>(last - first);
    const auto nq = static_cast<std::size_t>(num_queries);
    const GroupReduction reduction = layout_.config.reduction;
    scores.assign(n, reduction == GroupReduction::max ? -INFINITY : 0.0f);
    if (reduction == GroupReduction::softmax_sum) raw_.resize(n * nq);
    // Blocks outside, queries inside: each summary is read from memory once. Quest's bound has
    // a kernel that scores a run of blocks for every query at once (the same bits).
    if constexpr (std::is_same_v<Scorer, QuestBound>) {
      bounds_.resize(n * nq);
      if (n > 0 && nq > 0) {
        detail::quest_bound_blocks(summaries.block(seq_slot, layer, kv_head, first), static_cast<std::int64_t>(n),
                                   queries, num_queries, d, bounds_.data());
      }
    }
    for (std::size_t j = 0; j < n; ++j) {
      for (std::size_t qi = 0; qi < nq; ++qi) {
        float s;
        if constexpr (std::is_same_v<Scorer, QuestBound>) {
          s = bounds_[j * nq + qi];
        } else {
          const float* summary = summaries.block(seq_slot, layer, kv_head, first + static_cast<std::int64_t>(j));
          s = Scorer::score(queries + qi * static_cast<std::size_t>(d), summary, d);
        }
        switch (reduction) {
          case GroupReduction::max: scores[j] = std::max(scores[j], s); break;
          case GroupReduction::sum: scores[j] += s; break;
          case GroupReduction::softmax_sum: raw_[qi * n + j] = s; break;
        }
      }
    }
    if (reduction == GroupReduction::softmax_sum && n > 0) {
      // Per query, a softmax over the blocks; the queries' shares are added in query order.
      for (std::size_t qi = 0; qi < nq; ++qi) {
        float* row = raw_.data() + qi * n;
        const float top = *std::max_element(row, row + n);
        float total = 0.0f;
        for (std::size_t j = 0; j < n; ++j) total += (row[j] = std::exp((row[j] - top) * layout_.softmax_scale));
        for (std::size_t j = 0; j < n; ++j) scores[j] += row[j] / total;
      }
    }
  }

  // The k best of `scores` as block indices (first_block + position), best first (ScoreOrder).
  // O(n + k log k): detail::select_top_k.
  static void top_k(std::span<const float> scores, std::int64_t first_block, int k,
                    std::vector<std::int32_t>& out) {
    detail::select_top_k(scores, k, out);
    for (auto& b : out) b = static_cast<std::int32_t>(b + first_block);
  }

 private:
  CacheLayout layout_;
  std::vector<float> raw_;     // softmax_sum: [query][block] bounds
  std::vector<float> bounds_;  // QuestBound: [block][query] bounds
};

// The selector with today's scorer (Quest's bound).
using LookaheadSelector = BasicLookaheadSelector<QuestBound>;

}  // namespace v0
}  // namespace oasiskv
