// QuantizedRows (quantized_matmul.hpp): the weights repacked from the GGUF file's blocks, and a
// row dequantised. The products over them are in quantized_matmul.cpp, compiled per level.
#include <cstring>
#include <stdexcept>
#include <string>

#include "dequantize.hpp"
#include "quantized_matmul.hpp"

namespace smollm2 {
namespace {

constexpr int kBlock = 32;

std::uint16_t load_u16(const std::byte* p) {
  std::uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
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
  if (q4) w.m.assign(w.min_slots(), 0.0f);
  w.q.resize(blocks * static_cast<std::size_t>(w.quant_bytes()));
  for (std::size_t b = 0; b < blocks; ++b) {
    const std::byte* blk = t.data + b * in_bytes;
    w.d[b] = half_to_float(load_u16(blk));
    if (q4) {
      const auto bpr = static_cast<std::size_t>(w.blocks_per_row);
      w.m[w.min_index(static_cast<int>(b / bpr), static_cast<int>(b % bpr))] = half_to_float(load_u16(blk + 2));
    }
    std::memcpy(w.q.data() + b * static_cast<std::size_t>(w.quant_bytes()), blk + (q4 ? 4 : 2),
                static_cast<std::size_t>(w.quant_bytes()));
  }
  return w;
}

std::size_t QuantizedRows::min_slots() const {
  return (static_cast<std::size_t>(rows) + 15) / 16 * 16 * static_cast<std::size_t>(blocks_per_row);
}

std::size_t QuantizedRows::min_index(int r, int b) const {
  const auto g = static_cast<std::size_t>(r / 16);
  return (g * static_cast<std::size_t>(blocks_per_row) + static_cast<std::size_t>(b)) * 16 + static_cast<std::size_t>(r % 16);
}

void QuantizedRows::dequantize_row(int r, float* out) const {
  const std::size_t b0 = static_cast<std::size_t>(r) * static_cast<std::size_t>(blocks_per_row);
  const bool q4 = type == static_cast<std::uint32_t>(GgmlType::q4_1);
  for (int b = 0; b < blocks_per_row; ++b) {
    const std::uint8_t* qb = q.data() + (b0 + static_cast<std::size_t>(b)) * static_cast<std::size_t>(quant_bytes());
    const float db = d[b0 + static_cast<std::size_t>(b)];
    float* y = out + kBlock * b;
    if (q4) {
      const float mb = m[min_index(r, b)];
      for (int j = 0; j < 16; ++j) {
        y[j] = db * static_cast<float>(qb[j] & 0x0F) + mb;
        y[j + 16] = db * static_cast<float>(qb[j] >> 4) + mb;
      }
    } else {
      for (int j = 0; j < kBlock; ++j) y[j] = db * static_cast<float>(static_cast<std::int8_t>(qb[j]));
    }
  }
}

}  // namespace smollm2
