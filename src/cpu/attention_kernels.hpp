// Private to the library's sources: the tiled attention kernels of oasiskv/cpu/attention.hpp, one
// copy per instruction-set level. attention_kernels.inc is compiled three times, by
// attention_scalar.cpp (baseline flags), attention_avx2.cpp (-mavx2 -mfma -mf16c) and
// attention_avx512.cpp (those and -mavx512f -mavx512bw -mavx512dq -mavx512vl), the last two on
// x86-64 with GCC or Clang (CMakeLists.txt), each into its own namespace; attention.cpp calls the
// copy of the level cpu_isa() names. All build with -ffp-contract=off, so a multiply and an add fuse only where
// the code says so (an fmadd intrinsic). The copies see nothing but this header's plain types and
// their own helpers (no shared inline function whose one linked copy could carry AVX
// instructions into the scalar path).
#pragma once

#include <cstdint>

#include "oasiskv/cpu/attention.hpp"
#include "oasiskv/dtype.hpp"

#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
#define OASISKV_ATTENTION_AVX2_COPY 1
#else
#define OASISKV_ATTENTION_AVX2_COPY 0
#endif

#define OASISKV_ATTENTION_DECLARE(ns)                                                                                \
  namespace oasiskv {                                                                                                \
  inline namespace v0 {                                                                                              \
  namespace detail::ns {                                                                                             \
  /* Folds rows [first, last) of the segments into the running state of `heads` query heads */                       \
  /* (max, sum: [heads]; acc: [heads][d]). */                                                                        \
  void fold_rows(const float* q, int heads, int d, float scale, const KvRows<float>* segments, int count,            \
                 std::int64_t first, std::int64_t last, float* max, float* sum, float* acc);                         \
  void fold_rows(const float* q, int heads, int d, float scale, const KvRows<fp16_t>* segments, int count,           \
                 std::int64_t first, std::int64_t last, float* max, float* sum, float* acc);                         \
  void fold_rows(const float* q, int heads, int d, float scale, const KvRows<bf16_t>* segments, int count,           \
                 std::int64_t first, std::int64_t last, float* max, float* sum, float* acc);                         \
  /* Causal rows over one run (cpu_attend_causal) into states[r], reset by the caller; false */                      \
  /* where this copy has no tiles for d (the caller then folds row by row). */                                       \
  bool fold_causal(const float* q, std::int64_t q_stride, int rows, const std::int32_t* positions, int heads, int d, \
                   float scale, const KvRows<float>& kv, SoftmaxState* states);                                      \
  bool fold_causal(const float* q, std::int64_t q_stride, int rows, const std::int32_t* positions, int heads, int d, \
                   float scale, const KvRows<fp16_t>& kv, SoftmaxState* states);                                     \
  bool fold_causal(const float* q, std::int64_t q_stride, int rows, const std::int32_t* positions, int heads, int d, \
                   float scale, const KvRows<bf16_t>& kv, SoftmaxState* states);                                     \
  }                                                                                                                  \
  }                                                                                                                  \
  }

OASISKV_ATTENTION_DECLARE(attention_scalar)
#if OASISKV_ATTENTION_AVX2_COPY
OASISKV_ATTENTION_DECLARE(attention_avx2)
OASISKV_ATTENTION_DECLARE(attention_avx512)
#endif
#undef OASISKV_ATTENTION_DECLARE
