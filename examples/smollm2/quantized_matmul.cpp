#include "quantized_matmul.hpp"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SMOLLM2_AVX2 1
#endif

#include "dequantize.hpp"
#include "llama_model.hpp"  // dot

namespace smollm2 {
namespace {

constexpr int kBlock = 32;

std::uint16_t load_u16(const std::byte* p) {
  std::uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Sum of each 32-element block of x (Q4_1's minimums multiply it).
void block_sums(const float* x, int blocks, float* out) {
  for (int b = 0; b < blocks; ++b) {
    float s = 0.0f;
    for (int j = 0; j < kBlock; ++j) s += x[b * kBlock + j];
    out[b] = s;
  }
}

#ifdef SMOLLM2_AVX2
float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
// Eight quants (bytes, zero- or sign-extended) as floats.
__m256 u8x8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
__m256 i8x8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }
#endif

float dot_q4_1(const float* d, const float* m, const std::uint8_t* q, const float* x, const float* xsum, int nb) {
  float mins = 0.0f;
  for (int b = 0; b < nb; ++b) mins += m[b] * xsum[b];
#ifdef SMOLLM2_AVX2
  __m256 acc = _mm256_setzero_ps();
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int b = 0; b < nb; ++b) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * b));
    const __m128i lo = _mm_and_si128(bytes, low4);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
    const float* xb = x + kBlock * b;
    __m256 t = _mm256_mul_ps(u8x8(lo), _mm256_loadu_ps(xb));
    t = _mm256_fmadd_ps(u8x8(_mm_srli_si128(lo, 8)), _mm256_loadu_ps(xb + 8), t);
    t = _mm256_fmadd_ps(u8x8(hi), _mm256_loadu_ps(xb + 16), t);
    t = _mm256_fmadd_ps(u8x8(_mm_srli_si128(hi, 8)), _mm256_loadu_ps(xb + 24), t);
    acc = _mm256_fmadd_ps(t, _mm256_set1_ps(d[b]), acc);
  }
  return hsum(acc) + mins;
#else
  float s = 0.0f;
  for (int b = 0; b < nb; ++b) {
    float t = 0.0f;
    for (int j = 0; j < 16; ++j) {
      t += static_cast<float>(q[16 * b + j] & 0x0F) * x[kBlock * b + j];
      t += static_cast<float>(q[16 * b + j] >> 4) * x[kBlock * b + j + 16];
    }
    s += d[b] * t;
  }
  return s + mins;
#endif
}

float dot_q8_0(const float* d, const std::uint8_t* q, const float* x, int nb) {
#ifdef SMOLLM2_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const std::uint8_t* qb = q + kBlock * b;
    const float* xb = x + kBlock * b;
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qb));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qb + 16));
    __m256 t = _mm256_mul_ps(i8x8(a), _mm256_loadu_ps(xb));
    t = _mm256_fmadd_ps(i8x8(_mm_srli_si128(a, 8)), _mm256_loadu_ps(xb + 8), t);
    t = _mm256_fmadd_ps(i8x8(c), _mm256_loadu_ps(xb + 16), t);
    t = _mm256_fmadd_ps(i8x8(_mm_srli_si128(c, 8)), _mm256_loadu_ps(xb + 24), t);
    acc = _mm256_fmadd_ps(t, _mm256_set1_ps(d[b]), acc);
  }
  return hsum(acc);
#else
  float s = 0.0f;
  for (int b = 0; b < nb; ++b) {
    float t = 0.0f;
    for (int j = 0; j < kBlock; ++j) t += static_cast<float>(static_cast<std::int8_t>(q[kBlock * b + j])) * x[kBlock * b + j];
    s += d[b] * t;
  }
  return s;
#endif
}

}  // namespace

bool quantizable(std::uint32_t type) {
  return type == static_cast<std::uint32_t>(GgmlType::q4_1) || type == static_cast<std::uint32_t>(GgmlType::q8_0);
}

int QuantizedRows::quant_bytes() const { return type == static_cast<std::uint32_t>(GgmlType::q4_1) ? 16 : kBlock; }

QuantizedRows repack(const TensorInfo& t, int rows, int cols) {
  if (!quantizable(t.type)) throw std::runtime_error(std::string("cannot keep tensor type ") + ggml_type_name(t.type) + " quantized");
  if (cols % kBlock != 0) throw std::runtime_error("quantized rows of " + std::to_string(cols) + " columns (not blocks of 32)");
  QuantizedRows w;
  w.type = t.type;
  w.rows = rows;
  w.cols = cols;
  w.blocks_per_row = cols / kBlock;
  const auto blocks = static_cast<std::size_t>(rows) * static_cast<std::size_t>(w.blocks_per_row);
  const bool q4 = t.type == static_cast<std::uint32_t>(GgmlType::q4_1);
  const std::size_t in_bytes = q4 ? 20 : 34;
  w.d.resize(blocks);
  if (q4) w.m.resize(blocks);
  w.q.resize(blocks * static_cast<std::size_t>(w.quant_bytes()));
  for (std::size_t b = 0; b < blocks; ++b) {
    const std::byte* blk = t.data + b * in_bytes;
    w.d[b] = half_to_float(load_u16(blk));
    if (q4) w.m[b] = half_to_float(load_u16(blk + 2));
    std::memcpy(w.q.data() + b * static_cast<std::size_t>(w.quant_bytes()), blk + (q4 ? 4 : 2),
                static_cast<std::size_t>(w.quant_bytes()));
  }
  return w;
}

void QuantizedRows::dequantize_row(int r, float* out) const {
  const std::size_t b0 = static_cast<std::size_t>(r) * static_cast<std::size_t>(blocks_per_row);
  const bool q4 = type == static_cast<std::uint32_t>(GgmlType::q4_1);
  for (int b = 0; b < blocks_per_row; ++b) {
    const std::uint8_t* qb = q.data() + (b0 + static_cast<std::size_t>(b)) * static_cast<std::size_t>(quant_bytes());
    const float db = d[b0 + static_cast<std::size_t>(b)];
    float* y = out + kBlock * b;
    if (q4) {
      const float mb = m[b0 + static_cast<std::size_t>(b)];
      for (int j = 0; j < 16; ++j) {
        y[j] = db * static_cast<float>(qb[j] & 0x0F) + mb;
        y[j + 16] = db * static_cast<float>(qb[j] >> 4) + mb;
      }
    } else {
      for (int j = 0; j < kBlock; ++j) y[j] = db * static_cast<float>(static_cast<std::int8_t>(qb[j]));
    }
  }
}

void matmul_quantized(const QuantizedRows& w, const float* x, int rows, float* y) {
  const int nb = w.blocks_per_row;
  const bool q4 = w.type == static_cast<std::uint32_t>(GgmlType::q4_1);
  std::vector<float> xsum(static_cast<std::size_t>(rows) * static_cast<std::size_t>(nb));
  if (q4) {
    for (int r = 0; r < rows; ++r) block_sums(x + static_cast<std::size_t>(r) * w.cols, nb, xsum.data() + static_cast<std::size_t>(r) * nb);
  }
  // Decode (one row) stays on the calling thread: a matvec is memory-bound and OpenMP's barriers
  // cost more than they save when the other core is busy. Several rows (prefill) share each weight
  // row while it is in cache.
  constexpr int kRowTile = 64;  // activation rows that stay in L2 while the weights stream past
  for (int r0 = 0; r0 < rows; r0 += kRowTile) {
    const int r1 = std::min(rows, r0 + kRowTile);
#pragma omp parallel for schedule(dynamic, 32) if (r1 - r0 >= 8)
    for (int o = 0; o < w.rows; ++o) {
      const std::size_t b0 = static_cast<std::size_t>(o) * static_cast<std::size_t>(nb);
      const float* d = w.d.data() + b0;
      const std::uint8_t* q = w.q.data() + b0 * static_cast<std::size_t>(w.quant_bytes());
      if (r1 - r0 >= 4) {
        // Several rows: the row dequantised once (in L1), then fp32 dot products, as the fp32 path.
        thread_local std::vector<float> row;
        row.resize(static_cast<std::size_t>(w.cols));
        w.dequantize_row(o, row.data());
        const int in = w.cols;
        int r = r0;
        for (; r + 4 <= r1; r += 4) {
          float s[4];
          const float* xr = x + static_cast<std::size_t>(r) * in;
          dot4(row.data(), xr, xr + in, xr + 2 * in, xr + 3 * in, in, s);
          for (int j = 0; j < 4; ++j) y[static_cast<std::size_t>(r + j) * w.rows + o] = s[j];
        }
        for (; r < r1; ++r) y[static_cast<std::size_t>(r) * w.rows + o] = dot(row.data(), x + static_cast<std::size_t>(r) * in, in);
        continue;
      }
      for (int r = r0; r < r1; ++r) {
        const float* xr = x + static_cast<std::size_t>(r) * w.cols;
        y[static_cast<std::size_t>(r) * w.rows + o] =
            q4 ? dot_q4_1(d, w.m.data() + b0, q, xr, xsum.data() + static_cast<std::size_t>(r) * nb, nb)
               : dot_q8_0(d, q, xr, nb);
      }
    }
  }
}

}  // namespace smollm2
