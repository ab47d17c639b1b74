// The instruction-set level the CPU kernels run at, and the one switch that caps it.
//
// The library's CPU kernels (block scoring, the summary fold, the host copies, the non-finite
// scan) are compiled for several levels and pick one at run time; an engine that embeds the
// library can follow the same level (examples/smollm2 does). The levels, lowest first:
//   scalar  portable loops, no vector intrinsics: any CPU
//   avx2    AVX2 + FMA + F16C (Intel Haswell, AMD Zen 1 and later)
//   avx512  AVX-512 F, BW, DQ, VL and VNNI (Intel Ice Lake, AMD Zen 4 and later)
// The level in use is the highest this CPU supports, capped by the environment variable
// OASISKV_CPU_ISA (scalar | avx2 | avx512), which is read once, when the library is loaded. So a
// machine with AVX-512 can run, and test, the paths an AVX2-only or older CPU takes. A value that
// names no level, or a level this CPU lacks, is an error: cpu_isa() throws an Error naming it,
// and so does constructing a Cache<cpu, T>. Of the library's own kernels, only the attention
// (oasiskv/cpu/attention.hpp) has an AVX-512 version, which agrees with the others to float
// rounding; the rest run their AVX2 versions at avx512, and each of those computes exactly the
// bits of the portable one (tests/kernels compares them at every level).
#pragma once

#include <string>
#include <string_view>

namespace oasiskv {
inline namespace v0 {

enum class CpuIsa : int { scalar = 0, avx2 = 1, avx512 = 2 };

// The environment variable that caps the level.
inline constexpr const char* kCpuIsaVariable = "OASISKV_CPU_ISA";

// "scalar", "avx2" or "avx512".
[[nodiscard]] std::string_view to_string(CpuIsa level) noexcept;

// The level a name gives; throws Error naming the value when it names none.
[[nodiscard]] CpuIsa parse_cpu_isa(std::string_view name);

// The highest level this CPU (and its operating system) supports.
[[nodiscard]] CpuIsa cpu_isa_supported() noexcept;

// The level in use: cpu_isa_supported(), capped by OASISKV_CPU_ISA. Throws Error when the
// variable names no level or one above cpu_isa_supported(); until that is fixed the library's
// kernels run their portable versions.
[[nodiscard]] CpuIsa cpu_isa();

// The CPU's model name as it reports it (CPUID's brand string on x86), or "unknown".
[[nodiscard]] std::string cpu_model_name();

// One line for a program's banner: "ISA avx2 (capped by OASISKV_CPU_ISA; the CPU supports
// avx512) on Intel(R) Xeon(R) Processor". Throws as cpu_isa() does.
[[nodiscard]] std::string cpu_isa_description();

}  // namespace v0
}  // namespace oasiskv
