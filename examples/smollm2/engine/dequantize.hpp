// Dequantisation of GGML tensor blocks to float32. Weights are expanded once at load time, so the
// matrix kernels only ever see float32 (simple, and exactly what the Python reference computes).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "gguf_reader.hpp"

namespace smollm2 {

float half_to_float(std::uint16_t h);

// Dequantises `out.size()` consecutive elements starting at `data` (a tensor's data pointer).
void dequantize(std::uint32_t type, const std::byte* data, std::span<float> out);

std::vector<float> dequantize_tensor(const TensorInfo& tensor);

}  // namespace smollm2
