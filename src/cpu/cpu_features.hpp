// Private to the library's sources: which instruction sets the CPU kernels may use now
// (detail/cpu_kernels.hpp). The library is built without -march: x86 kernels carry their own
// target attributes and are chosen at run time from these flags, which follow the level in use
// (oasiskv/cpu/isa.hpp; set in isa.cpp).
#pragma once

#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
#define OASISKV_X86_KERNELS 1
#else
#define OASISKV_X86_KERNELS 0
#endif

namespace oasiskv {
inline namespace v0 {
namespace detail {

struct CpuFeatures {
  bool sse2 = false;  // the x86-64 baseline
  bool avx = false;   // 256-bit float vectors and streaming stores (OS support checked)
  bool avx2 = false;  // 256-bit integer vectors
  bool f16c = false;  // fp16 <-> float conversion
};

#if OASISKV_X86_KERNELS
// A software prefetch the optimiser keeps: GCC 12 deletes some loops of __builtin_prefetch /
// _mm_prefetch as if they had no effect (the summary prefetch of quest_bound_blocks was gone).
inline void prefetch_read(const void* p) noexcept { asm volatile("prefetcht0 (%0)" : : "r"(p)); }
#endif

// The CPU's features at the level in use (none at scalar, or while set_simd_enabled(false)): a
// plain global set at start-up (before main) and by set_simd_enabled, read on every kernel call
// (a load, no guard).
extern CpuFeatures g_usable_features;
inline CpuFeatures usable_features() noexcept { return g_usable_features; }

}  // namespace detail
}  // namespace v0
}  // namespace oasiskv
