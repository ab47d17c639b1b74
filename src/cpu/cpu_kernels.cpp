// The summary fold (SummaryStore::add_key) and the scores of a run of blocks (the Quest bound,
// the spread score: LookaheadSelector::score): portable versions, and AVX / F16C versions that compute the same
// bits. Rules that keep them bit-identical:
// - std::max(a, b) is (a < b) ? b : a, which is exactly _mm256_max_ps(b, a) (MAXPS returns its
//   second operand when the values are equal or unordered); std::min(a, b) is (b < a) ? b : a,
//   exactly _mm256_min_ps(b, a).
// - Lane j of the bound's sum takes channels j, j + 8, ... in order, as quest_bound does; one
//   256-bit vector holds the 8 lanes, so the vector code adds the same terms in the same order.
// - No function here is compiled with FMA enabled: with -ffp-contract=fast (GCC's default for
//   C++) a target with FMA could fuse q * max + lane into one rounding, and the bits would change.
#include "oasiskv/cpu/detail/cpu_kernels.hpp"

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "cpu_features.hpp"
#include "oasiskv/kit/score_formulas.hpp"
#include "stream_store.hpp"

#if OASISKV_X86_KERNELS
#include <immintrin.h>
#endif

namespace oasiskv {
inline namespace v0 {
namespace detail {

namespace {

// ---- fold: portable ----

template <class T>
void fold_portable(float* mx, float* mn, const T* key, int d, bool reset) noexcept {
  if (reset) {
    for (int i = 0; i < d; ++i) mx[i] = mn[i] = to_float(key[i]);
  } else {
    for (int i = 0; i < d; ++i) {
      const float k = to_float(key[i]);
      mx[i] = std::max(mx[i], k);
      mn[i] = std::min(mn[i], k);
    }
  }
}

#if OASISKV_X86_KERNELS

// ---- fold: AVX ----

// Loads 8 channels as float. Each conversion is exact; F16C differs from to_float only in a
// signalling NaN, which it quiets: `nan` says a lane is NaN, so a reset can store to_float's bits.
struct Load8 {
  __attribute__((target("avx"))) static __m256 at(const float* p) noexcept { return _mm256_loadu_ps(p); }
  __attribute__((target("avx,f16c"))) static __m256 at(const fp16_t* p) noexcept {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  __attribute__((target("avx"))) static __m256 at(const bf16_t* p) noexcept {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i zero = _mm_setzero_si128();
    const __m128i lo = _mm_unpacklo_epi16(zero, h), hi = _mm_unpackhi_epi16(zero, h);  // bits << 16
    return _mm256_castsi256_ps(_mm256_insertf128_si256(_mm256_castsi128_si256(lo), hi, 1));
  }
};

template <class T>
__attribute__((target("avx,f16c"))) void fold_avx(float* mx, float* mn, const T* key, int d, bool reset) noexcept {
  int i = 0;
  if (reset) {
    for (; i + 8 <= d; i += 8) {
      const __m256 k = Load8::at(key + i);
      if constexpr (std::is_same_v<T, fp16_t>) {
        if (_mm256_movemask_ps(_mm256_cmp_ps(k, k, _CMP_UNORD_Q)) != 0) {
          _mm256_zeroupper();  // portable (SSE) code next: see the tail below
          fold_portable(mx + i, mn + i, key + i, 8, true);
          continue;
        }
      }
      _mm256_storeu_ps(mx + i, k);
      _mm256_storeu_ps(mn + i, k);
    }
  } else {
    for (; i + 8 <= d; i += 8) {
      const __m256 k = Load8::at(key + i);
      _mm256_storeu_ps(mx + i, _mm256_max_ps(k, _mm256_loadu_ps(mx + i)));  // std::max(mx, k)
      _mm256_storeu_ps(mn + i, _mm256_min_ps(k, _mm256_loadu_ps(mn + i)));  // std::min(mn, k)
    }
  }
  // The channels past the last 8: portable (SSE) code, entered with the upper halves cleared.
  // GCC emits no vzeroupper before this tail call, and on a Sapphire Rapids guest the call cost
  // ~115 ns even with nothing left to fold (10x the fold of 128 channels): call only when needed.
  if (i < d) {
    _mm256_zeroupper();
    fold_portable(mx + i, mn + i, key + i, d - i, reset);
  }
}

// ---- Quest bound: AVX ----

// sum_lanes (oasiskv/kit/score_formulas.hpp) of the 8 lanes of v, the same additions in the same order:
// ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)).
__attribute__((target("avx"))) inline float sum_lanes_avx(__m256 v) noexcept {
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // l0+l4, l1+l5, l2+l6, l3+l7
  const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));  // (l0+l4)+(l2+l6), (l1+l5)+(l3+l7)
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}

// NB blocks x NQ queries at once: NB * NQ independent lane vectors, so the adds of one lane,
// which must stay in channel order, overlap with the others'.
template <int NB, int NQ>
__attribute__((target("avx"))) inline void bound_tile(const float* summaries, std::int64_t b0, const float* queries,
                                                      int q0, int nq, int d, float* out) noexcept {
  const std::int64_t stride = 2 * static_cast<std::int64_t>(d);
  __m256 acc[NB][NQ];
  for (int b = 0; b < NB; ++b)
    for (int q = 0; q < NQ; ++q) acc[b][q] = _mm256_setzero_ps();
  int i = 0;
  for (; i + kScoreLanes <= d; i += kScoreLanes) {
    for (int b = 0; b < NB; ++b) {
      const float* mx = summaries + (b0 + b) * stride;
      const __m256 vmax = _mm256_loadu_ps(mx + i), vmin = _mm256_loadu_ps(mx + d + i);
      for (int q = 0; q < NQ; ++q) {
        const __m256 vq = _mm256_loadu_ps(queries + static_cast<std::int64_t>(q0 + q) * d + i);
        const __m256 hi = _mm256_mul_ps(vq, vmax), lo = _mm256_mul_ps(vq, vmin);
        acc[b][q] = _mm256_add_ps(acc[b][q], _mm256_max_ps(lo, hi));  // std::max(hi, lo)
      }
    }
  }
  for (int b = 0; b < NB; ++b) {
    const float* mx = summaries + (b0 + b) * stride;
    for (int q = 0; q < NQ; ++q) {
      if (i == d) {  // no channels past the last 8: the lanes summed in registers
        out[(b0 + b) * nq + q0 + q] = sum_lanes_avx(acc[b][q]);
        continue;
      }
      const float* qv = queries + static_cast<std::int64_t>(q0 + q) * d;
      alignas(32) float lane[kScoreLanes];
      _mm256_store_ps(lane, acc[b][q]);
      for (int c = i, j = 0; c < d; ++c, ++j) lane[j] += std::max(qv[c] * mx[c], qv[c] * mx[d + c]);
      out[(b0 + b) * nq + q0 + q] = sum_lanes(lane);
    }
  }
}

// Queries of blocks [b0, b0 + NB): tiles of up to 4 lane vectors per block (NB * NQ <= 6 in
// all, so that the accumulators, the summaries and a query fit the 16 registers).
template <int NB>
__attribute__((target("avx"))) inline void bound_blocks(const float* summaries, std::int64_t b0, const float* queries,
                                                        int nq, int d, float* out) noexcept {
  constexpr int kTile = NB == 1 ? 4 : NB == 2 ? 3 : 1;
  int q = 0;
  for (; q + kTile <= nq; q += kTile) bound_tile<NB, kTile>(summaries, b0, queries, q, nq, d, out);
  switch (nq - q) {
    case 3: bound_tile<NB, 3>(summaries, b0, queries, q, nq, d, out); break;
    case 2: bound_tile<NB, 2>(summaries, b0, queries, q, nq, d, out); break;
    case 1: bound_tile<NB, 1>(summaries, b0, queries, q, nq, d, out); break;
    default: break;
  }
}

// Summaries are streamed from memory (a layer's are far larger than the caches): blocks this far
// ahead are requested while the current ones are scored. Measured (Zen 4, 4 queries): without
// it the hardware prefetcher alone reaches half the bandwidth that a plain read loop does; with
// the summaries cold (a decode step's weights evict them), 16 blocks (8 KiB at d 64) ahead read
// about 10% faster than 4 (oasiskv_bench BM_Score/seqs:8, from DRAM).
constexpr std::int64_t kPrefetchBlocks = 16;

__attribute__((target("avx"))) void quest_bound_blocks_avx(const float* summaries, std::int64_t blocks,
                                                           const float* queries, int nq, int d, float* out) noexcept {
  std::int64_t b = 0;
  const std::int64_t stride = 2 * static_cast<std::int64_t>(d);
  const auto ahead = [&](std::int64_t from, std::int64_t count) {
    const std::int64_t first = from + kPrefetchBlocks, last = std::min(blocks, first + count);
    if (first >= last) return;
    const char* p = reinterpret_cast<const char*>(summaries + first * stride);
    const std::int64_t bytes = (last - first) * stride * static_cast<std::int64_t>(sizeof(float));
    for (std::int64_t o = 0; o < bytes; o += 64) prefetch_read(p + o);
  };
  // Tiles of 4 blocks (one query) or 2 blocks x up to 3 queries keep 4 to 6 independent add
  // chains in flight. Measured (Zen 4, d 64, 500 blocks): 3 queries (SmolLM2's group) 2.3x the
  // single-chain tiles, 6 queries 2.2x, with the lanes summed in registers.
  if (nq == 1) {
    for (; b + 4 <= blocks; b += 4) {
      ahead(b, 4);
      bound_blocks<4>(summaries, b, queries, nq, d, out);
    }
  } else {
    for (; b + 2 <= blocks; b += 2) {
      ahead(b, 2);
      bound_blocks<2>(summaries, b, queries, nq, d, out);
    }
  }
  for (; b < blocks; ++b) {
    ahead(b, 1);
    bound_blocks<1>(summaries, b, queries, nq, d, out);
  }
}

// ---- spread scores: AVX ----

// One block x NQ queries: the block's centre and range of 8 channels are computed once for the
// tile's queries; each query keeps SpreadLanes' lane vectors (the same operations, channels in
// the same lanes and order), the channels past the last 8 and the lane sums are theirs (add,
// finish).
template <int NQ>
__attribute__((target("avx"))) inline void score_tile(const ScoreParams& p, const float* mx, const float* queries,
                                                      int q0, int d, float* out) noexcept {
  __m256 centre[NQ], range[NQ];  // sums of q c and of |q| r
  for (int q = 0; q < NQ; ++q) centre[q] = range[q] = _mm256_setzero_ps();
  const __m256 half = _mm256_set1_ps(0.5f), sign = _mm256_set1_ps(-0.0f);
  int i = 0;
  for (; i + kScoreLanes <= d; i += kScoreLanes) {
    const __m256 vmax = _mm256_loadu_ps(mx + i), vmin = _mm256_loadu_ps(mx + d + i);
    const __m256 c = _mm256_mul_ps(_mm256_add_ps(vmax, vmin), half), r = _mm256_sub_ps(vmax, vmin);
    for (int q = 0; q < NQ; ++q) {
      const __m256 vq = _mm256_loadu_ps(queries + static_cast<std::int64_t>(q0 + q) * d + i);
      centre[q] = _mm256_add_ps(centre[q], _mm256_mul_ps(vq, c));
      range[q] = _mm256_add_ps(range[q], _mm256_mul_ps(_mm256_andnot_ps(sign, vq), r));  // std::fabs(q) * r
    }
  }
  for (int q = 0; q < NQ; ++q) {
    const float* qv = queries + static_cast<std::int64_t>(q0 + q) * d;
    SpreadLanes l;
    _mm256_storeu_ps(l.centre, centre[q]);
    _mm256_storeu_ps(l.range, range[q]);
    for (int c = i, j = 0; c < d; ++c, ++j) l.add(j, qv[c], mx[c], mx[d + c]);
    out[q0 + q] = l.finish(p.half_alpha);
  }
}

__attribute__((target("avx"))) void spread_blocks_avx(const ScoreParams& p, const float* summaries, std::int64_t blocks,
                                                      const float* queries, int nq, int d, float* out) noexcept {
  const std::int64_t stride = 2 * static_cast<std::int64_t>(d);
  for (std::int64_t b = 0; b < blocks; ++b) {
    if (b + kPrefetchBlocks < blocks) {
      const char* a = reinterpret_cast<const char*>(summaries + (b + kPrefetchBlocks) * stride);
      for (std::int64_t o = 0; o < stride * static_cast<std::int64_t>(sizeof(float)); o += 64) prefetch_read(a + o);
    }
    const float* mx = summaries + b * stride;
    float* o = out + b * nq;
    // Four queries share the block's centre and range (8 accumulators).
    int q = 0;
    for (; q + 4 <= nq; q += 4) score_tile<4>(p, mx, queries, q, d, o);
    for (; q + 2 <= nq; q += 2) score_tile<2>(p, mx, queries, q, d, o);
    for (; q < nq; ++q) score_tile<1>(p, mx, queries, q, d, o);
  }
}

// ---- non-finite scan: AVX2 ----

// Word: 2 or 4 bytes. 128 elements (4 or 8 vectors) per test of the accumulated compare.
template <class Word>
__attribute__((target("avx2"))) std::size_t clean_prefix_avx2(const unsigned char* p, std::size_t n,
                                                              Word exponent) noexcept {
  constexpr std::size_t kPerVector = 32 / sizeof(Word), kChunk = 128;
  const __m256i m = sizeof(Word) == 2 ? _mm256_set1_epi16(static_cast<short>(exponent))
                                      : _mm256_set1_epi32(static_cast<int>(exponent));
  std::size_t i = 0;
  for (; i + kChunk <= n; i += kChunk) {
    __m256i hit = _mm256_setzero_si256();
    for (std::size_t j = 0; j < kChunk; j += kPerVector) {
      const __m256i v =
          _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + (i + j) * sizeof(Word))), m);
      hit = _mm256_or_si256(hit, sizeof(Word) == 2 ? _mm256_cmpeq_epi16(v, m) : _mm256_cmpeq_epi32(v, m));
    }
    if (!_mm256_testz_si256(hit, hit)) break;
  }
  return i;  // every element before i is finite
}

#endif  // OASISKV_X86_KERNELS

template <class T>
void append_rows_impl(const AppendRows<T>& a) noexcept {
  const std::size_t row_bytes = static_cast<std::size_t>(a.d) * sizeof(T);
  [[maybe_unused]] const CpuFeatures f = usable_features();
  void (*fold)(float*, float*, const T*, int, bool) noexcept = fold_portable<T>;
  [[maybe_unused]] bool stream = false;
#if OASISKV_X86_KERNELS
  if (f.f16c) fold = fold_avx<T>;
  // Every head's rows are whole lines when head 0's are and the strides are whole lines.
  stream = f.avx && row_bytes % 64 == 0 && misalignment(a.host, 64) == 0 && (a.value_offset * sizeof(T)) % 64 == 0 &&
           (a.host_head_stride * sizeof(T)) % 64 == 0;
#endif
  for (int h = 0; h < a.heads; ++h) {
    float* mx = a.summary + h * a.summary_head_stride;
#if OASISKV_X86_KERNELS
    // The heads' summaries are far apart, so the next one is a cache miss: asked for now.
    if (h + 1 < a.heads) {
      const auto* p = reinterpret_cast<const char*>(mx + a.summary_head_stride);
      for (std::size_t o = 0; o < 2 * static_cast<std::size_t>(a.d) * sizeof(float); o += 64) prefetch_read(p + o);
    }
#endif
    T* host = a.host + h * a.host_head_stride;
    T* slot = a.slot != nullptr ? a.slot + h * a.slot_head_stride : nullptr;
    for (int r = 0; r < a.rows; ++r) {
      const T* key = a.key + r * a.row_stride + static_cast<std::int64_t>(h) * a.d;
      const T* value = a.value + r * a.row_stride + static_cast<std::int64_t>(h) * a.d;
      const std::int64_t at = static_cast<std::int64_t>(r) * a.d;
#if OASISKV_X86_KERNELS
      if (stream) {
        stream_avx(reinterpret_cast<char*>(host + at), reinterpret_cast<const char*>(key), row_bytes);
        stream_avx(reinterpret_cast<char*>(host + a.value_offset + at), reinterpret_cast<const char*>(value),
                   row_bytes);
      } else
#endif
      {
        std::memcpy(host + at, key, row_bytes);
        std::memcpy(host + a.value_offset + at, value, row_bytes);
      }
      if (slot != nullptr) {
        std::memcpy(slot + at, key, row_bytes);
        std::memcpy(slot + a.value_offset + at, value, row_bytes);
      }
      fold(mx, mx + a.d, key, a.d, a.reset_first && r == 0);
    }
  }
}

}  // namespace

// fold_avx is compiled for AVX + F16C (one target for the three types); a CPU with AVX and no
// F16C (2011's) takes the portable fold.
void fold_key(float* mx, float* mn, const float* key, int d, bool reset) noexcept {
#if OASISKV_X86_KERNELS
  if (usable_features().f16c) return fold_avx(mx, mn, key, d, reset);
#endif
  fold_portable(mx, mn, key, d, reset);
}

void fold_key(float* mx, float* mn, const fp16_t* key, int d, bool reset) noexcept {
#if OASISKV_X86_KERNELS
  if (usable_features().f16c) return fold_avx(mx, mn, key, d, reset);
#endif
  fold_portable(mx, mn, key, d, reset);
}

void fold_key(float* mx, float* mn, const bf16_t* key, int d, bool reset) noexcept {
#if OASISKV_X86_KERNELS
  if (usable_features().f16c) return fold_avx(mx, mn, key, d, reset);
#endif
  fold_portable(mx, mn, key, d, reset);
}

std::int64_t find_non_finite(const void* data, DType dtype, std::size_t n) noexcept {
#if OASISKV_X86_KERNELS
  if (usable_features().avx2) {
    const auto* p = static_cast<const unsigned char*>(data);
    const std::size_t width = dtype_size(dtype);
    const std::size_t clean = dtype == DType::f32   ? clean_prefix_avx2<std::uint32_t>(p, n, 0x7f800000u)
                              : dtype == DType::f16 ? clean_prefix_avx2<std::uint16_t>(p, n, 0x7c00u)
                                                    : clean_prefix_avx2<std::uint16_t>(p, n, 0x7f80u);
    const std::int64_t j = oasiskv::find_non_finite(p + clean * width, dtype, n - clean);
    return j < 0 ? -1 : j + static_cast<std::int64_t>(clean);
  }
#endif
  return oasiskv::find_non_finite(data, dtype, n);
}

void append_rows(const AppendRows<float>& a) noexcept { append_rows_impl(a); }
void append_rows(const AppendRows<fp16_t>& a) noexcept { append_rows_impl(a); }
void append_rows(const AppendRows<bf16_t>& a) noexcept { append_rows_impl(a); }

void quest_bound_blocks(const float* summaries, std::int64_t blocks, const float* queries, int num_queries, int d,
                        float* out) noexcept {
#if OASISKV_X86_KERNELS
  if (usable_features().avx) return quest_bound_blocks_avx(summaries, blocks, queries, num_queries, d, out);
#endif
  const std::int64_t stride = 2 * static_cast<std::int64_t>(d);
  for (std::int64_t b = 0; b < blocks; ++b) {
    const float* s = summaries + b * stride;
    for (int q = 0; q < num_queries; ++q) {
      out[b * num_queries + q] = quest_bound(queries + static_cast<std::int64_t>(q) * d, s, s + d, d);
    }
  }
}

void score_blocks(const ScoreParams& params, const float* summaries, std::int64_t blocks, const float* queries,
                  int num_queries, int d, float* out) noexcept {
  if (params.kind != BlockScore::spread) return quest_bound_blocks(summaries, blocks, queries, num_queries, d, out);
#if OASISKV_X86_KERNELS
  if (usable_features().avx) return spread_blocks_avx(params, summaries, blocks, queries, num_queries, d, out);
#endif
  const std::int64_t stride = 2 * static_cast<std::int64_t>(d);
  for (std::int64_t b = 0; b < blocks; ++b) {
    const float* s = summaries + b * stride;
    for (int q = 0; q < num_queries; ++q) {
      const float* qv = queries + static_cast<std::int64_t>(q) * d;
      out[b * num_queries + q] = spread_score(qv, s, s + d, d, params.half_alpha);
    }
  }
}

}  // namespace detail
}  // namespace v0
}  // namespace oasiskv
