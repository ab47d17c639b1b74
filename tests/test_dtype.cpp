#include <cmath>
#include <cstring>

#include "support.hpp"

using namespace oasiskv;

namespace {
bool is_nan_fp16(std::uint16_t b) { return (b & 0x7c00u) == 0x7c00u && (b & 0x3ffu) != 0; }

// The nearest fp16 by search over neighbours of the candidate, ties to even mantissa.
template <class T, class ToFloat>
void check_nearest(float f, T got, ToFloat to_f, std::uint16_t max_finite_bits) {
  const float g = to_f(got);
  INFO("f = " << f << " got bits " << got.bits << " = " << g);
  if (std::isinf(g)) {
    T mx{max_finite_bits};
    CHECK(std::fabs(f) >= std::fabs(to_f(mx)));
    return;
  }
  for (int delta : {-1, 1}) {
    T n{static_cast<std::uint16_t>(got.bits + delta)};
    const float nf = to_f(n);
    if (std::isnan(nf) || std::isinf(nf) || ((n.bits ^ got.bits) & 0x8000u)) continue;
    const double e_got = std::fabs(static_cast<double>(f) - g);
    const double e_n = std::fabs(static_cast<double>(f) - nf);
    CHECK(e_got <= e_n);
    if (e_got == e_n) CHECK((got.bits & 1u) == 0u);
  }
}
}  // namespace

TEST_CASE("fp16: every bit pattern survives float and back") {
  for (std::uint32_t b = 0; b < 0x10000u; ++b) {
    const fp16_t h{static_cast<std::uint16_t>(b)};
    const float f = to_float(h);
    if (is_nan_fp16(h.bits)) {
      CHECK(std::isnan(f));
      CHECK(is_nan_fp16(to_fp16(f).bits));
    } else {
      REQUIRE(to_fp16(f).bits == h.bits);
    }
  }
}

TEST_CASE("fp16 and bf16: random floats round to the nearest value, ties to even") {
  OASISKV_SEEDED_RNG(rng);
  std::uniform_int_distribution<std::uint32_t> bits;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int i = 0; i < 20000; ++i) {
    float f = i % 2 == 0 ? normal(rng) * std::exp2(static_cast<float>(i % 40 - 26)) : 0.0f;
    if (i % 2 == 1) {
      const std::uint32_t u = bits(rng);
      std::memcpy(&f, &u, 4);
      if (!std::isfinite(f)) continue;
    }
    check_nearest(f, to_fp16(f), [](fp16_t h) { return to_float(h); }, 0x7bffu);
    check_nearest(f, to_bf16(f), [](bf16_t h) { return to_float(h); }, 0x7f7fu);
  }
}

TEST_CASE("bf16: exact values are kept, NaN stays NaN, infinities stay") {
  for (std::uint32_t b = 0; b < 0x10000u; ++b) {
    const bf16_t h{static_cast<std::uint16_t>(b)};
    const float f = to_float(h);
    if (std::isnan(f)) {
      CHECK(std::isnan(to_float(to_bf16(f))));
    } else {
      REQUIRE(to_bf16(f).bits == h.bits);
    }
  }
  CHECK(std::isinf(to_float(to_fp16(1e6f))));
  CHECK(to_fp16(-0.0f).bits == 0x8000u);
}

TEST_CASE("find_non_finite finds the first NaN or infinity in every dtype") {
  OASISKV_SEEDED_RNG(rng);
  for (int trial = 0; trial < 200; ++trial) {
    const std::size_t n = std::uniform_int_distribution<std::size_t>(1, 300)(rng);
    std::vector<float> f(n);
    for (auto& x : f) x = std::normal_distribution<float>(0.0f, 1e4f)(rng);
    std::int64_t expected = -1;
    if (trial % 3 != 0) {
      expected = std::uniform_int_distribution<std::int64_t>(0, static_cast<std::int64_t>(n) - 1)(rng);
      f[static_cast<std::size_t>(expected)] = trial % 2 ? NAN : -INFINITY;
    }
    std::vector<fp16_t> h(n);
    std::vector<bf16_t> b(n);
    for (std::size_t i = 0; i < n; ++i) {
      h[i] = to_fp16(std::fmod(f[i], 60000.0f));
      b[i] = to_bf16(f[i]);
      if (static_cast<std::int64_t>(i) == expected) h[i] = to_fp16(f[i]);
    }
    CHECK(find_non_finite(f.data(), DType::f32, n) == expected);
    CHECK(find_non_finite(h.data(), DType::f16, n) == expected);
    CHECK(find_non_finite(b.data(), DType::bf16, n) == expected);
  }
}
