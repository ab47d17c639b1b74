// KV element types (float, fp16, bf16), their conversions, and RowsView, the type-erased input.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <type_traits>

namespace oasiskv {
inline namespace v0 {

// IEEE-754 binary16 storage, bit-compatible with CUDA's __half. Arithmetic goes through float.
struct fp16_t {
  std::uint16_t bits = 0;
};
// bfloat16 storage (the top half of a float), bit-compatible with CUDA's __nv_bfloat16.
struct bf16_t {
  std::uint16_t bits = 0;
};
static_assert(sizeof(fp16_t) == 2 && sizeof(bf16_t) == 2);

enum class DType : std::uint8_t { f32, f16, bf16 };

constexpr std::string_view dtype_name(DType t) noexcept {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
  }
  return "unknown";
}

constexpr std::size_t dtype_size(DType t) noexcept { return t == DType::f32 ? 4 : 2; }

template <class T>
struct dtype_of;
template <>
struct dtype_of<float> : std::integral_constant<DType, DType::f32> {};
template <>
struct dtype_of<fp16_t> : std::integral_constant<DType, DType::f16> {};
template <>
struct dtype_of<bf16_t> : std::integral_constant<DType, DType::bf16> {};
template <class T>
inline constexpr DType dtype_of_v = dtype_of<T>::value;

template <class T>
concept KvElement = std::is_same_v<T, float> || std::is_same_v<T, fp16_t> || std::is_same_v<T, bf16_t>;

inline float to_float(float x) noexcept { return x; }

// Branch-free, so loops over it vectorise: exponent and mantissa shifted into place and rebiased;
// inf and NaN get the all-ones exponent (a NaN keeps its payload, quiet or signalling); zero and
// subnormals are mantissa x 2^-24, computed exactly as (2^-14 + mantissa x 2^-24) - 2^-14 (every
// operand and the result are normal floats, so flush-to-zero modes do not change it).
inline float to_float(fp16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h.bits & 0x8000u) << 16;
  const std::uint32_t em = static_cast<std::uint32_t>(h.bits & 0x7fffu) << 13;
  const std::uint32_t exp = em & 0x0f800000u;
  std::uint32_t bits = em + 0x38000000u;        // exponent + (127 - 15)
  if (exp == 0x0f800000u) bits += 0x38000000u;  // inf / NaN: exponent 0xff
  float f = std::bit_cast<float>(bits);
  if (exp == 0) f = std::bit_cast<float>(bits + 0x00800000u) - std::bit_cast<float>(0x38800000u);
  return std::bit_cast<float>(std::bit_cast<std::uint32_t>(f) | sign);
}

inline float to_float(bf16_t b) noexcept { return std::bit_cast<float>(static_cast<std::uint32_t>(b.bits) << 16); }

// Round to nearest even, as CUDA's __float2half_rn.
inline fp16_t to_fp16(float f) noexcept {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  const std::uint16_t sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  const std::uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or NaN
    return {static_cast<std::uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u))};
  }
  if (abs >= 0x477ff000u) return {static_cast<std::uint16_t>(sign | 0x7c00u)};  // rounds to inf
  if (abs < 0x38800000u) {                 // below the smallest normal half: subnormal or zero
    if (abs < 0x33000000u) return {sign};  // below half the smallest subnormal
    const std::uint32_t e = abs >> 23;
    const std::uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126u - e;  // 14 + (113 - e) - 1 ... aligns to 2^-24 units
    const std::uint32_t q = mant >> shift;
    const std::uint32_t rem = mant & ((1u << shift) - 1u);
    const std::uint32_t half = 1u << (shift - 1u);
    std::uint32_t r = q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
    return {static_cast<std::uint16_t>(sign | r)};
  }
  const std::uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
  return {static_cast<std::uint16_t>(sign | ((rounded - 0x38000000u) >> 13))};
}

// Round to nearest even, as CUDA's __float2bfloat16_rn.
inline bf16_t to_bf16(float f) noexcept {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return {static_cast<std::uint16_t>((x >> 16) | 0x40u)};
  return {static_cast<std::uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16)};
}

template <class T>
T from_float(float f) noexcept {
  if constexpr (std::is_same_v<T, float>) {
    return f;
  } else if constexpr (std::is_same_v<T, fp16_t>) {
    return to_fp16(f);
  } else {
    return to_bf16(f);
  }
}

// A type-erased, contiguous block of rows, each [heads][head_dim] as the receiving call expects.
// Engines hold tensors of run-time dtype; the cache checks the dtype and the row count.
struct RowsView {
  const void* data = nullptr;
  DType dtype = DType::f32;
  std::int64_t rows = 0;
};

template <KvElement T>
RowsView rows_view(const T* data, std::int64_t rows) noexcept {
  return RowsView{data, dtype_of_v<T>, rows};
}

// Reads element i of a RowsView as float, whatever its dtype.
inline float load_as_float(const void* data, DType dtype, std::size_t i) noexcept {
  switch (dtype) {
    case DType::f32: return static_cast<const float*>(data)[i];
    case DType::f16: return to_float(static_cast<const fp16_t*>(data)[i]);
    case DType::bf16: return to_float(static_cast<const bf16_t*>(data)[i]);
  }
  return 0.0f;
}

// Index of the first NaN or infinity among n elements, or -1. Tests the exponent bits, so it
// costs a load and a compare per element whatever the dtype; chunks without an early exit
// vectorise, and the chunk that holds a hit is searched again element by element.
inline std::int64_t find_non_finite(const void* data, DType dtype, std::size_t n) noexcept {
  auto scan = [&](auto word, auto exponent) -> std::int64_t {
    using Word = decltype(word);
    const auto* p = static_cast<const unsigned char*>(data);
    const auto at = [p](std::size_t i) {
      Word w;
      std::memcpy(&w, p + i * sizeof(Word), sizeof(Word));
      return w;
    };
    constexpr std::size_t kChunk = 64;
    std::size_t i = 0;
    for (; i + kChunk <= n; i += kChunk) {
      Word any = 0;
      for (std::size_t j = 0; j < kChunk; ++j) any |= static_cast<Word>((at(i + j) & exponent) == exponent);
      if (any != 0) break;
    }
    for (; i < n; ++i) {
      if ((at(i) & exponent) == exponent) return static_cast<std::int64_t>(i);
    }
    return -1;
  };
  switch (dtype) {
    case DType::f32: return scan(std::uint32_t{}, std::uint32_t{0x7f800000u});
    case DType::f16: return scan(std::uint16_t{}, std::uint16_t{0x7c00u});
    case DType::bf16: return scan(std::uint16_t{}, std::uint16_t{0x7f80u});
  }
  return -1;
}

}  // namespace v0
}  // namespace oasiskv
