// The tiled attention kernels (attention_kernels.hpp), compiled once per level (isa_kernels.hpp):
// AVX2 + FMA + F16C tiles from avx2 on (the same code, so the same bits, at avx512), the online
// softmax one row at a time at scalar.
#include "attention_kernels.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SMOLLM2_ATTN_AVX2 1
#endif

#include "isa_kernels.hpp"
#include "thread_pool.hpp"

namespace smollm2::SMOLLM2_ISA_NAMESPACE {
namespace {

constexpr int kTile = 64;          // rows converted to float and scored together
constexpr int kMaxHeadDim = 256;   // the tile buffers' width
constexpr std::int64_t kRowsPerTask = 512;  // below this, a head's rows stay on one thread

float to_f(float x) { return x; }
float to_f(oasiskv::fp16_t x) { return oasiskv::to_float(x); }

#ifdef SMOLLM2_ATTN_AVX2
__m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__m256 load8(const oasiskv::fp16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// e^x for x <= 0 (scores minus their running max): Cephes' expf polynomial after reducing by
// ln 2; relative error ~2e-7; x below -87 gives ~0 instead of a denormal.
__m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(pow2));
}

float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// The four sums of a0..a3 as one vector.
__m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// One tile of n rows (k, v: [n][D] floats in L1) folded into the state of `heads` query heads.
template <int D>
void fold_tile(const float* q, int heads, const float* k, const float* v, std::ptrdiff_t n, float scale, float* max, float* sum,
               float* acc) {
  constexpr int V = D / 8;
  alignas(32) float s[kTile];
  n = std::min<std::ptrdiff_t>(n, kTile);  // (always so; tells the compiler s[] is not overrun)
  for (int h = 0; h < heads; ++h) {
    __m256 qv[V];
    for (int i = 0; i < V; ++i) qv[i] = _mm256_mul_ps(_mm256_loadu_ps(q + h * D + 8 * i), _mm256_set1_ps(scale));
    std::ptrdiff_t j = 0;
    for (; j + 4 <= n; j += 4) {
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int i = 0; i < V; ++i) {
        a0 = _mm256_fmadd_ps(qv[i], _mm256_load_ps(k + (j + 0) * D + 8 * i), a0);
        a1 = _mm256_fmadd_ps(qv[i], _mm256_load_ps(k + (j + 1) * D + 8 * i), a1);
        a2 = _mm256_fmadd_ps(qv[i], _mm256_load_ps(k + (j + 2) * D + 8 * i), a2);
        a3 = _mm256_fmadd_ps(qv[i], _mm256_load_ps(k + (j + 3) * D + 8 * i), a3);
      }
      _mm_store_ps(s + j, hsum4(a0, a1, a2, a3));
    }
    for (int tail = 0; tail < 3 && j < n; ++tail, ++j) {  // at most 3 rows after the fours
      const float* kj = k + static_cast<std::ptrdiff_t>(j) * D;
      __m256 a = _mm256_setzero_ps();
      for (int i = 0; i < V; ++i) a = _mm256_fmadd_ps(qv[i], _mm256_load_ps(kj + 8 * i), a);
      s[j] = hsum(a);
    }
    float tile_max = s[0];
    for (std::ptrdiff_t t = 1; t < n; ++t) tile_max = std::max(tile_max, s[t]);
    const float new_max = std::max(max[h], tile_max);
    const float rescale = std::exp(max[h] - new_max);  // 0 for the first tile (max = -inf)
    max[h] = new_max;
    // Pad to a whole vector with -inf so exp gives 0 there.
    for (std::ptrdiff_t t = n; t < ((n + 7) & ~7); ++t) s[t] = -INFINITY;
    __m256 total = _mm256_setzero_ps();
    const __m256 m = _mm256_set1_ps(new_max);
    for (std::ptrdiff_t t = 0; t < n; t += 8) {
      const __m256 p = exp8(_mm256_sub_ps(_mm256_load_ps(s + t), m));
      _mm256_store_ps(s + t, p);
      total = _mm256_add_ps(total, p);
    }
    sum[h] = sum[h] * rescale + hsum(total);
    __m256 o[V];
    const __m256 rs = _mm256_set1_ps(rescale);
    for (int i = 0; i < V; ++i) o[i] = _mm256_mul_ps(_mm256_loadu_ps(acc + h * D + 8 * i), rs);
    for (std::ptrdiff_t t = 0; t < n; ++t) {
      const __m256 p = _mm256_set1_ps(s[t]);
      for (int i = 0; i < V; ++i) o[i] = _mm256_fmadd_ps(p, _mm256_load_ps(v + t * D + 8 * i), o[i]);
    }
    for (int i = 0; i < V; ++i) _mm256_storeu_ps(acc + h * D + 8 * i, o[i]);
  }
}

template <int D, class T>
void attend_rows_avx2(const float* q, int heads, std::span<const KvRows<T>> segments, std::int64_t first,
                      std::int64_t last, AttentionState& st) {
  alignas(32) float kt[kTile * D], vt[kTile * D];
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  std::ptrdiff_t n = 0;
  std::int64_t base = 0;  // index of the segment's first row among all rows
  for (const auto& seg : segments) {
    const std::int64_t a = std::max(first, base), b = std::min(last, base + seg.rows);
    for (std::int64_t r = a; r < b; ++r) {
      const T* kr = seg.keys + (r - base) * seg.stride;
      const T* vr = seg.values + (r - base) * seg.stride;
      for (int i = 0; i < D; i += 8) {
        _mm256_store_ps(kt + n * D + i, load8(kr + i));
        _mm256_store_ps(vt + n * D + i, load8(vr + i));
      }
      if (++n == kTile) {
        fold_tile<D>(q, heads, kt, vt, n, scale, st.max.data(), st.sum.data(), st.acc.data());
        n = 0;
      }
    }
    base += seg.rows;
  }
  if (n > 0) fold_tile<D>(q, heads, kt, vt, n, scale, st.max.data(), st.sum.data(), st.acc.data());
}

// Causal rows: row r of q (heads x D, q_stride apart) over rows [0, positions[r]] of kv. Each
// tile of keys is converted once for all the rows.
template <int D, class T>
void attend_causal_avx2(const float* q, std::int64_t q_stride, int rows, const std::int32_t* positions, int heads,
                        const KvRows<T>& kv, float* out, std::int64_t out_stride) {
  alignas(32) float kt[kTile * D], vt[kTile * D];
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  std::vector<AttentionState> states(static_cast<std::size_t>(rows));
  std::int64_t end = 0;
  for (int r = 0; r < rows; ++r) {
    states[static_cast<std::size_t>(r)].reset(heads, D);
    end = std::max<std::int64_t>(end, positions[r] + 1);
  }
  end = std::min(end, kv.rows);
  for (std::int64_t t0 = 0; t0 < end; t0 += kTile) {
    const std::ptrdiff_t n = std::min<std::int64_t>(kTile, end - t0);
    for (std::ptrdiff_t j = 0; j < n; ++j) {
      const T* kr = kv.keys + (t0 + j) * kv.stride;
      const T* vr = kv.values + (t0 + j) * kv.stride;
      for (int i = 0; i < D; i += 8) {
        _mm256_store_ps(kt + j * D + i, load8(kr + i));
        _mm256_store_ps(vt + j * D + i, load8(vr + i));
      }
    }
    for (int r = 0; r < rows; ++r) {
      const std::int64_t limit = std::min<std::int64_t>(n, positions[r] + 1 - t0);
      if (limit <= 0) continue;
      auto& st = states[static_cast<std::size_t>(r)];
      fold_tile<D>(q + r * q_stride, heads, kt, vt, limit, scale, st.max.data(), st.sum.data(), st.acc.data());
    }
  }
  for (int r = 0; r < rows; ++r) states[static_cast<std::size_t>(r)].finish(D, out + r * out_stride);
}
#endif

// Any head dim, no SIMD: the same online softmax, one row at a time.
template <class T>
void attend_rows_scalar(const float* q, int heads, int d, std::span<const KvRows<T>> segments, std::int64_t first,
                        std::int64_t last, AttentionState& st) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::int64_t base = 0;
  for (const auto& seg : segments) {
    const std::int64_t a = std::max(first, base), b = std::min(last, base + seg.rows);
    for (std::int64_t r = a; r < b; ++r) {
      const T* kr = seg.keys + (r - base) * seg.stride;
      const T* vr = seg.values + (r - base) * seg.stride;
      for (int h = 0; h < heads; ++h) {
        float s = 0.0f;
        for (int i = 0; i < d; ++i) s += q[h * d + i] * to_f(kr[i]);
        s *= scale;
        const float new_max = std::max(st.max[h], s);
        const float rescale = std::exp(st.max[h] - new_max), p = std::exp(s - new_max);
        st.max[h] = new_max;
        st.sum[h] = st.sum[h] * rescale + p;
        float* o = st.acc.data() + h * d;
        for (int i = 0; i < d; ++i) o[i] = o[i] * rescale + p * to_f(vr[i]);
      }
    }
    base += seg.rows;
  }
}

}  // namespace

template <class T>
void fold_rows(const float* q, int heads, int head_dim, std::span<const KvRows<T>> segments, std::int64_t first,
               std::int64_t last, AttentionState& state) {
  if (head_dim <= 0 || head_dim > kMaxHeadDim) throw std::invalid_argument("attend_rows: head dim " + std::to_string(head_dim));
#ifdef SMOLLM2_ATTN_AVX2
  if (head_dim == 64) return attend_rows_avx2<64>(q, heads, segments, first, last, state);
  if (head_dim == 128) return attend_rows_avx2<128>(q, heads, segments, first, last, state);
#endif
  attend_rows_scalar(q, heads, head_dim, segments, first, last, state);
}

template <class T>
void attend_one_row(const float* q, int kv_heads, int group, int d, std::span<const KvRows<T>> segments,
                    std::span<const std::int32_t> indptr, float* out, float* lse) {
  std::int64_t most = 0;
  for (int h = 0; h < kv_heads; ++h) {
    std::int64_t n = 0;
    for (std::int32_t e = indptr[h]; e < indptr[h + 1]; ++e) n += segments[e].rows;
    most = std::max(most, n);
  }
  // Each head's rows in `parts` ranges (flash-decoding): the states are merged afterwards.
  ThreadPool& pool = engine_pool();
  const int parts = static_cast<int>(std::clamp<std::int64_t>(most / kRowsPerTask, 1, pool.threads()));
  thread_local std::vector<AttentionState> states;
  states.resize(static_cast<std::size_t>(kv_heads) * parts);
  auto* st = states.data();  // the workers' thread_local is another vector
  pool.run(kv_heads * parts, [&](int task) {
    const int h = task / parts, part = task % parts;
    const auto segs = segments.subspan(indptr[h], indptr[h + 1] - indptr[h]);
    std::int64_t n = 0;
    for (const auto& s : segs) n += s.rows;
    std::int64_t a, b;
    split_range(n, parts, part, a, b);
    st[task].reset(group, d);
    fold_rows(q + static_cast<std::size_t>(h) * group * d, group, d, segs, a, b, st[task]);
  });
  for (int h = 0; h < kv_heads; ++h) {
    AttentionState& s = st[h * parts];
    for (int p = 1; p < parts; ++p) s.merge(st[h * parts + p], d);
    s.finish(d, out + static_cast<std::size_t>(h) * group * d, lse != nullptr ? lse + static_cast<std::size_t>(h) * group : nullptr);
  }
}

template <class T>
void attend_causal_rows(const float* q, std::int64_t q_stride, int rows, const std::int32_t* positions, int heads,
                        int head_dim, const KvRows<T>& kv, float* out, std::int64_t out_stride) {
#ifdef SMOLLM2_ATTN_AVX2
  if (head_dim == 64) return attend_causal_avx2<64>(q, q_stride, rows, positions, heads, kv, out, out_stride);
  if (head_dim == 128) return attend_causal_avx2<128>(q, q_stride, rows, positions, heads, kv, out, out_stride);
#endif
  AttentionState state;
  for (int r = 0; r < rows; ++r) {
    state.reset(heads, head_dim);
    fold_rows<T>(q + r * q_stride, heads, head_dim, std::span(&kv, 1), 0, std::min<std::int64_t>(kv.rows, positions[r] + 1),
                 state);
    state.finish(head_dim, out + r * out_stride);
  }
}

#define SMOLLM2_INSTANTIATE(T)                                                                                    \
  template void fold_rows<T>(const float*, int, int, std::span<const KvRows<T>>, std::int64_t, std::int64_t,       \
                             AttentionState&);                                                                   \
  template void attend_one_row<T>(const float*, int, int, int, std::span<const KvRows<T>>,                        \
                                  std::span<const std::int32_t>, float*, float*);                                \
  template void attend_causal_rows<T>(const float*, std::int64_t, int, const std::int32_t*, int, int,             \
                                      const KvRows<T>&, float*, std::int64_t);
SMOLLM2_INSTANTIATE(float)
SMOLLM2_INSTANTIATE(oasiskv::fp16_t)
#undef SMOLLM2_INSTANTIATE

}  // namespace smollm2::SMOLLM2_ISA_NAMESPACE
