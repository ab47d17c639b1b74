// The AVX2 copy of the attention kernels (attention_kernels.hpp): CMakeLists.txt compiles this file
// with -mavx2 -mfma -mf16c on x86-64 (GCC or Clang), and attention.cpp calls it only where
// cpu_isa() is avx2 or above. Elsewhere it compiles to nothing.
#include "attention_kernels.hpp"

#if OASISKV_ATTENTION_AVX2_COPY
#define OASISKV_ATTENTION_NAMESPACE attention_avx2
#include "attention_kernels.inc"
#endif
