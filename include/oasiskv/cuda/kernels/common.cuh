// Device code shared by the CUDA backend's kernels (nvcc only): element conversions, the CPU's
// max/min, a block-wide sum, and the metadata upload kernel.
//
// Bit-identity with the CPU backend: float arithmetic uses the explicitly rounded intrinsics
// (__fmul_rn, __fadd_rn, __fdiv_rn) so nvcc cannot contract a*b+c into an FMA, and max/min are
// written as std::max/std::min are defined ((a < b) ? b : a), in the same order as the CPU loops.
//
// Kernels that are not templates anyway are `template <int = 0>`: a template is defined in every
// including translation unit without ODR clashes, so engines may include these headers.
#pragma once

#if !defined(__CUDACC__)
#error "oasiskv/cuda/kernels/*.cuh is device code: compile it with nvcc (include oasiskv/cuda/ops.hpp from host code)"
#endif

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "oasiskv/config.hpp"
#include "oasiskv/cuda/ops.hpp"
#include "oasiskv/dtype.hpp"

namespace oasiskv {
inline namespace v0 {
namespace gpu {
namespace kernels {

// ---- element conversions (exact: fp16 and bf16 widen to float without rounding) ----------------

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(fp16_t x) { return __half2float(__ushort_as_half(x.bits)); }
__device__ __forceinline__ float to_f(bf16_t x) { return __uint_as_float(static_cast<unsigned>(x.bits) << 16); }

__device__ __forceinline__ float fmax_cpu(float a, float b) { return (a < b) ? b : a; }  // std::max
__device__ __forceinline__ float fmin_cpu(float a, float b) { return (b < a) ? b : a; }  // std::min

// Sum over the thread block (blockDim.x a multiple of 32, at most 1024); every thread gets the
// total. `shared` holds 32 values; the call begins with a barrier, so it may be reused at once.
template <class V>
__device__ __forceinline__ V block_sum(V x, V* shared) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_down_sync(0xffffffffu, x, o);
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  __syncthreads();
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  V total = 0;
  for (int w = 0; w < static_cast<int>(blockDim.x) / 32; ++w) total += shared[w];
  return total;
}

// One thread block: w.dst[0, w.count) = w.words (the words travel in the kernel's parameters).
template <int = 0>
__global__ void upload_words_kernel(WordBlock w) {
  for (int i = static_cast<int>(threadIdx.x); i < w.count; i += static_cast<int>(blockDim.x)) w.dst[i] = w.words[i];
}

// Max over the thread block; every thread gets it. `shared` holds 32 values; begins with a barrier.
__device__ __forceinline__ float block_max(float x, float* shared) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_down_sync(0xffffffffu, x, o));
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  __syncthreads();
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  float top = -INFINITY;
  for (int w = 0; w < static_cast<int>(blockDim.x) / 32; ++w) top = fmaxf(top, shared[w]);
  return top;
}

}  // namespace kernels
}  // namespace gpu
}  // namespace v0
}  // namespace oasiskv
