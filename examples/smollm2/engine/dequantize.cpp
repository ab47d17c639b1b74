#include "dequantize.hpp"

#include <cstring>
#include <stdexcept>
#include <string>

namespace smollm2 {
namespace {

constexpr std::size_t kBlock = 32;  // elements per block in Q4_0, Q4_1 and Q8_0

std::uint16_t load_u16(const std::byte* p) {
  std::uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

}  // namespace

float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t exponent = (h >> 10) & 0x1Fu;
  std::uint32_t mantissa = h & 0x3FFu;
  std::uint32_t bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exponent = 127 - 15 + 1;
      while ((mantissa & 0x400u) == 0) {
        mantissa <<= 1;
        --exponent;
      }
      bits = sign | (exponent << 23) | ((mantissa & 0x3FFu) << 13);
    }
  } else if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

void dequantize(std::uint32_t type, const std::byte* data, std::span<float> out) {
  const std::size_t n = out.size();
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::f32:
      std::memcpy(out.data(), data, n * 4);
      return;
    case GgmlType::f16:
      for (std::size_t i = 0; i < n; ++i) out[i] = half_to_float(load_u16(data + 2 * i));
      return;
    default:
      break;
  }
  if (n % kBlock != 0) throw std::runtime_error("quantised tensor size not a multiple of 32");
  for (std::size_t b = 0; b < n / kBlock; ++b) {
    float* y = out.data() + b * kBlock;
    switch (static_cast<GgmlType>(type)) {
      case GgmlType::q4_0: {  // {f16 d; u8 qs[16]}: x = d * (q - 8); low nibbles first half
        const std::byte* blk = data + b * 18;
        const float d = half_to_float(load_u16(blk));
        for (std::size_t j = 0; j < 16; ++j) {
          auto q = static_cast<std::uint8_t>(blk[2 + j]);
          y[j] = d * static_cast<float>((q & 0x0F) - 8);
          y[j + 16] = d * static_cast<float>((q >> 4) - 8);
        }
        break;
      }
      case GgmlType::q4_1: {  // {f16 d; f16 m; u8 qs[16]}: x = d * q + m
        const std::byte* blk = data + b * 20;
        const float d = half_to_float(load_u16(blk));
        const float m = half_to_float(load_u16(blk + 2));
        for (std::size_t j = 0; j < 16; ++j) {
          auto q = static_cast<std::uint8_t>(blk[4 + j]);
          y[j] = d * static_cast<float>(q & 0x0F) + m;
          y[j + 16] = d * static_cast<float>(q >> 4) + m;
        }
        break;
      }
      case GgmlType::q8_0: {  // {f16 d; i8 qs[32]}: x = d * q
        const std::byte* blk = data + b * 34;
        const float d = half_to_float(load_u16(blk));
        for (std::size_t j = 0; j < kBlock; ++j)
          y[j] = d * static_cast<float>(static_cast<std::int8_t>(blk[2 + j]));
        break;
      }
      default:
        throw std::runtime_error(std::string("cannot dequantise tensor type ") + ggml_type_name(type));
    }
  }
}

std::vector<float> dequantize_tensor(const TensorInfo& tensor) {
  std::vector<float> out(static_cast<std::size_t>(tensor.elements()));
  try {
    dequantize(tensor.type, tensor.data, out);
  } catch (const std::exception& e) {
    throw std::runtime_error("tensor '" + tensor.name + "': " + e.what());
  }
  return out;
}

}  // namespace smollm2
