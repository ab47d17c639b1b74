// SoftmaxState (oasiskv/cpu/attention.hpp): the running softmax the attention kernels fold rows
// into, merged across a head's parts and finished into outputs and log-sum-exps.
#include <algorithm>
#include <cmath>

#include "oasiskv/cpu/attention.hpp"

namespace oasiskv {
inline namespace v0 {

void SoftmaxState::reset(int heads, int head_dim) {
  max.assign(static_cast<std::size_t>(heads), -INFINITY);
  sum.assign(static_cast<std::size_t>(heads), 0.0f);
  acc.assign(static_cast<std::size_t>(heads) * static_cast<std::size_t>(head_dim), 0.0f);
}

void SoftmaxState::merge(const SoftmaxState& o, int d) {
  for (std::size_t h = 0; h < max.size(); ++h) {
    if (o.sum[h] == 0.0f) continue;
    const float m = std::max(max[h], o.max[h]);
    const float a = sum[h] == 0.0f ? 0.0f : std::exp(max[h] - m), b = std::exp(o.max[h] - m);
    sum[h] = sum[h] * a + o.sum[h] * b;
    for (int i = 0; i < d; ++i) acc[h * d + i] = acc[h * d + i] * a + o.acc[h * d + i] * b;
    max[h] = m;
  }
}

void SoftmaxState::finish(int d, float* out, float* lse) const {
  for (std::size_t h = 0; h < max.size(); ++h) {
    const float inv = sum[h] > 0.0f ? 1.0f / sum[h] : 0.0f;
    for (int i = 0; i < d; ++i) out[h * d + i] = acc[h * d + i] * inv;
    if (lse != nullptr) lse[h] = sum[h] > 0.0f ? max[h] + std::log(sum[h]) : -INFINITY;
  }
}

}  // namespace v0
}  // namespace oasiskv
