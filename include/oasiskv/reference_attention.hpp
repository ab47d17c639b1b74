// REFERENCE attentions for tests, examples and benchmarks: plain loops over a LayerView (sparse)
// or over all rows (dense), with the running-max softmax that sparse kernels use, so the two round
// the same way. Not a production kernel: engines bring their own attention (the LayerView is the
// contract); these define what "correct" means in the tests.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "oasiskv/attention_state.hpp"
#include "oasiskv/dtype.hpp"
#include "oasiskv/view.hpp"

namespace oasiskv {
inline namespace v0 {

// Accumulates softmax(q.K * scale) V over key/value rows with the running-max rescaling that
// sparse kernels use, so dense and sparse references round the same way.
class SoftmaxAccumulator {
 public:
  explicit SoftmaxAccumulator(int head_dim) : acc_(static_cast<std::size_t>(head_dim), 0.0f) {}
  template <class T>
  void add(const float* q, const T* key, const T* value, float scale, float offset = 0.0f) {
    const int d = static_cast<int>(acc_.size());
    float s = 0.0f;
    for (int i = 0; i < d; ++i) s += q[i] * to_float(key[i]);
    s = s * scale + offset;
    if (s > max_) {
      const float r = std::exp(max_ - s);
      sum_ *= r;
      for (float& a : acc_) a *= r;
      max_ = s;
    }
    const float w = std::exp(s - max_);
    sum_ += w;
    for (int i = 0; i < d; ++i) acc_[i] += w * to_float(value[i]);
  }
  void finish(float* out) const {
    for (std::size_t i = 0; i < acc_.size(); ++i) out[i] = sum_ > 0.0f ? acc_[i] / sum_ : 0.0f;
  }
  // log(sum of exp(scores)): merges partial attentions over disjoint key sets.
  float log_sum_exp() const noexcept { return max_ + std::log(sum_); }

 private:
  std::vector<float> acc_;
  float max_ = -INFINITY;
  float sum_ = 0.0f;
};

// Decode attention over a LayerView. q and out: [batch_size][num_q_heads][head_dim]; query head
// g uses kv head g / (num_q_heads / num_kv_heads). Keys in ascending token order. lse (optional,
// [batch_size][num_q_heads]): the log-sum-exp of the scaled scores, the state merge_state takes
// (attention_state.hpp), -inf for a pair without rows.
template <class T>
void sparse_attention_reference(const LayerView<T>& view, int num_q_heads, float scale, const float* q, float* out,
                                float* lse = nullptr) {
  const int d = view.head_dim;
  const int group = num_q_heads / view.num_kv_heads;
  for (int i = 0; i < view.batch_size; ++i) {
    for (int g = 0; g < num_q_heads; ++g) {
      const int p = i * view.num_kv_heads + g / group;
      const float* qv = q + (static_cast<std::int64_t>(i) * num_q_heads + g) * d;
      SoftmaxAccumulator acc(d);
      for (std::int32_t e = view.indptr[p]; e < view.indptr[p + 1]; ++e) {
        const T* k = view.keys(e);
        const T* v = view.values(e);
        for (std::int32_t r = 0; r < view.valid_tokens[e]; ++r) {
          acc.add(qv, k + static_cast<std::int64_t>(r) * d, v + static_cast<std::int64_t>(r) * d, scale);
        }
      }
      acc.finish(out + (static_cast<std::int64_t>(i) * num_q_heads + g) * d);
      if (lse != nullptr) lse[static_cast<std::int64_t>(i) * num_q_heads + g] = acc.log_sum_exp();
    }
  }
}

// Dense decode attention of one sequence. k, v: [len][num_kv_heads][head_dim];
// q, out: [num_q_heads][head_dim].
template <class T>
void dense_attention_reference(const T* k, const T* v, std::int64_t len, int num_q_heads, int num_kv_heads,
                               int head_dim, float scale, const float* q, float* out) {
  const int group = num_q_heads / num_kv_heads;
  for (int g = 0; g < num_q_heads; ++g) {
    const int h = g / group;
    SoftmaxAccumulator acc(head_dim);
    for (std::int64_t t = 0; t < len; ++t) {
      const std::int64_t off = (t * num_kv_heads + h) * head_dim;
      acc.add(q + static_cast<std::int64_t>(g) * head_dim, k + off, v + off, scale);
    }
    acc.finish(out + static_cast<std::int64_t>(g) * head_dim);
  }
}

}  // namespace v0
}  // namespace oasiskv
