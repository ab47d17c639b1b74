#include "dense_attention_tight.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <memory>

namespace oasiskv::bench {
namespace {

constexpr int kLanes = 8;

const float* fp16_table() {
  static const std::unique_ptr<std::array<float, 65536>> table = [] {
    auto t = std::make_unique<std::array<float, 65536>>();
    for (std::uint32_t i = 0; i < 65536; ++i) (*t)[i] = to_float(fp16_t{static_cast<std::uint16_t>(i)});
    return t;
  }();
  return table->data();
}

void convert_row(const float* table, const fp16_t* in, int n, float* out) {
  for (int i = 0; i < n; ++i) out[i] = table[in[i].bits];
}

float dot(const float* a, const float* b, int n) {
  float lane[kLanes] = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) lane[j] += a[i + j] * b[i + j];
  }
  float s = 0.0f;
  for (; i < n; ++i) s += a[i] * b[i];
  for (float x : lane) s += x;
  return s;
}

}  // namespace

void dense_attention_tight(const fp16_t* k, const fp16_t* v, std::int64_t len, int num_q_heads,
                           int num_kv_heads, int head_dim, float scale, const float* q, float* out,
                           std::vector<float>& scratch) {
  const float* table = fp16_table();
  const int group = num_q_heads / num_kv_heads;
  const auto d = static_cast<std::size_t>(head_dim);
  // [group][len] scores, then one converted row, then [group][head_dim] accumulators.
  scratch.resize(static_cast<std::size_t>(group) * static_cast<std::size_t>(len) + d + static_cast<std::size_t>(group) * d);
  float* scores = scratch.data();
  float* row = scores + static_cast<std::size_t>(group) * static_cast<std::size_t>(len);
  float* acc = row + d;
  for (int h = 0; h < num_kv_heads; ++h) {
    const float* qh = q + static_cast<std::size_t>(h * group) * d;
    for (std::int64_t t = 0; t < len; ++t) {
      convert_row(table, k + (t * num_kv_heads + h) * head_dim, head_dim, row);
      for (int g = 0; g < group; ++g) scores[g * len + t] = dot(qh + static_cast<std::size_t>(g) * d, row, head_dim) * scale;
    }
    float sums[64] = {};  // group <= 64
    for (int g = 0; g < group; ++g) {
      float* s = scores + g * len;
      const float top = *std::max_element(s, s + len);
      float total = 0.0f;
      for (std::int64_t t = 0; t < len; ++t) total += (s[t] = std::exp(s[t] - top));
      sums[g] = total;
    }
    std::fill(acc, acc + static_cast<std::size_t>(group) * d, 0.0f);
    for (std::int64_t t = 0; t < len; ++t) {
      convert_row(table, v + (t * num_kv_heads + h) * head_dim, head_dim, row);
      for (int g = 0; g < group; ++g) {
        const float w = scores[g * len + t];
        float* a = acc + static_cast<std::size_t>(g) * d;
        for (std::size_t c = 0; c < d; ++c) a[c] += w * row[c];
      }
    }
    for (int g = 0; g < group; ++g) {
      for (std::size_t c = 0; c < d; ++c) {
        out[static_cast<std::size_t>(h * group + g) * d + c] = acc[static_cast<std::size_t>(g) * d + c] / sums[g];
      }
    }
  }
}

}  // namespace oasiskv::bench
