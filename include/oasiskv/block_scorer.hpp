// Block scorers: how a block's key summary and one query become the block's score. The selector
// reduces the scores of every (lookahead row, query head) of a kv head's group (GroupReduction)
// and takes the top K. CacheConfig::scorer chooses one of the built-in scorers (BlockScore,
// config.hpp): Quest's min/max bound, a spread-weighted bound, a softmax-mass estimate; all read a
// summary of the same layout. A scorer may carry constants (alpha, sigma), so it is an object.
#pragma once

#include <concepts>

#include "oasiskv/config.hpp"
#include "oasiskv/detail/host_device.hpp"
#include "oasiskv/summary.hpp"

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

// BlockScore::mass: min(s q.c + 0.5 s^2 sum q_i^2 (sigma r_i)^2, s * quest bound), in logit units
// (mass_score). In the softmax_sum reduction its scores are not scaled again.
struct MassEstimate {
  float scale = 0.0f;      // the softmax scale s
  float quadratic = 0.0f;  // 0.5 s^2 sigma^2
  static constexpr int summary_floats(int head_dim) noexcept { return 2 * head_dim; }
  static MassEstimate from(const CacheLayout& layout) noexcept { return {layout.score.scale, layout.score.quadratic}; }
  float score(const float* q, const float* summary, int head_dim) const noexcept {
    return mass_score(q, summary, summary + head_dim, head_dim, scale, quadratic);
  }
  ScoreParams params(const CacheLayout&) const noexcept {
    ScoreParams p;
    p.kind = BlockScore::mass;
    p.scale = scale;
    p.quadratic = quadratic;
    p.softmax_scale = 1.0f;
    return p;
  }
};
static_assert(BlockScorer<MassEstimate>);

// The scorer CacheConfig::scorer names, chosen at run time (CacheLayout::score): what the engines use.
struct ConfiguredScorer {
  ScoreParams p;
  static constexpr int summary_floats(int head_dim) noexcept { return 2 * head_dim; }
  static ConfiguredScorer from(const CacheLayout& layout) noexcept { return {layout.score}; }
  float score(const float* q, const float* summary, int head_dim) const noexcept {
    switch (p.kind) {
      case BlockScore::spread: return spread_score(q, summary, summary + head_dim, head_dim, p.half_alpha);
      case BlockScore::mass: return mass_score(q, summary, summary + head_dim, head_dim, p.scale, p.quadratic);
      case BlockScore::quest: break;
    }
    return quest_bound(q, summary, summary + head_dim, head_dim);
  }
  ScoreParams params(const CacheLayout&) const noexcept { return p; }
};
static_assert(BlockScorer<ConfiguredScorer>);

}  // namespace v0
}  // namespace oasiskv
