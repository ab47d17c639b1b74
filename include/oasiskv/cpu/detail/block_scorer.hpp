// Block scorers: how a block's key summary and one query become the block's score. The selector
// reduces the scores of every (lookahead row, query head) of a kv head's group (GroupReduction)
// and takes the top K. CacheConfig::scorer chooses one of the built-in scorers (BlockScore,
// config.hpp): Quest's min/max bound or a spread-weighted bound; both read a summary of the same
// layout. A scorer may carry constants (alpha), so it is an object. The CPU engine's (its
// selector's); the formulas it calls are oasiskv/kit/score_formulas.hpp, which the CUDA kernels
// compute bit for bit too.
#pragma once

#include <concepts>

#include "oasiskv/config.hpp"
#include "oasiskv/kit/host_device.hpp"
#include "oasiskv/kit/score_formulas.hpp"

namespace oasiskv {
inline namespace v0 {

// A scorer reads `summary_floats(head_dim)` floats of one block's summary (SummaryStore's block
// layout: channel-wise max, then min) and a head_dim-float query.
template <class S>
concept BlockScorer = requires(const S& s, const float* q, const float* summary, int head_dim) {
  { S::summary_floats(head_dim) } -> std::same_as<int>;
  { s.score(q, summary, head_dim) } -> std::same_as<float>;
};

// The built-in scorers below also name their constants as ScoreParams (params(layout)): the
// selector then scores a run of blocks with the library's kernel (detail::score_blocks), which
// computes exactly the bits of score(). The scalar score() is compiled in the caller's unit: with
// FMA contraction enabled there (-march=native -ffp-contract=fast) it may differ in the last bits.

// Quest's upper bound of q.k over the block's keys (quest_bound), summed in kScoreLanes fixed
// lanes so every backend computes the same bits. The CUDA scoring kernel inlines the same sum.
struct QuestBound {
  static constexpr int summary_floats(int head_dim) noexcept { return 2 * head_dim; }
  static float score(const float* q, const float* summary, int head_dim) noexcept {
    return quest_bound(q, summary, summary + head_dim, head_dim);
  }
  static ScoreParams params(const CacheLayout& layout) noexcept {
    ScoreParams p;
    p.kind = BlockScore::quest;
    p.softmax_scale = layout.softmax_scale;
    return p;
  }
};
static_assert(BlockScorer<QuestBound>);

// BlockScore::spread: q.c + alpha * 0.5 sum |q_i| r_i (spread_score).
struct SpreadBound {
  float half_alpha = 0.5f;  // 0.5 * alpha
  static constexpr int summary_floats(int head_dim) noexcept { return 2 * head_dim; }
  static SpreadBound from(const CacheLayout& layout) noexcept { return {layout.score.half_alpha}; }
  float score(const float* q, const float* summary, int head_dim) const noexcept {
    return spread_score(q, summary, summary + head_dim, head_dim, half_alpha);
  }
  ScoreParams params(const CacheLayout& layout) const noexcept {
    ScoreParams p;
    p.kind = BlockScore::spread;
    p.half_alpha = half_alpha;
    p.softmax_scale = layout.softmax_scale;
    return p;
  }
};
static_assert(BlockScorer<SpreadBound>);

// The scorer CacheConfig::scorer names, chosen at run time (CacheLayout::score): what the engines use.
// BlockScore::runs reads the run key sums, not this summary: the selector scores it
// (run_means_score), and score() below answers for quest and spread only.
struct ConfiguredScorer {
  ScoreParams p;
  static constexpr int summary_floats(int head_dim) noexcept { return 2 * head_dim; }
  static ConfiguredScorer from(const CacheLayout& layout) noexcept { return {layout.score}; }
  float score(const float* q, const float* summary, int head_dim) const noexcept {
    if (p.kind == BlockScore::spread) return spread_score(q, summary, summary + head_dim, head_dim, p.half_alpha);
    return quest_bound(q, summary, summary + head_dim, head_dim);
  }
  ScoreParams params(const CacheLayout&) const noexcept { return p; }
};
static_assert(BlockScorer<ConfiguredScorer>);

}  // namespace v0
}  // namespace oasiskv
