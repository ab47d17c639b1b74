// Checked size arithmetic: a product or sum that would overflow throws oasiskv::Error naming
// the quantity, instead of wrapping (a wrapped layout lets sequences overwrite each other).
#pragma once

#include <cstdint>
#include <limits>

#include "oasiskv/error.hpp"

namespace oasiskv {
inline namespace v0 {
namespace detail {

// a * b for non-negative a and b, or an Error "<what>: a x b overflows".
inline std::int64_t checked_mul(std::int64_t a, std::int64_t b, const char* what) {
  std::int64_t r = 0;
  if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &r)) {
    fail("{}: {} x {} does not fit in 64 bits", what, a, b);
  }
  return r;
}

inline std::int64_t checked_add(std::int64_t a, std::int64_t b, const char* what) {
  std::int64_t r = 0;
  if (__builtin_add_overflow(a, b, &r)) fail("{}: {} + {} does not fit in 64 bits", what, a, b);
  return r;
}

// The product of every factor, checked; `what` names the quantity.
template <class... I>
std::int64_t checked_product(const char* what, std::int64_t first, I... rest) {
  std::int64_t r = first;
  ((r = checked_mul(r, static_cast<std::int64_t>(rest), what)), ...);
  return r;
}

// Bytes of n elements of `size` bytes, as size_t.
inline std::size_t checked_bytes(std::int64_t n, std::size_t size, const char* what) {
  return static_cast<std::size_t>(checked_mul(n, static_cast<std::int64_t>(size), what));
}

}  // namespace detail
}  // namespace v0
}  // namespace oasiskv
