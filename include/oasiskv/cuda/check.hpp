// CUDA error checking for the CUDA backend. Every CUDA runtime call goes through
// OASISKV_CUDA_CHECK; a failure becomes an oasiskv::Error that carries the CUDA error's name.
//
// Host-only: compiles with g++ (tests, host code) and nvcc. No fmt here: the message is
// formatted in cuda/runtime.cpp.
#pragma once

#include <string>

#include <cuda_runtime_api.h>

namespace oasiskv {
inline namespace v0 {
namespace gpu {

// Throws oasiskv::Error: "<call> failed: <cudaGetErrorName> (<cudaGetErrorString>) [file:line]".
// Clears a non-sticky error first (cudaGetLastError), so that later calls start clean.
[[noreturn]] void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line);

// Throws oasiskv::Error(what). For nvcc translation units, which must not include
// oasiskv/error.hpp: fmt 9.1's headers do not compile under nvcc 13 in C++20 mode.
[[noreturn]] void throw_error(const std::string& what);

inline void check(cudaError_t err, const char* call, const char* file, int line) {
  if (err != cudaSuccess) throw_cuda_error(err, call, file, line);
}

// True when the CUDA runtime sees at least one device. Never throws, clears the error state.
bool device_available() noexcept;
// Number of devices (0 without a driver or GPU). Never throws.
int device_count() noexcept;

}  // namespace gpu
}  // namespace v0
}  // namespace oasiskv

#define OASISKV_CUDA_CHECK(expr) ::oasiskv::gpu::check((expr), #expr, __FILE__, __LINE__)
// After a kernel launch: reports launch-configuration errors (no synchronisation).
#define OASISKV_CUDA_CHECK_LAUNCH(what) ::oasiskv::gpu::check(cudaGetLastError(), what, __FILE__, __LINE__)
