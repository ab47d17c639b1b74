// Private to the library's sources: copies with streaming (non-temporal) stores, which write whole
// cache lines without first reading them into the cache. x86 only; weakly ordered, so a writer
// ends with store_fence() before another thread may read the destination.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_features.hpp"

#if OASISKV_X86_KERNELS
#include <immintrin.h>

namespace oasiskv {
inline namespace v0 {
namespace detail {

// Bytes until p is `align`-aligned.
inline std::size_t misalignment(const void* p, std::size_t align) noexcept {
  return (align - reinterpret_cast<std::uintptr_t>(p) % align) % align;
}

__attribute__((target("avx"))) inline void stream_avx(char* d, const char* s, std::size_t n) noexcept {
  const std::size_t head = std::min(n, misalignment(d, 64));  // then whole lines only
  std::memcpy(d, s, head);
  std::size_t i = head;
  for (; i + 64 <= n; i += 64) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 32), b);
  }
  // Upper halves cleared before non-VEX code runs (GCC emits no vzeroupper before a tail call;
  // see fold_avx in cpu_kernels.cpp for what that cost).
  _mm256_zeroupper();
  if (i < n) std::memcpy(d + i, s + i, n - i);
}

__attribute__((target("sse2"))) inline void stream_sse2(char* d, const char* s, std::size_t n) noexcept {
  const std::size_t head = std::min(n, misalignment(d, 64));
  std::memcpy(d, s, head);
  std::size_t i = head;
  for (; i + 64 <= n; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  std::memcpy(d + i, s + i, n - i);
}

__attribute__((target("sse2"))) inline void store_fence() noexcept { _mm_sfence(); }

}  // namespace detail
}  // namespace v0
}  // namespace oasiskv

#endif  // OASISKV_X86_KERNELS
