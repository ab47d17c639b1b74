// The estimate of the attention over blocks that are not resident (CacheConfig::remainder,
// Cache::remainder): per block a log-mass from the query, the block's key sum and key min/max, and
// its mean value; over a set of blocks an attention state (attention_state.hpp). Plain loops, the
// CPU backend's implementation and the tests' definition.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "oasiskv/config.hpp"
#include "oasiskv/summary.hpp"  // quest_bound: the clamp

namespace oasiskv {
inline namespace v0 {

// The estimated log of sum_t exp(scale q.k_t) over the n rows of one block (CacheConfig's
// RemainderEstimate comment has the formulas). moments: the block's [key sum | value sum | key
// sum of squares (variance only)][head_dim]; key_max, key_min: its Quest summary (read by gaussian
// and variance: the spread term and the clamp at the hard bound); sigma the spread's share of the
// range (gaussian only).
inline float remainder_logit(RemainderEstimate kind, const float* q, const float* moments, const float* key_max,
                             const float* key_min, int head_dim, int n, float scale, float sigma) noexcept {
  const float* key_sum = moments;
  const float inv_n = 1.0f / static_cast<float>(n);
  float dot = 0.0f, spread = 0.0f;
  for (int i = 0; i < head_dim; ++i) dot += q[i] * key_sum[i];
  const float log_n = std::log(static_cast<float>(n));
  float logit = log_n + scale * dot * inv_n;
  if (kind == RemainderEstimate::centroid || kind == RemainderEstimate::clusters) return logit;
  if (kind == RemainderEstimate::gaussian) {
    for (int i = 0; i < head_dim; ++i) {
      const float r = (key_max[i] - key_min[i]) * q[i];
      spread += r * r;
    }
    logit += 0.5f * scale * scale * sigma * sigma * spread;  // 0.5 s^2 sum q_i^2 (sigma r_i)^2
  } else {  // variance
    const float* key_sq = moments + 2 * head_dim;
    for (int i = 0; i < head_dim; ++i) {
      const float mu = key_sum[i] * inv_n;
      const float var = std::max(key_sq[i] * inv_n - mu * mu, 0.0f);  // float cancellation can dip below 0
      spread += q[i] * q[i] * var;
    }
    logit += 0.5f * scale * scale * spread;  // 0.5 s^2 sum q_i^2 var_i
  }
  // No row scores above the Quest bound, so the block's mass is at most n exp(s bound).
  return std::min(logit, log_n + scale * quest_bound(q, key_max, key_min, head_dim));
}

// One block for remainder_state: its moments ([key sum | value sum (| key sum of squares)]
// [head_dim]), key summary
// ([max | min][head_dim]) and rows.
struct RemainderBlock {
  const float* moments = nullptr;
  const float* summary = nullptr;
  int rows = 0;
  // The rows the estimate stands for, when not all of `rows` (whose means the moments give): a
  // key cluster's rows outside the resident blocks (RemainderEstimate::clusters). 0: rows.
  int weight_rows = 0;
};

// The state of the estimated attention of query q over `blocks`: lse = log sum_b w_b, out =
// sum_b w_b vbar_b / sum_b w_b with w_b = exp(remainder_logit) and vbar_b the block's mean value.
// No block: lse = -inf, out = 0. logits: scratch.
inline void remainder_state(RemainderEstimate kind, const float* q, std::span<const RemainderBlock> blocks,
                            int head_dim, float scale, float sigma, float* out, float& lse, std::vector<float>& logits) {
  for (int i = 0; i < head_dim; ++i) out[i] = 0.0f;
  lse = -INFINITY;
  if (blocks.empty()) return;
  logits.resize(blocks.size());
  float top = -INFINITY;
  for (std::size_t b = 0; b < blocks.size(); ++b) {
    const RemainderBlock& x = blocks[b];
    const float* summary_max = x.summary;  // null for a key cluster (the centroid logit reads none)
    logits[b] = remainder_logit(kind, q, x.moments, summary_max, summary_max ? summary_max + head_dim : nullptr, head_dim,
                                x.rows, scale, sigma);
    if (x.weight_rows > 0 && x.weight_rows != x.rows) {
      logits[b] += std::log(static_cast<float>(x.weight_rows)) - std::log(static_cast<float>(x.rows));
    }
    top = logits[b] > top ? logits[b] : top;
  }
  float total = 0.0f;
  for (std::size_t b = 0; b < blocks.size(); ++b) {
    const float w = std::exp(logits[b] - top);
    total += w;
    const float wv = w / static_cast<float>(blocks[b].rows);  // the value sum to the mean value
    const float* vsum = blocks[b].moments + head_dim;
    for (int i = 0; i < head_dim; ++i) out[i] += wv * vsum[i];
  }
  const float inv = 1.0f / total;
  for (int i = 0; i < head_dim; ++i) out[i] *= inv;
  lse = top + std::log(total);
}

}  // namespace v0
}  // namespace oasiskv
