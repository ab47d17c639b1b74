// oasiskv/cpu/isa.hpp: what the CPU supports, the OASISKV_CPU_ISA cap, and the features the
// library's kernels may use (cpu_features.hpp), all settled once when the library is loaded.
#include "oasiskv/cpu/isa.hpp"

#include <cstdlib>
#include <cstring>
#include <string>

#include "cpu_features.hpp"
#include "oasiskv/cpu/detail/cpu_kernels.hpp"
#include "oasiskv/error.hpp"

#if OASISKV_X86_KERNELS
#include <cpuid.h>
#endif

namespace oasiskv {
inline namespace v0 {
namespace detail {

namespace {

// Every feature the library's vector kernels use; each name is tested on its own, and
// __builtin_cpu_supports also checks that the OS saves the vector registers.
CpuFeatures detect() noexcept {
  CpuFeatures f;
#if OASISKV_X86_KERNELS
  __builtin_cpu_init();
  f.sse2 = __builtin_cpu_supports("sse2") != 0;
  f.avx = __builtin_cpu_supports("avx") != 0;
  f.avx2 = f.avx && __builtin_cpu_supports("avx2") != 0;
  // F16C from CPUID (leaf 1, ECX bit 29): not every compiler's __builtin_cpu_supports knows it;
  // its registers are AVX's, whose OS support the "avx" test covers.
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  f.f16c = f.avx && __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & (1u << 29)) != 0;
#endif
  return f;
}

CpuIsa detect_level() noexcept {
#if OASISKV_X86_KERNELS
  const CpuFeatures f = detect();
  if (!(f.avx2 && f.f16c && __builtin_cpu_supports("fma"))) return CpuIsa::scalar;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni")) {
    return CpuIsa::avx512;
  }
  return CpuIsa::avx2;
#else
  return CpuIsa::scalar;
#endif
}

// The library's kernels at a level: none below avx2 (portable versions); from avx2 on, every
// feature the CPU has (they have no AVX-512 versions).
CpuFeatures features_at(CpuIsa level) noexcept { return level == CpuIsa::scalar ? CpuFeatures{} : detect(); }

struct IsaState {
  CpuIsa supported = CpuIsa::scalar;
  CpuIsa in_use = CpuIsa::scalar;
  bool capped = false;  // OASISKV_CPU_ISA lowered the level
  std::string error;    // why OASISKV_CPU_ISA was refused; empty when it was not
};

bool parse(std::string_view name, CpuIsa& out) noexcept {
  for (CpuIsa level : {CpuIsa::scalar, CpuIsa::avx2, CpuIsa::avx512}) {
    if (name == to_string(level)) {
      out = level;
      return true;
    }
  }
  return false;
}

// Reads the environment without throwing (it runs before main): a refusal is kept for cpu_isa().
IsaState settle() noexcept {
  IsaState s;
  s.supported = detect_level();
  s.in_use = s.supported;
  const char* cap = std::getenv(kCpuIsaVariable);
  if (cap == nullptr || *cap == '\0') return s;
  CpuIsa level{};
  try {
    if (!parse(cap, level)) {
      s.error = fmt::format("{}={}: not an instruction-set level (use scalar, avx2 or avx512)", kCpuIsaVariable, cap);
    } else if (level > s.supported) {
      s.error = fmt::format("{}={}: this CPU ({}) supports up to {}", kCpuIsaVariable, cap, cpu_model_name(),
                            to_string(s.supported));
    }
  } catch (...) {
    s.error = std::string(kCpuIsaVariable) + " could not be read";  // out of memory formatting the message
  }
  if (!s.error.empty()) {
    s.in_use = CpuIsa::scalar;  // the safe choice until a call reports the error
    return s;
  }
  s.capped = level < s.supported;
  s.in_use = level;
  return s;
}

const IsaState g_isa = settle();

}  // namespace

// A kernel called by another library's static initialiser before this one ran sees no features:
// the portable version, which computes the same bits. (Initialised after g_isa: the same file.)
CpuFeatures g_usable_features = features_at(g_isa.in_use);

void set_simd_enabled(bool enabled) noexcept {
  g_usable_features = enabled ? features_at(g_isa.in_use) : CpuFeatures{};
}
bool simd_enabled() noexcept { return g_usable_features.sse2 || g_usable_features.avx; }

}  // namespace detail

std::string_view to_string(CpuIsa level) noexcept {
  switch (level) {
    case CpuIsa::scalar: return "scalar";
    case CpuIsa::avx2: return "avx2";
    case CpuIsa::avx512: return "avx512";
  }
  return "unknown";
}

CpuIsa parse_cpu_isa(std::string_view name) {
  CpuIsa level{};
  if (!detail::parse(name, level)) fail("CPU instruction-set level '{}': use scalar, avx2 or avx512", name);
  return level;
}

CpuIsa cpu_isa_supported() noexcept { return detail::g_isa.supported; }

CpuIsa cpu_isa() {
  if (!detail::g_isa.error.empty()) throw Error(detail::g_isa.error);
  return detail::g_isa.in_use;
}

std::string cpu_model_name() {
#if OASISKV_X86_KERNELS
  unsigned top = 0, ebx = 0, ecx = 0, edx = 0;
  __cpuid(0x80000000u, top, ebx, ecx, edx);
  if (top >= 0x80000004u) {
    char brand[49] = {};
    for (unsigned i = 0; i < 3; ++i) {
      unsigned r[4] = {};
      __cpuid(0x80000002u + i, r[0], r[1], r[2], r[3]);
      std::memcpy(brand + 16 * i, r, sizeof r);
    }
    std::string name(brand);
    const auto first = name.find_first_not_of(' ');
    const auto last = name.find_last_not_of(' ');
    if (first != std::string::npos) return name.substr(first, last - first + 1);
  }
#endif
  return "unknown";
}

std::string cpu_isa_description() {
  const CpuIsa level = cpu_isa();
  if (detail::g_isa.capped) {
    return fmt::format("ISA {} (capped by {}; the CPU supports {}) on {}", to_string(level), kCpuIsaVariable,
                       to_string(detail::g_isa.supported), cpu_model_name());
  }
  return fmt::format("ISA {} on {}", to_string(level), cpu_model_name());
}

}  // namespace v0
}  // namespace oasiskv
