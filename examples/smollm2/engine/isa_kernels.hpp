// The engine's hot loops, compiled once per instruction-set level and chosen at run time, as the
// library chooses its own (oasiskv/cpu/isa.hpp: scalar, avx2, avx512, capped by OASISKV_CPU_ISA).
// So one build runs, and tests, every level the CPU supports, and a figure measured on an AVX-512
// machine can be told from the CPU or from its instructions by rerunning it at avx2.
//
// Each level's translation units (CMakeLists.txt: SMOLLM2_ISA_SOURCES, compiled with that level's
// flags and SMOLLM2_ISA=<level>) define their functions in namespace smollm2::isa_<level> and fill
// one IsaKernels table; the engine's public entry points (dot, matmul, matmul_quantized, ...) call
// the table of the level in use. (Attention is the library's, oasiskv/cpu/attention.hpp, which
// chooses its own copy at the same level.) What the levels promise of each other:
//   - avx2 and avx512 give the same bits, everywhere: the int8 products' AVX-512 loop folds two
//     blocks per instruction in the order the AVX2 loop folds one, the Q4_1 minimum terms round as
//     the AVX-512 loop does, and the rest is the same code (tests/model/test_isa_levels.cpp
//     compares them bit for bit, on random inputs and on the model).
//   - scalar is the portable reference: no FMA, sums in another order, an exact std::exp. Its
//     values agree with the others' to float rounding (fp32 activations) or to the error of 8-bit
//     activations (int8), not bit for bit.
#pragma once

#include <cstdint>

#include <oasiskv/cpu/isa.hpp>

#include "quantized_matmul.hpp"

namespace smollm2 {

// One level's kernels. The public functions of the same names (llama_model.hpp,
// quantized_matmul.hpp) say what each computes.
struct IsaKernels {
  oasiskv::CpuIsa level = oasiskv::CpuIsa::scalar;
  float (*dot)(const float* a, const float* b, int n) = nullptr;
  void (*dot4)(const float* w, const float* x0, const float* x1, const float* x2, const float* x3, int n,
               float* out) = nullptr;
  // The fp32 weight path: y[r][o] = sum_i x[r][i] * w[o * in + i] for o < out, r < rows.
  void (*matmul_fp32)(const float* w, int out, int in, const float* x, int rows, float* y) = nullptr;
  void (*quantize_activations)(const float* x, int rows, int cols, ActivationBlocks& out) = nullptr;
  void (*matmul_int8)(const QuantizedRows& w, const ActivationBlocks& x, float* y) = nullptr;
  void (*matmul_fp32_activations)(const QuantizedRows& w, const float* x, int rows, float* y) = nullptr;
};

// The kernels of the level in use (oasiskv::cpu_isa(), settled once). Throws oasiskv::Error where
// OASISKV_CPU_ISA names no level or one this CPU lacks.
const IsaKernels& isa_kernels();

// The kernels of `level`, or null where this build has no such level (not x86) or the CPU cannot
// run it. Tests compare the levels with it.
const IsaKernels* isa_kernels_at(oasiskv::CpuIsa level);

// Tests: the engine's kernels run at `level` from now on (the library's stay at the level in use).
// Throws oasiskv::Error where isa_kernels_at(level) is null. Not while kernels run.
void set_isa_level_for_testing(oasiskv::CpuIsa level);

}  // namespace smollm2

// Inside one level's translation units: that level's functions, under names the public ones do
// not take (argument-dependent lookup would otherwise find both), and its table.
#ifdef SMOLLM2_ISA
#define SMOLLM2_ISA_PASTE_(level) isa_##level
#define SMOLLM2_ISA_PASTE(level) SMOLLM2_ISA_PASTE_(level)
#define SMOLLM2_ISA_NAMESPACE SMOLLM2_ISA_PASTE(SMOLLM2_ISA)
namespace smollm2::SMOLLM2_ISA_NAMESPACE {
float dot(const float* a, const float* b, int n);
void dot4(const float* w, const float* x0, const float* x1, const float* x2, const float* x3, int n, float* out);
void matmul_fp32(const float* w, int out, int in, const float* x, int rows, float* y);
void quantize_activation_rows(const float* x, int rows, int cols, ActivationBlocks& out);
void matmul_int8(const QuantizedRows& w, const ActivationBlocks& x, float* y);
void matmul_fp32_activations(const QuantizedRows& w, const float* x, int rows, float* y);
extern const IsaKernels kernels;
}  // namespace smollm2::SMOLLM2_ISA_NAMESPACE
#endif
