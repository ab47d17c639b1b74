// One level's IsaKernels table (isa_kernels.hpp), compiled once per level with the level's flags.
// Constant-initialised: valid before any static initialiser runs.
#include "isa_kernels.hpp"

namespace smollm2::SMOLLM2_ISA_NAMESPACE {

const IsaKernels kernels{
    .level = static_cast<oasiskv::CpuIsa>(SMOLLM2_ISA_LEVEL),
    .dot = &dot,
    .dot4 = &dot4,
    .matmul_fp32 = &matmul_fp32,
    .quantize_activations = &quantize_activation_rows,
    .matmul_int8 = &matmul_int8,
    .matmul_fp32_activations = &matmul_fp32_activations,
};

}  // namespace smollm2::SMOLLM2_ISA_NAMESPACE
