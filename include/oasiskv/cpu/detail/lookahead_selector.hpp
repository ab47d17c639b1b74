// LookaheadSelector: scores every candidate block of one (sequence, layer, kv head) against the
// lookahead queries of that kv head's group and picks the top K. The runs scorer reads the
// SummaryStore's run key sums (run_means_score); the others its min/max summary.
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "oasiskv/config.hpp"
#include "oasiskv/cpu/detail/block_scorer.hpp"
#include "oasiskv/cpu/detail/cpu_kernels.hpp"
#include "oasiskv/cpu/detail/summary_store.hpp"

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

template <BlockScorer Scorer = ConfiguredScorer>
class BasicLookaheadSelector {
 public:
  // The scorer from the layout (Scorer::from) where it has one (the configured scorer), else Scorer{}.
  explicit BasicLookaheadSelector(const CacheLayout& layout) : BasicLookaheadSelector(layout, default_scorer(layout)) {}
  BasicLookaheadSelector(const CacheLayout& layout, Scorer scorer) : layout_(layout), scorer_(scorer) {
    if constexpr (kKernel) {
      params_ = scorer_.params(layout_);
    } else if constexpr (requires {
                           { scorer_.softmax_scale(layout_) } -> std::same_as<float>;
                         }) {
      params_.softmax_scale = scorer_.softmax_scale(layout_);  // a scorer in other units says so
    } else {
      params_.softmax_scale = layout_.softmax_scale;
    }
  }

  // Scores blocks [first, last) against `num_queries` query vectors (head_dim floats each: every
  // lookahead row times every query head of the group), reduced as the config says.
  // scores.size() becomes last - first. O((last - first) * num_queries * head_dim). Reuses
  // scratch, so one selector serves one thread.
  void score(const SummaryStore& summaries, int seq_slot, int layer, int kv_head, std::int64_t first, std::int64_t last,
             const float* queries, int num_queries, std::vector<float>& scores) {
    const int d = layout_.config.shape.head_dim;
    const auto n = static_cast<std::size_t>(last - first);
    const auto nq = static_cast<std::size_t>(num_queries);
    const GroupReduction reduction = layout_.config.reduction;
    scores.assign(n, reduction == GroupReduction::max ? -INFINITY : 0.0f);
    if (reduction == GroupReduction::softmax_sum) raw_.resize(n * nq);
    // Blocks outside, queries inside: each summary is read from memory once. The built-in scorers
    // have a kernel that scores a run of blocks for every query at once (the same bits).
    if constexpr (kKernel) {
      bounds_.resize(n * nq);
      if (n > 0 && nq > 0 && params_.kind == BlockScore::runs) {
        // The runs scorer reads the run key sums, not the min/max summary.
        for (std::size_t j = 0; j < n; ++j) {
          const float* sums = summaries.runs(seq_slot, layer, kv_head, first + static_cast<std::int64_t>(j));
          for (std::size_t qi = 0; qi < nq; ++qi) {
            bounds_[j * nq + qi] =
                run_means_score(queries + qi * static_cast<std::size_t>(d), sums, params_.runs, d, params_.run_scale);
          }
        }
      } else if (n > 0 && nq > 0) {
        detail::score_blocks(params_, summaries.block(seq_slot, layer, kv_head, first), static_cast<std::int64_t>(n),
                             queries, num_queries, d, bounds_.data());
      }
    }
    // The reduction over each block's queries, in query order (the same bits whichever loop).
    auto reduce = [&](auto score_of) {
      switch (reduction) {
        case GroupReduction::max:
          for (std::size_t j = 0; j < n; ++j)
            for (std::size_t qi = 0; qi < nq; ++qi) scores[j] = std::max(scores[j], score_of(j, qi));
          break;
        case GroupReduction::sum:
          for (std::size_t j = 0; j < n; ++j)
            for (std::size_t qi = 0; qi < nq; ++qi) scores[j] += score_of(j, qi);
          break;
        case GroupReduction::softmax_sum:
          for (std::size_t j = 0; j < n; ++j)
            for (std::size_t qi = 0; qi < nq; ++qi) raw_[qi * n + j] = score_of(j, qi);
          break;
      }
    };
    if constexpr (kKernel) {
      reduce([&](std::size_t j, std::size_t qi) { return bounds_[j * nq + qi]; });
    } else {
      reduce([&](std::size_t j, std::size_t qi) {
        const float* summary = summaries.block(seq_slot, layer, kv_head, first + static_cast<std::int64_t>(j));
        return scorer_.score(queries + qi * static_cast<std::size_t>(d), summary, d);
      });
    }
    if (reduction == GroupReduction::softmax_sum && n > 0) {
      // Per query, a softmax over the blocks; the queries' shares are added in query order. The
      // scores are in q.k units (times the softmax scale).
      for (std::size_t qi = 0; qi < nq; ++qi) {
        float* row = raw_.data() + qi * n;
        const float top = *std::max_element(row, row + n);
        float total = 0.0f;
        for (std::size_t j = 0; j < n; ++j) total += (row[j] = std::exp((row[j] - top) * params_.softmax_scale));
        for (std::size_t j = 0; j < n; ++j) scores[j] += row[j] / total;
      }
    }
  }

  // The k best of `scores` as block indices (first_block + position), best first (ScoreOrder).
  // O(n + k log k): detail::select_top_k.
  static void top_k(std::span<const float> scores, std::int64_t first_block, int k, std::vector<std::int32_t>& out) {
    detail::select_top_k(scores, k, out);
    for (auto& b : out) b = static_cast<std::int32_t>(b + first_block);
  }

  const Scorer& scorer() const noexcept { return scorer_; }

 private:
  // Whether Scorer names its constants (the built-in scorers): scored by detail::score_blocks.
  static constexpr bool kKernel = requires(const Scorer& s, const CacheLayout& l) {
    { s.params(l) } -> std::same_as<ScoreParams>;
  };
  static Scorer default_scorer(const CacheLayout& layout) {
    if constexpr (requires {
                    { Scorer::from(layout) } -> std::same_as<Scorer>;
                  }) {
      return Scorer::from(layout);
    } else {
      return Scorer{};
    }
  }

  CacheLayout layout_;
  Scorer scorer_;
  ScoreParams params_;         // the kernel's constants; softmax_scale for softmax_sum
  std::vector<float> raw_;     // softmax_sum: [query][block] scores
  std::vector<float> bounds_;  // kernel path: [block][query] scores
};

// The selector with the configured scorer (CacheConfig::scorer): what the engines use.
using LookaheadSelector = BasicLookaheadSelector<ConfiguredScorer>;

}  // namespace v0
}  // namespace oasiskv
