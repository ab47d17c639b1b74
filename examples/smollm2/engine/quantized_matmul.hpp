// Weights kept as the GGUF file stores them (Q4_1, Q8_0) for the fast path: a decode step then
// streams 0.63 (Q4_1) or 1.06 (Q8_0) bytes per weight instead of fp32's 4. Activations are
// quantized per block of 32 to int8 (as llama.cpp does: Q8_1 against Q4_1), so the dot products
// are integer multiply-adds. The products run at the level in use (isa_kernels.hpp): AVX2 kernels
// at avx2, AVX-512 VNNI ones at avx512 (the same bits), scalar loops at scalar; output rows split
// over the engine's threads (thread_pool.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "gguf_reader.hpp"

namespace smollm2 {

// One matrix's blocks of 32 weights, repacked: scales (and Q4_1's minimums) as floats, quants as
// bytes. Q4_1: x = d * q + m, q in [0, 16), 16 bytes per block (low nibbles: elements 0-15, high:
// 16-31); Q8_0: x = d * q, q an int8, 32 bytes per block.
//
// Q4_1's minimums are stored sixteen rows side by side, m[((r / 16) * blocks + b) * 16 + r % 16]
// (the last group padded with zeros): a product then sums sixteen rows' minimum terms in one
// vector multiply-add per block and activation row, where one row at a time cost as many scalar
// multiply-adds as blocks, a quarter of a decode step's per-row work.
struct QuantizedRows {
  std::uint32_t type = 0;  // GgmlType::q4_1 or q8_0; 0: not quantized
  bool int8_activations = true;  // how matmul_quantized(w, float x...) takes x
  int rows = 0, cols = 0, blocks_per_row = 0;
  std::vector<float> d;          // [rows][blocks]
  std::vector<float> m;          // Q4_1: [(rows + 15) / 16][blocks][16], see above; q8_0: empty
  std::vector<std::uint8_t> q;   // [rows][blocks][16 or 32]
  bool empty() const { return type == 0; }
  int quant_bytes() const;       // per block
  // The size of m for this shape, and where row r's block b sits in it.
  std::size_t min_slots() const;
  std::size_t min_index(int r, int b) const;
  // Row r as floats (exactly the reference path's dequantised values).
  void dequantize_row(int r, float* out) const;
};

// Whether a tensor of this type can be kept quantized.
bool quantizable(std::uint32_t type);
QuantizedRows repack(const TensorInfo& tensor, int rows, int cols);

// Activation rows quantized per block of 32: x ~ d * q, q int8; s = d * sum(q) per block.
struct ActivationBlocks {
  int rows = 0, cols = 0;
  std::vector<std::int8_t> q;  // [rows][cols]
  std::vector<float> d, s;     // [rows][cols / 32]
};
void quantize_activations(const float* x, int rows, int cols, ActivationBlocks& out);

// y[r][o] = sum_i x[r][i] * w[o][i], like matmul() on the dequantised matrix, with x quantized.
void matmul_quantized(const QuantizedRows& w, const ActivationBlocks& x, float* y);
void matmul_quantized(const QuantizedRows& w, const float* x, int rows, float* y);

}  // namespace smollm2
