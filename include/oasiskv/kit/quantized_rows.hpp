// The low-bit copy of a block's rows that RemainderEstimate::quantized keeps for every full block:
// the code format, its encoder and decoder (src/quantized_rows.cpp), and the attention over decoded
// rows that Cache::remainder accumulates block by block.
//
// One block of block_tokens rows and head_dim channels at `bits` bits (quantized_block_bytes):
//   [value scales: block_tokens x groups x (minimum, step) floats]
//   [key codes:    block_tokens x head_dim codes, bits each, packed from bit 0 of the first byte]
//   [value codes:  likewise]
// rounded up to 4 bytes. groups = ceil(head_dim / kQuantizedValueGroup). Keys are coded per channel
// against the block's own key max/min (its Quest summary), so they store no scale: the
// outliers of keys are per channel (a few channels carry large magnitudes), and the summary already
// bounds each channel. Values are coded per row (their outliers are per token), in groups of 32
// channels. Codes round to nearest: code = round((x - min) / step), step = (max - min) / (2^bits - 1).
#pragma once

#include <cmath>
#include <cstdint>

#include "oasiskv/config.hpp"
#include "oasiskv/remainder_geometry.hpp"

namespace oasiskv {
inline namespace v0 {

inline constexpr int kMinQuantizedBits = 2;
inline constexpr int kMaxQuantizedBits = 8;
inline constexpr int kQuantizedValueGroup = 32;  // channels per value scale

// Bytes of one block's codes (the format above). quantized_geometry checks that block elements x
// bits fits before it asks.
constexpr std::int64_t quantized_block_bytes(int block_tokens, int head_dim, int bits) noexcept {
  const std::int64_t groups = (head_dim + kQuantizedValueGroup - 1) / kQuantizedValueGroup;
  const std::int64_t code_bytes = (static_cast<std::int64_t>(block_tokens) * head_dim * bits + 7) / 8;
  const std::int64_t bytes = static_cast<std::int64_t>(block_tokens) * groups * 2 * 4 + 2 * code_bytes;
  return (bytes + 3) / 4 * 4;
}

// The block codes of `remainder = quantized` for `config` with max_blocks blocks a sequence
// (CacheLayout::max_blocks): quantized_block_bytes and quantized_bytes, every other field 0.
// Checks that a block's code bits fit 32 bits (the device kernels count them so) and every size,
// throwing oasiskv::Error naming the bad value; remainder_bits' range is CacheLayout::from's.
RemainderGeometry quantized_geometry(const CacheConfig& config, std::int64_t max_blocks);

// Codes `rows` (<= block_tokens) rows of one block: keys and values [rows][head_dim] floats;
// key_max, key_min [head_dim]: bounds of those keys per channel (the block's summary). Rows past
// `rows` code as zeros. out: quantized_block_bytes(block_tokens, head_dim, bits) bytes.
void encode_quantized_block(const float* keys, const float* values, int rows, int block_tokens, int head_dim, int bits,
                            const float* key_max, const float* key_min, std::uint8_t* out) noexcept;

// The first `rows` rows of a coded block, decoded: keys and values [rows][head_dim] floats.
void decode_quantized_block(const std::uint8_t* in, int rows, int block_tokens, int head_dim, int bits,
                            const float* key_max, const float* key_min, float* keys, float* values) noexcept;

// The rounding noise of coded keys: a key code stands for keys spread evenly over one step of
// each channel, so a coded score carries noise of variance s^2 sum_i q_i^2 step_i^2 / 12, and its
// exp is on average exp(variance / 2) too large (a coded block's mass is overestimated the more,
// the fewer the bits: measured on SmolLM2, 2 bits overestimated the dropped mass by a sixth).
// Returns that half variance for one block, the offset attend_rows subtracts; key_noise: the
// block's step_i^2 / 12 per channel (quantized_key_noise).
inline float quantized_score_offset(const float* q, const float* key_noise, int head_dim, float scale) noexcept {
  float v = 0.0f;
  for (int i = 0; i < head_dim; ++i) v += q[i] * q[i] * key_noise[i];
  return 0.5f * scale * scale * v;
}

// step_i^2 / 12 of each channel of a block coded at `bits` (key_max, key_min: its summary).
inline void quantized_key_noise(const float* key_max, const float* key_min, int head_dim, int bits,
                                float* key_noise) noexcept {
  const float levels = static_cast<float>((1 << bits) - 1);
  for (int i = 0; i < head_dim; ++i) {
    const float step = key_max[i] / levels - key_min[i] / levels;
    key_noise[i] = step * step / 12.0f;
  }
}

// One query's attention state over rows met so far, as an online softmax: max the largest scaled
// score, sum the sum of exp(score - max), acc [head_dim] the sum of exp(score - max) v.
struct RowsAttention {
  float max = -INFINITY;
  float sum = 0.0f;
};

// Adds `rows` rows (keys, values [rows][head_dim]) to the state (st, acc) of query q, each score
// scale q.k lowered by `offset`. scores: scratch of at least `rows` floats.
inline void attend_rows(const float* q, const float* keys, const float* values, int rows, int head_dim, float scale,
                        float offset, RowsAttention& st, float* acc, float* scores) noexcept {
  float top = -INFINITY;
  for (int r = 0; r < rows; ++r) {
    const float* k = keys + static_cast<std::int64_t>(r) * head_dim;
    // Eight partial sums in a fixed order: the compiler vectorises them without reassociating.
    float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int i = 0;
    for (; i + 8 <= head_dim; i += 8) {
      for (int j = 0; j < 8; ++j) lane[j] += q[i + j] * k[i + j];
    }
    for (; i < head_dim; ++i) lane[0] += q[i] * k[i];
    const float dot = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
    scores[r] = dot * scale - offset;
    top = scores[r] > top ? scores[r] : top;
  }
  if (rows == 0) return;
  if (top > st.max) {  // rescale what was summed so far to the new maximum
    const float c = std::exp(st.max - top);
    st.sum *= c;
    for (int i = 0; i < head_dim; ++i) acc[i] *= c;
    st.max = top;
  }
  for (int r = 0; r < rows; ++r) {
    const float w = std::exp(scores[r] - st.max);
    st.sum += w;
    const float* v = values + static_cast<std::int64_t>(r) * head_dim;
    for (int i = 0; i < head_dim; ++i) acc[i] += w * v[i];
  }
}

}  // namespace v0
}  // namespace oasiskv
