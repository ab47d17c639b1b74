// The level in use and the engine's public kernel entry points (isa_kernels.hpp): each forwards to
// the table of the level oasiskv::cpu_isa() names, chosen once.
#include "isa_kernels.hpp"

#include <atomic>
#include <string>

#include <oasiskv/error.hpp>

#include "llama_model.hpp"

namespace smollm2 {

namespace isa_scalar {
extern const IsaKernels kernels;
}
#if SMOLLM2_X86_LEVELS
namespace isa_avx2 {
extern const IsaKernels kernels;
}
namespace isa_avx512 {
extern const IsaKernels kernels;
}
#endif

const IsaKernels* isa_kernels_at(oasiskv::CpuIsa level) {
  if (level > oasiskv::cpu_isa_supported()) return nullptr;
  switch (level) {
    case oasiskv::CpuIsa::scalar: return &isa_scalar::kernels;
#if SMOLLM2_X86_LEVELS
    case oasiskv::CpuIsa::avx2: return &isa_avx2::kernels;
    case oasiskv::CpuIsa::avx512: return &isa_avx512::kernels;
#endif
    default: return nullptr;
  }
}

namespace {
// The table in use: set on the first call (or by set_isa_level_for_testing), then one relaxed
// load per kernel call.
std::atomic<const IsaKernels*> g_kernels{nullptr};
}  // namespace

const IsaKernels& isa_kernels() {
  if (const IsaKernels* k = g_kernels.load(std::memory_order_relaxed)) return *k;
  // cpu_isa() throws on a bad OASISKV_CPU_ISA, leaving nothing set: the next call throws again.
  // The library's supported levels are ones this build compiled (x86: all three).
  const IsaKernels* k = isa_kernels_at(oasiskv::cpu_isa());
  g_kernels.store(k, std::memory_order_relaxed);
  return *k;
}

void set_isa_level_for_testing(oasiskv::CpuIsa level) {
  const IsaKernels* k = isa_kernels_at(level);
  if (k == nullptr) {
    throw oasiskv::Error(std::string("set_isa_level_for_testing: this CPU or build has no ") +
                         std::string(oasiskv::to_string(level)) + " kernels");
  }
  g_kernels.store(k, std::memory_order_relaxed);
}

float dot(const float* a, const float* b, int n) { return isa_kernels().dot(a, b, n); }

void dot4(const float* w, const float* x0, const float* x1, const float* x2, const float* x3, int n, float* out) {
  isa_kernels().dot4(w, x0, x1, x2, x3, n, out);
}

void quantize_activations(const float* x, int rows, int cols, ActivationBlocks& out) {
  isa_kernels().quantize_activations(x, rows, cols, out);
}

void matmul_quantized(const QuantizedRows& w, const ActivationBlocks& x, float* y) { isa_kernels().matmul_int8(w, x, y); }

void matmul_quantized(const QuantizedRows& w, const float* x, int rows, float* y) {
  const IsaKernels& k = isa_kernels();
  if (!w.int8_activations) return k.matmul_fp32_activations(w, x, rows, y);
  thread_local ActivationBlocks blocks;
  k.quantize_activations(x, rows, w.cols, blocks);
  k.matmul_int8(w, blocks, y);
}

}  // namespace smollm2
