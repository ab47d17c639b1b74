// Weights kept as the GGUF file stores them (Q4_1, Q8_0) for the fast path: a decode step then
// streams 0.75 (Q4_1) or 1.1 (Q8_0) bytes per weight instead of fp32's 4. Activations stay fp32,
// so the fast path differs from the fp32 reference path only in the order of the sums. AVX2 + FMA
// kernels where the compiler targets them (the engine builds with -march=native), a scalar loop
// otherwise.
#pragma once

#include <cstdint>
#include <vector>

#include "gguf_reader.hpp"

namespace smollm2 {

// One matrix's blocks of 32 weights, repacked: scales (and Q4_1's minimums) as floats, quants as
// bytes. Q4_1: x = d * q + m, q in [0, 16), 16 bytes per block (low nibbles: elements 0-15, high:
// 16-31); Q8_0: x = d * q, q an int8, 32 bytes per block.
struct QuantizedRows {
  std::uint32_t type = 0;  // GgmlType::q4_1 or q8_0; 0: not quantized
  int rows = 0, cols = 0, blocks_per_row = 0;
  std::vector<float> d, m;       // [rows][blocks]
  std::vector<std::uint8_t> q;   // [rows][blocks][16 or 32]
  bool empty() const { return type == 0; }
  int quant_bytes() const;       // per block
  // Row r as floats (exactly the reference path's dequantised values).
  void dequantize_row(int r, float* out) const;
};

// Whether a tensor of this type can be kept quantized.
bool quantizable(std::uint32_t type);
QuantizedRows repack(const TensorInfo& tensor, int rows, int cols);

// y[r][o] = sum_i x[r][i] * w[o][i], like matmul() on the dequantised matrix.
void matmul_quantized(const QuantizedRows& w, const float* x, int rows, float* y);

}  // namespace smollm2
