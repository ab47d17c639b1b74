// The AVX-512 copy of the attention kernels (attention_kernels.hpp): CMakeLists.txt compiles this
// file with -mavx512f -mavx512bw -mavx512dq -mavx512vl (and AVX2's flags) on x86-64 (GCC or
// Clang), and attention.cpp calls it only where cpu_isa() is avx512. Elsewhere it compiles to
// nothing.
#include "attention_kernels.hpp"

#if OASISKV_ATTENTION_AVX2_COPY
#define OASISKV_ATTENTION_NAMESPACE attention_avx512
#include "attention_kernels.inc"
#endif
