// Attention states and their merge. The attention of a query over a set of keys, as a state: the
// output out = sum_t p_t v_t / sum_t p_t (p_t = exp(scale q.k_t)) and lse = log sum_t p_t. Two
// states over disjoint key sets merge into the state over their union, as FlashInfer's
// merge_state does: this is how an engine adds Cache::remainder's estimate of the non-resident
// blocks to its attention over the resident ones. A state over no key is lse = -inf (its out is
// ignored).
#pragma once

#include <cmath>
#include <cstdint>

namespace oasiskv {
inline namespace v0 {

// (out, lse) becomes the merge of itself with (other_out, other_lse); out and other_out have
// head_dim values. -inf on either side leaves the other side unchanged.
inline void merge_state(float* out, float& lse, const float* other_out, float other_lse, int head_dim) noexcept {
  if (other_lse == -INFINITY) return;
  if (lse == -INFINITY) {
    for (int i = 0; i < head_dim; ++i) out[i] = other_out[i];
    lse = other_lse;
    return;
  }
  const float m = lse > other_lse ? lse : other_lse;
  const float a = std::exp(lse - m), b = std::exp(other_lse - m);
  const float inv = 1.0f / (a + b);
  for (int i = 0; i < head_dim; ++i) out[i] = (a * out[i] + b * other_out[i]) * inv;
  lse = m + std::log(a + b);
}

// merge_state over `states` consecutive states: out and other_out [states][head_dim], lse and
// other_lse [states].
inline void merge_states(float* out, float* lse, const float* other_out, const float* other_lse, std::int64_t states,
                         int head_dim) noexcept {
  for (std::int64_t s = 0; s < states; ++s) {
    merge_state(out + s * head_dim, lse[s], other_out + s * head_dim, other_lse[s], head_dim);
  }
}

}  // namespace v0
}  // namespace oasiskv
