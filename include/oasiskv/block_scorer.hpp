// Block scorers: how a block's key summary and one query become the block's score. The selector
// reduces the scores of every (lookahead row, query head) of a kv head's group (GroupReduction)
// and takes the top K. Today's scorer is Quest's min/max bound; other scorers (a spread-weighted
// bound, a mass estimate) implement the same interface over a summary of the same layout.
#pragma once

#include <concepts>

#include "oasiskv/detail/host_device.hpp"
#include "oasiskv/summary.hpp"

namespace oasiskv {
inline namespace v0 {

// A scorer reads `summary_floats(head_dim)` floats of one block's summary (SummaryStore's block
// layout: channel-wise max, then min) and a head_dim-float query.
template <class S>
concept BlockScorer = requires(const float* q, const float* summary, int head_dim) {
  { S::summary_floats(head_dim) } -> std::same_as<int>;
  { S::score(q, summary, head_dim) } -> std::same_as<float>;
};

// Quest's upper bound of q.k over the block's keys (quest_bound), summed in kScoreLanes fixed
// lanes so every backend computes the same bits. The CUDA scoring kernel inlines the same sum.
struct QuestBound {
  static constexpr int summary_floats(int head_dim) noexcept { return 2 * head_dim; }
  static float score(const float* q, const float* summary, int head_dim) noexcept {
    return quest_bound(q, summary, summary + head_dim, head_dim);
  }
};
static_assert(BlockScorer<QuestBound>);

}  // namespace v0
}  // namespace oasiskv
