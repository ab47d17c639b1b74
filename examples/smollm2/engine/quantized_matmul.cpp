// The quantized products (quantized_matmul.hpp), compiled once per level (isa_kernels.hpp): AVX2
// kernels at avx2, AVX-512 VNNI ones at avx512 (two blocks per instruction), scalar loops at
// scalar; avx2 and avx512 give the same bits.
#include "quantized_matmul.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SMOLLM2_AVX2 1
#endif
// AVX-512 with VNNI (Ice Lake and later, Zen 4 and later): two blocks per 512-bit instruction.
#if defined(SMOLLM2_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define SMOLLM2_AVX512 1
#endif

#include "isa_kernels.hpp"  // this level's dot, dot4
#include "thread_pool.hpp"

namespace smollm2::SMOLLM2_ISA_NAMESPACE {
namespace {

constexpr int kBlock = 32;

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

// fp32 activations: the weights' quants converted to float (exact), products summed in float.
// m: the row's minimums, contiguous.
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


// Activations quantized per block of 32 as llama.cpp's Q8_1 does for Q4_1 weights: q = round(x / d)
// with d = max|x| / 127, and s = d * sum(q) for the Q4_1 minimum term. A decode step then is
// integer multiply-adds (32 per instruction pair) instead of byte-to-float conversions.
void quantize_block(const float* x, std::int8_t* q, float& d, float& s) {
  float amax = 0.0f;
  for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(x[j]));
  d = amax / 127.0f;
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  int sum = 0;
  for (int j = 0; j < kBlock; ++j) {
    const float v = x[j] * inv;
    const int r = static_cast<int>(v + (v >= 0.0f ? 0.5f : -0.5f));
    q[j] = static_cast<std::int8_t>(r);
    sum += r;
  }
  s = d * static_cast<float>(sum);
}

#ifdef SMOLLM2_AVX2
// The 32 weights of a Q4_1 block as bytes in element order (low nibbles 0-15, high 16-31).
__m256i unpack_q4(const std::uint8_t* q) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(bytes, low4);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
  return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}
// Eight int32 sums of four u8 x i8 products each.
__m256i dot_u8_i8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
#endif

#ifdef SMOLLM2_AVX512
// Blocks b and b + 1 of Q4_1 (q: their 32 bytes) as 64 bytes in element order: block b's 32
// weights, then block b + 1's.
__m512i unpack_q4_pair(const std::uint8_t* q) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256(bytes, low4);                        // low nibbles: b, b + 1
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);  // high nibbles: b, b + 1
  // lo b, hi b, lo b + 1, hi b + 1 (64-bit elements; 8 + i: hi's element i).
  const __m512i order = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
  // (Casts: their upper halves are undefined and never read.)
  return _mm512_permutex2var_epi64(_mm512_castsi256_si512(lo), order, _mm512_castsi256_si512(hi));
}
// Lanes 8-15.
__m256 high_half(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }
#endif

// Q4_1's minimum terms sum_b m[o][b] * s[r][b] of sixteen weight rows (group g: rows 16g to
// 16g + 15) for activation rows [r0, r1): out[(r - r0) * 16 + o % 16], one vector multiply-add
// per block for all sixteen.
//
// Rounding, the same at avx2 and avx512: each lane sums as the one-row scalar loop this replaced
// did as GCC 12 vectorised it (products of the first nb & ~7 blocks rounded, then added in order;
// the last nb % 8 blocks fused), so the model's outputs, and the evaluation's numbers, kept their
// bits (checked against the previous library's outputs when this was written; the kernel test
// checks values against an exact sum, tests/model/test_isa_levels.cpp the two levels' bits). The
// multiplies stay apart from the adds: a rounding-mode multiply at avx512, and the level files are
// compiled with -ffp-contract=off (CMakeLists.txt), so no compiler fuses them at avx2.
void minimum_terms(const QuantizedRows& w, int g, const ActivationBlocks& x, int r0, int r1, float* out) {
  const int nb = w.blocks_per_row;
  const float* mg = w.m.data() + static_cast<std::size_t>(g) * static_cast<std::size_t>(nb) * 16;
  for (int r = r0; r < r1; ++r) {
    const float* xs = x.s.data() + static_cast<std::size_t>(r) * static_cast<std::size_t>(nb);
    float* dst = out + static_cast<std::size_t>(r - r0) * 16;
#if defined(SMOLLM2_AVX512)
    __m512 acc = _mm512_setzero_ps();
    int b = 0;
    for (; b < (nb & ~7); ++b) {
      const __m512 p = _mm512_mul_round_ps(_mm512_loadu_ps(mg + 16 * b), _mm512_set1_ps(xs[b]),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      acc = _mm512_add_ps(acc, p);
    }
    for (; b < nb; ++b) acc = _mm512_fmadd_ps(_mm512_loadu_ps(mg + 16 * b), _mm512_set1_ps(xs[b]), acc);
    _mm512_storeu_ps(dst, acc);
#elif defined(SMOLLM2_AVX2)
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    int b = 0;
    for (; b < (nb & ~7); ++b) {
      const __m256 s = _mm256_set1_ps(xs[b]);
      lo = _mm256_add_ps(lo, _mm256_mul_ps(_mm256_loadu_ps(mg + 16 * b), s));  // rounded, then added
      hi = _mm256_add_ps(hi, _mm256_mul_ps(_mm256_loadu_ps(mg + 16 * b + 8), s));
    }
    for (; b < nb; ++b) {
      const __m256 s = _mm256_set1_ps(xs[b]);
      lo = _mm256_fmadd_ps(_mm256_loadu_ps(mg + 16 * b), s, lo);
      hi = _mm256_fmadd_ps(_mm256_loadu_ps(mg + 16 * b + 8), s, hi);
    }
    _mm256_storeu_ps(dst, lo);
    _mm256_storeu_ps(dst + 8, hi);
#else
    for (int l = 0; l < 16; ++l) dst[l] = 0.0f;
    for (int b = 0; b < nb; ++b)
      for (int l = 0; l < 16; ++l) dst[l] += mg[16 * b + l] * xs[b];
#endif
  }
}

// R (1..8) activation rows against one weight row: each weight block is unpacked once for all R.
// mins: the rows' minimum terms (minimum_terms), 16 floats apart; zeros for Q8_0.
template <int R>
void dot_rows(const QuantizedRows& w, int o, const ActivationBlocks& x, int r0, const float* mins, float* out) {
  const int nb = w.blocks_per_row;
  const bool q4 = w.type == static_cast<std::uint32_t>(GgmlType::q4_1);
  const std::size_t b0 = static_cast<std::size_t>(o) * static_cast<std::size_t>(nb);
  const float* wd = w.d.data() + b0;
  const std::uint8_t* wq = w.q.data() + b0 * static_cast<std::size_t>(w.quant_bytes());
  const std::int8_t* xq[R];
  const float* xd[R];
  for (int r = 0; r < R; ++r) {
    xq[r] = x.q.data() + static_cast<std::size_t>(r0 + r) * static_cast<std::size_t>(x.cols);
    xd[r] = x.d.data() + static_cast<std::size_t>(r0 + r) * static_cast<std::size_t>(nb);
  }
#ifdef SMOLLM2_AVX2
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  int b = 0;
#ifdef SMOLLM2_AVX512
  // Two blocks at a time: the weights' unpacking, the activations' loads, the integer dot
  // products and their conversion in 512-bit instructions, half as many as the 256-bit loop's
  // (from two activation rows on, the decode step's products are bound by instructions, not by
  // the weights' bytes). The two blocks are folded into the 8 lanes one after the other, as the
  // 256-bit loop folds them: the same sums, bit for bit.
  const int pairs_end = nb & ~1;
  for (int c = 0; c < pairs_end; c += 16) {
    // The scales wd[b] * xd[r][b] of up to sixteen blocks in one multiply per row (the same
    // product, rounded once, as the 256-bit loop's): the multiply-adds below read them as
    // broadcast memory operands, where a broadcast per block would cost a shuffle per row.
    const int n = std::min(16, pairs_end - c);
    const __mmask16 k = _cvtu32_mask16(0xFFFFu >> (16 - n));
    const __m512 w_scales = _mm512_maskz_loadu_ps(k, wd + c);
    alignas(64) float scales[R][16];
    for (int r = 0; r < R; ++r) _mm512_store_ps(scales[r], _mm512_mul_ps(w_scales, _mm512_maskz_loadu_ps(k, xd[r] + c)));
    for (b = c; b < c + n; b += 2) {
      __m512i wu, wsign = _mm512_setzero_si512();
      if (q4) {
        wu = unpack_q4_pair(wq + 16 * b);
      } else {
        wsign = _mm512_loadu_si512(wq + kBlock * b);
        wu = _mm512_abs_epi8(wsign);
      }
      for (int r = 0; r < R; ++r) {
        __m512i xv = _mm512_loadu_si512(xq[r] + kBlock * b);
        // Signed weights: |w| as the unsigned operand, the sign moved onto the activation.
        if (!q4) xv = _mm512_mask_sub_epi8(xv, _mm512_movepi8_mask(wsign), _mm512_setzero_si512(), xv);
        const __m512 p = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wu, xv));
        acc[r] = _mm256_fmadd_ps(_mm512_castps512_ps256(p), _mm256_set1_ps(scales[r][b - c]), acc[r]);
        acc[r] = _mm256_fmadd_ps(high_half(p), _mm256_set1_ps(scales[r][b - c + 1]), acc[r]);
      }
    }
  }
  b = pairs_end;
#endif
  for (; b < nb; ++b) {
    __m256i wu, wsign;
    if (q4) {
      wu = unpack_q4(wq + 16 * b);
    } else {
      // Signed weights: |w| as the unsigned operand, the sign moved onto the activation.
      wsign = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + kBlock * b));
      wu = _mm256_sign_epi8(wsign, wsign);
    }
    for (int r = 0; r < R; ++r) {
      __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[r] + kBlock * b));
      if (!q4) xv = _mm256_sign_epi8(xv, wsign);
      const __m256 p = _mm256_cvtepi32_ps(dot_u8_i8(wu, xv));
      acc[r] = _mm256_fmadd_ps(p, _mm256_set1_ps(wd[b] * xd[r][b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) + mins[16 * r];
#else
  for (int r = 0; r < R; ++r) {
    float sum = 0.0f;
    for (int b = 0; b < nb; ++b) {
      int t = 0;
      const std::int8_t* xb = xq[r] + kBlock * b;
      if (q4) {
        const std::uint8_t* qb = wq + 16 * b;
        for (int j = 0; j < 16; ++j) t += (qb[j] & 0x0F) * xb[j] + (qb[j] >> 4) * xb[j + 16];
      } else {
        const std::uint8_t* qb = wq + kBlock * b;
        for (int j = 0; j < kBlock; ++j) t += static_cast<std::int8_t>(qb[j]) * xb[j];
      }
      sum += wd[b] * xd[r][b] * static_cast<float>(t);
    }
    out[r] = sum + mins[16 * r];
  }
#endif
}

}  // namespace

void quantize_activation_rows(const float* x, int rows, int cols, ActivationBlocks& out) {
  if (cols % kBlock != 0) throw std::invalid_argument("activations of " + std::to_string(cols) + " columns (not blocks of 32)");
  const int nb = cols / kBlock;
  out.rows = rows;
  out.cols = cols;
  out.q.resize(static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols));
  out.d.resize(static_cast<std::size_t>(rows) * static_cast<std::size_t>(nb));
  out.s.resize(out.d.size());
  for (std::size_t b = 0; b < out.d.size(); ++b)
    quantize_block(x + b * kBlock, out.q.data() + b * kBlock, out.d[b], out.s[b]);
}

void matmul_int8(const QuantizedRows& w, const ActivationBlocks& x, float* y) {
  if (x.cols != w.cols) throw std::invalid_argument("matmul_quantized: activations of " + std::to_string(x.cols) +
                                                    " columns for a " + std::to_string(w.cols) + "-column matrix");
  const int rows = x.rows;
  // Output rows in chunks over the engine's threads; within a chunk, activation rows up to eight
  // at a time so each weight block is unpacked once per eight rows (prefill), and tiles of 64
  // activation rows so that they stay in L2 while the chunk's weight rows stream past.
  // Chunks are whole groups of 16 weight rows, the rows whose minimum terms are summed together.
  constexpr int kRowTile = 64;
  ThreadPool& pool = engine_pool();
  const bool q4 = w.type == static_cast<std::uint32_t>(GgmlType::q4_1);
  const int chunk = (std::max(16, (w.rows + 8 * pool.threads() - 1) / (8 * pool.threads())) + 15) / 16 * 16;
  const int chunks = (w.rows + chunk - 1) / chunk;
  pool.run(chunks, [&](int task) {
    const int o0 = task * chunk, o1 = std::min(w.rows, o0 + chunk);
    float s[8];
    alignas(64) float mins[kRowTile * 16];
    if (!q4) std::fill_n(mins, std::min(rows, kRowTile) * 16, 0.0f);  // Q8_0 has no minimum terms
    auto store = [&](int o, int r, int n) {
      for (int j = 0; j < n; ++j) y[static_cast<std::size_t>(r + j) * w.rows + o] = s[j];
    };
    for (int r0 = 0; r0 < rows; r0 += kRowTile) {
      const int r1 = std::min(rows, r0 + kRowTile);
      for (int o = o0; o < o1; ++o) {
        if (q4 && o % 16 == 0) minimum_terms(w, o / 16, x, r0, r1, mins);
        const float* m = mins + o % 16;
        int r = r0;
        for (; r + 8 <= r1; r += 8) {
          dot_rows<8>(w, o, x, r, m + (r - r0) * 16, s);
          store(o, r, 8);
        }
        // The rest in one call (a decode step with a lookahead row or drafts: 2 to 5 rows).
        const float* mr = m + (r - r0) * 16;
        switch (r1 - r) {
          case 1: dot_rows<1>(w, o, x, r, mr, s); break;
          case 2: dot_rows<2>(w, o, x, r, mr, s); break;
          case 3: dot_rows<3>(w, o, x, r, mr, s); break;
          case 4: dot_rows<4>(w, o, x, r, mr, s); break;
          case 5: dot_rows<5>(w, o, x, r, mr, s); break;
          case 6: dot_rows<6>(w, o, x, r, mr, s); break;
          case 7: dot_rows<7>(w, o, x, r, mr, s); break;
          default: break;
        }
        store(o, r, r1 - r);
      }
    }
  });
}

void matmul_fp32_activations(const QuantizedRows& w, const float* x, int rows, float* y) {
  const int nb = w.blocks_per_row;
  const bool q4 = w.type == static_cast<std::uint32_t>(GgmlType::q4_1);
  std::vector<float> xsum(static_cast<std::size_t>(rows) * static_cast<std::size_t>(nb));
  if (q4) {
    for (int r = 0; r < rows; ++r) block_sums(x + static_cast<std::size_t>(r) * w.cols, nb, xsum.data() + static_cast<std::size_t>(r) * nb);
  }
  // Output rows in chunks over the engine's threads; several activation rows (prefill) share
  // each weight row while it is in cache.
  constexpr int kRowTile = 64;  // activation rows that stay in L2 while the weights stream past
  ThreadPool& pool = engine_pool();
  const int chunk = std::max(8, (w.rows + 8 * pool.threads() - 1) / (8 * pool.threads()));
  pool.run((w.rows + chunk - 1) / chunk, [&](int task) {
  const int o0 = task * chunk, o1 = std::min(w.rows, o0 + chunk);
  for (int r0 = 0; r0 < rows; r0 += kRowTile) {
    const int r1 = std::min(rows, r0 + kRowTile);
    for (int o = o0; o < o1; ++o) {
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
      // The row's minimums gathered from their groups of 16 rows, so that dot_q4_1 sums them as
      // one contiguous row (the loop, and so its rounding, that it always had).
      thread_local std::vector<float> row_m;
      if (q4) {
        row_m.resize(static_cast<std::size_t>(nb));
        for (int b = 0; b < nb; ++b) row_m[static_cast<std::size_t>(b)] = w.m[w.min_index(o, b)];
      }
      for (int r = r0; r < r1; ++r) {
        const float* xr = x + static_cast<std::size_t>(r) * w.cols;
        y[static_cast<std::size_t>(r) * w.rows + o] =
            q4 ? dot_q4_1(d, row_m.data(), q, xr, xsum.data() + static_cast<std::size_t>(r) * nb, nb)
               : dot_q8_0(d, q, xr, nb);
      }
    }
  }
  });
}

}  // namespace smollm2::SMOLLM2_ISA_NAMESPACE
