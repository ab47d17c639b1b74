// LayerView.attention's kernel for CPUs with AVX2 and FMA (view_attention.hpp); CMake compiles this
// file with -mavx2 -mfma on x86-64, and view_attention.cpp calls it only at the library's level avx2
// or above (the CPU has both, and OASISKV_CPU_ISA does not cap it lower).
#include "view_attention.hpp"

#define OASISKV_VIEW_ATTENTION_KERNEL view_attention_avx2
#include "view_attention_kernel.inc"
