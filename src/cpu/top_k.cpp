// detail::select_top_k: LookaheadSelector::top_k's selection. ScoreOrder (higher score first, ties
// to the lower position, NaN below every number, -0 == +0) is a total order on (score, position),
// so the k best in order are one answer however they are found. Both paths here rank 64-bit keys
// (order key of the score << 32 | position: the CUDA top-K's order key, top_k.cuh), so a plain
// integer compare is the whole rule:
// - large n, small k: a threshold t from a strided sample of the scores; one pass keeps the
//   positions with score >= t (a NaN never passes), and when at least k pass they hold the k
//   best (everything left out ranks below every candidate); the candidates are ranked. A
//   threshold that lets too few or too many through (ties, NaNs) is retried, then the full path;
// - otherwise (or as the fallback): every key, nth_element, sort of the k best.
#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>

#include "cpu_features.hpp"
#include "oasiskv/cpu/detail/cpu_kernels.hpp"

#if OASISKV_X86_KERNELS && defined(__SSE2__)
#include <emmintrin.h>
#define OASISKV_TOPK_SSE2 1
#else
#define OASISKV_TOPK_SSE2 0
#endif

namespace oasiskv {
inline namespace v0 {
namespace detail {
namespace {

// Smaller = better, as top_k.cuh's order_key: NaN (any sign or payload) is the worst key, both
// zeros map to +0.0's key, and the rest ascend as the scores descend.
std::uint32_t order_key(float f) noexcept {
  std::uint32_t b = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t abs = b & 0x7fffffffu;
  if (abs > 0x7f800000u) return 0xffffffffu;
  if (abs == 0) b = 0;
  b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);  // ascending with the score
  return ~b;
}

// The score whose order key is `key` (not NaN's): order_key inverted.
float score_of_key(std::uint32_t key) noexcept {
  const std::uint32_t ascending = ~key;
  return std::bit_cast<float>((ascending & 0x80000000u) ? (ascending & 0x7fffffffu) : ~ascending);
}

std::uint64_t full_key(float score, std::size_t position) noexcept {
  return (static_cast<std::uint64_t>(order_key(score)) << 32) | static_cast<std::uint64_t>(position);
}

// The kk best of keys[0, n) (n >= kk), in order, as positions.
void rank(std::uint64_t* keys, std::size_t n, std::size_t kk, std::vector<std::int32_t>& out) {
  if (kk < n) std::nth_element(keys, keys + kk, keys + n);
  std::sort(keys, keys + kk);
  out.resize(kk);
  for (std::size_t i = 0; i < kk; ++i) out[i] = static_cast<std::int32_t>(keys[i] & 0xffffffffu);
}

void select_all(std::span<const float> scores, std::size_t kk, std::vector<std::int32_t>& out) {
  std::vector<std::uint64_t> keys(scores.size());
  for (std::size_t i = 0; i < scores.size(); ++i) keys[i] = full_key(scores[i], i);
  rank(keys.data(), keys.size(), kk, out);
}

constexpr std::size_t kSample = 128;          // scores sampled for the threshold
constexpr std::size_t kMaxCandidates = 1024;  // more pass the threshold: the full path
constexpr std::size_t kNoRoom = kMaxCandidates + 1;

// Positions with score >= t (ordered compare: NaN fails) into cand, in order; kNoRoom when more
// than kMaxCandidates pass.
std::size_t filter(const float* s, std::size_t n, float t, std::uint32_t* cand, bool sse2) noexcept {
  std::size_t i = 0, c = 0;
#if OASISKV_TOPK_SSE2
  if (sse2) {
    const __m128 vt = _mm_set1_ps(t);
    for (; i + 8 <= n; i += 8) {
      auto m = static_cast<unsigned>(_mm_movemask_ps(_mm_cmpge_ps(_mm_loadu_ps(s + i), vt)) |
                                     (_mm_movemask_ps(_mm_cmpge_ps(_mm_loadu_ps(s + i + 4), vt)) << 4));
      while (m != 0) {
        if (c == kMaxCandidates) return kNoRoom;
        cand[c++] = static_cast<std::uint32_t>(i + static_cast<std::size_t>(std::countr_zero(m)));
        m &= m - 1;
      }
    }
  }
#else
  (void)sse2;
#endif
  for (; i < n; ++i) {
    if (s[i] >= t) {
      if (c == kMaxCandidates) return kNoRoom;
      cand[c++] = static_cast<std::uint32_t>(i);
    }
  }
  return c;
}

// The threshold path; false: no threshold found (the caller takes the full path).
bool select_sampled(std::span<const float> scores, std::size_t kk, std::vector<std::int32_t>& out) {
  const std::size_t n = scores.size();
  std::uint32_t sample[kSample];
  for (std::size_t j = 0; j < kSample; ++j) sample[j] = order_key(scores[j * n / kSample]);
  // About 1.5x the expected sample rank of the k-th best, so that k pass in most draws.
  std::size_t r = std::min(kSample - 1, kk * kSample * 3 / (2 * n) + 4);
  const bool sse2 = usable_features().sse2;
  std::uint32_t cand[kMaxCandidates];
  for (;;) {
    std::nth_element(sample, sample + r, sample + kSample);
    if (sample[r] == 0xffffffffu) return false;  // NaN at the threshold
    const std::size_t c = filter(scores.data(), n, score_of_key(sample[r]), cand, sse2);
    if (c == kNoRoom) return false;
    if (c >= kk) {
      std::uint64_t keys[kMaxCandidates];
      for (std::size_t i = 0; i < c; ++i) keys[i] = full_key(scores[cand[i]], cand[i]);
      rank(keys, c, kk, out);
      return true;
    }
    if (r == kSample - 1) return false;
    r = std::min(kSample - 1, 2 * r + 4);  // too few passed: a lower threshold
  }
}

}  // namespace

void select_top_k(std::span<const float> scores, int k, std::vector<std::int32_t>& out) {
  const std::size_t n = scores.size();
  const std::size_t kk = std::min<std::size_t>(static_cast<std::size_t>(std::max(k, 0)), n);
  out.clear();
  if (kk == 0) return;
  // The sample pays off where n is large and k a small part of it: from n = 256 and k <= n / 4
  // (measured: n 500, k 59, SmolLM2's 8K context at budget 1,024: 2.8 us a call against 5.3).
  if (n >= 2 * kSample && kk * 4 <= n && kk <= kMaxCandidates / 2 && select_sampled(scores, kk, out)) return;
  select_all(scores, kk, out);
}

}  // namespace detail
}  // namespace v0
}  // namespace oasiskv
