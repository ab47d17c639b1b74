// Encoder and decoder of RemainderEstimate::quantized's block codes, and their memory
// (quantized_geometry; oasiskv/kit/quantized_rows.hpp).
// Plain loops: codes are written once per block (when an append fills it) and decoded once per
// non-resident block and step, shared by every query head of the kv head.
#include "oasiskv/kit/quantized_rows.hpp"

#include <algorithm>
#include <cstring>
#include <limits>

#include "oasiskv/detail/checked.hpp"
#include "oasiskv/error.hpp"

namespace oasiskv {
inline namespace v0 {

RemainderGeometry quantized_geometry(const CacheConfig& c, std::int64_t max_blocks) {
  const ModelShape& s = c.shape;
  using detail::checked_product;
  // A block's code bits are counted in 32 bits (the device kernels): bounded far above real shapes.
  const std::int64_t bits =
      checked_product("CacheConfig: code bits of a quantized block (block elements x remainder_bits)", 2,
                      c.block_tokens, s.head_dim, c.remainder_bits);
  constexpr std::int64_t int32_max = std::numeric_limits<std::int32_t>::max();
  if (bits > int32_max) {
    fail(
        "CacheConfig: remainder = quantized codes {} bits a block (2 x block_tokens {} x head_dim {} x "
        "remainder_bits "
        "{}), more than {}",
        bits, c.block_tokens, s.head_dim, c.remainder_bits, int32_max);
  }
  RemainderGeometry g;
  g.quantized_block_bytes = quantized_block_bytes(c.block_tokens, s.head_dim, c.remainder_bits);
  g.quantized_bytes =
      checked_product("CacheConfig: quantized row bytes (sequences x layers x kv heads x blocks x block bytes)",
                      c.max_sequences, s.num_layers, s.num_kv_heads, max_blocks, g.quantized_block_bytes);
  return g;
}

namespace {

struct BlockCodes {
  std::int64_t groups = 0, code_bytes = 0, scale_bytes = 0;
  std::int64_t key_codes() const noexcept { return scale_bytes; }
  std::int64_t value_codes() const noexcept { return scale_bytes + code_bytes; }
};

BlockCodes codes_of(int block_tokens, int head_dim, int bits) noexcept {
  BlockCodes c{};
  c.groups = (head_dim + kQuantizedValueGroup - 1) / kQuantizedValueGroup;
  c.code_bytes = (static_cast<std::int64_t>(block_tokens) * head_dim * bits + 7) / 8;
  c.scale_bytes = static_cast<std::int64_t>(block_tokens) * c.groups * 2 * 4;
  return c;
}

// Code e of a stream of `bits`-bit codes. A code spans at most two bytes (bits <= 8).
inline unsigned get_code(const std::uint8_t* p, std::int64_t e, int bits) noexcept {
  const std::int64_t bit = e * bits;
  const auto byte = static_cast<std::size_t>(bit >> 3);
  const int shift = static_cast<int>(bit & 7);
  unsigned v = static_cast<unsigned>(p[byte]) >> shift;
  if (shift + bits > 8) v |= static_cast<unsigned>(p[byte + 1]) << (8 - shift);
  return v & ((1u << bits) - 1u);
}

inline void put_code(std::uint8_t* p, std::int64_t e, int bits, unsigned code) noexcept {
  const std::int64_t bit = e * bits;
  const auto byte = static_cast<std::size_t>(bit >> 3);
  const int shift = static_cast<int>(bit & 7);
  p[byte] = static_cast<std::uint8_t>(p[byte] | (code << shift));
  if (shift + bits > 8) p[byte + 1] = static_cast<std::uint8_t>(p[byte + 1] | (code >> (8 - shift)));
}

// (hi - lo) / levels, finite even where hi - lo overflows (rows near the float range's ends).
inline float step_of(float hi, float lo, float levels) noexcept {
  const float step = (hi - lo) / levels;
  return std::isfinite(step) ? step : hi / levels - lo / levels;
}

// round((x - lo) / step) in [0, levels]; 0 when the run is constant (step 0).
inline unsigned code_of(float x, float lo, float step, float levels) noexcept {
  if (!(step > 0.0f)) return 0;
  const float c = std::nearbyint((x - lo) / step);
  return static_cast<unsigned>(std::clamp(c, 0.0f, levels));
}

}  // namespace

void encode_quantized_block(const float* keys, const float* values, int rows, int block_tokens, int head_dim, int bits,
                            const float* key_max, const float* key_min, std::uint8_t* out) noexcept {
  const BlockCodes c = codes_of(block_tokens, head_dim, bits);
  std::memset(out, 0, static_cast<std::size_t>(quantized_block_bytes(block_tokens, head_dim, bits)));
  const float levels = static_cast<float>((1 << bits) - 1);
  std::uint8_t* kc = out + c.key_codes();
  std::uint8_t* vc = out + c.value_codes();
  float* scales = reinterpret_cast<float*>(out);  // out is 4-byte aligned: blocks are multiples of 4 bytes
  for (int r = 0; r < rows; ++r) {
    const float* k = keys + static_cast<std::int64_t>(r) * head_dim;
    for (int i = 0; i < head_dim; ++i) {
      const float step = step_of(key_max[i], key_min[i], levels);
      put_code(kc, static_cast<std::int64_t>(r) * head_dim + i, bits, code_of(k[i], key_min[i], step, levels));
    }
    const float* v = values + static_cast<std::int64_t>(r) * head_dim;
    for (std::int64_t g = 0; g < c.groups; ++g) {
      const int i0 = static_cast<int>(g) * kQuantizedValueGroup, i1 = std::min(head_dim, i0 + kQuantizedValueGroup);
      float lo = v[i0], hi = v[i0];
      for (int i = i0 + 1; i < i1; ++i) lo = std::min(lo, v[i]), hi = std::max(hi, v[i]);
      const float step = step_of(hi, lo, levels);
      float* s = scales + (static_cast<std::int64_t>(r) * c.groups + g) * 2;
      s[0] = lo;
      s[1] = step;
      for (int i = i0; i < i1; ++i) {
        put_code(vc, static_cast<std::int64_t>(r) * head_dim + i, bits, code_of(v[i], lo, step, levels));
      }
    }
  }
}

namespace {

// The codes of every byte value as floats: its two nibbles (4 bits) and its four 2-bit codes, low
// bits first. Unpacking by table is one load and one copy a byte where shifting each code out was
// the slowest part of decoding 4-bit blocks (4 bits decoded slower than 8).
struct ByteCodes {
  float nibbles[256][2];
  float pairs[256][4];
  ByteCodes() noexcept {
    for (unsigned b = 0; b < 256; ++b) {
      for (unsigned j = 0; j < 2; ++j) nibbles[b][j] = static_cast<float>((b >> (4 * j)) & 15u);
      for (unsigned j = 0; j < 4; ++j) pairs[b][j] = static_cast<float>((b >> (2 * j)) & 3u);
    }
  }
};

const ByteCodes& byte_codes() noexcept {
  static const ByteCodes table;
  return table;
}

// Codes [0, n) of a stream as floats. 2, 4 and 8 bits unpack whole bytes; the others read each
// code's one or two bytes.
void unpack_codes(const std::uint8_t* p, std::int64_t n, int bits, float* out) noexcept {
  std::int64_t e = 0;
  if (bits == 8) {
    for (; e < n; ++e) out[e] = static_cast<float>(p[e]);
  } else if (bits == 4) {
    const ByteCodes& t = byte_codes();
    for (; e + 1 < n; e += 2) std::memcpy(out + e, t.nibbles[p[e >> 1]], sizeof t.nibbles[0]);
  } else if (bits == 2) {
    const ByteCodes& t = byte_codes();
    for (; e + 3 < n; e += 4) std::memcpy(out + e, t.pairs[p[e >> 2]], sizeof t.pairs[0]);
  }
  for (; e < n; ++e) out[e] = static_cast<float>(get_code(p, e, bits));
}

}  // namespace

void decode_quantized_block(const std::uint8_t* in, int rows, int block_tokens, int head_dim, int bits,
                            const float* key_max, const float* key_min, float* keys, float* values) noexcept {
  const BlockCodes c = codes_of(block_tokens, head_dim, bits);
  const float levels = static_cast<float>((1 << bits) - 1);
  const float* scales = reinterpret_cast<const float*>(in);
  const std::int64_t n = static_cast<std::int64_t>(rows) * head_dim;
  unpack_codes(in + c.key_codes(), n, bits, keys);
  unpack_codes(in + c.value_codes(), n, bits, values);
  // Keys: min + code x step of their channel, the steps computed once per block (a chunk at a time).
  constexpr int kChunk = 128;
  float step[kChunk];
  for (int i0 = 0; i0 < head_dim; i0 += kChunk) {
    const int m = std::min(kChunk, head_dim - i0);
    for (int i = 0; i < m; ++i) step[i] = step_of(key_max[i0 + i], key_min[i0 + i], levels);
    for (int r = 0; r < rows; ++r) {
      float* k = keys + static_cast<std::int64_t>(r) * head_dim + i0;
      for (int i = 0; i < m; ++i) k[i] = key_min[i0 + i] + k[i] * step[i];
    }
  }
  for (int r = 0; r < rows; ++r) {
    float* v = values + static_cast<std::int64_t>(r) * head_dim;
    for (std::int64_t g = 0; g < c.groups; ++g) {
      const int i0 = static_cast<int>(g) * kQuantizedValueGroup, i1 = std::min(head_dim, i0 + kQuantizedValueGroup);
      const float* sc = scales + (static_cast<std::int64_t>(r) * c.groups + g) * 2;
      for (int i = i0; i < i1; ++i) v[i] = sc[0] + v[i] * sc[1];
    }
  }
}

}  // namespace v0
}  // namespace oasiskv
