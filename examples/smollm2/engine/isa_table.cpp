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
    .attend_rows_f32 = &fold_rows<float>,
    .attend_rows_f16 = &fold_rows<oasiskv::fp16_t>,
    .attend_query_row_f32 = &attend_one_row<float>,
    .attend_query_row_f16 = &attend_one_row<oasiskv::fp16_t>,
    .attend_causal_f32 = &attend_causal_rows<float>,
    .attend_causal_f16 = &attend_causal_rows<oasiskv::fp16_t>,
};

}  // namespace smollm2::SMOLLM2_ISA_NAMESPACE
