// detail::find_non_finite: oasiskv::find_non_finite (dtype.hpp) vectorised where the CPU allows,
// for the host checks of rows and queries whichever backend holds them (the CPU engine's append,
// the admission message's checks in src/admission.cpp). Compiled with the library's other
// vectorised host loops (src/cpu/cpu_kernels.cpp, which the kernel tests compare bit for bit with
// the portable version); declared here so that a caller needs no CPU-engine header.
#pragma once

#include <cstddef>
#include <cstdint>

#include "oasiskv/dtype.hpp"

namespace oasiskv {
inline namespace v0 {
namespace detail {

// The index of the first NaN or infinity of the n elements at data, or -1.
std::int64_t find_non_finite(const void* data, DType dtype, std::size_t n) noexcept;

}  // namespace detail
}  // namespace v0
}  // namespace oasiskv
