// OasisKV version information.
#pragma once

#include <string_view>

namespace oasiskv {
inline namespace v0 {

// The library's version as "MAJOR.MINOR.PATCH" (the CMake project version).
[[nodiscard]] std::string_view version_string() noexcept;
[[nodiscard]] int version_major() noexcept;
[[nodiscard]] int version_minor() noexcept;
[[nodiscard]] int version_patch() noexcept;

}  // namespace v0
}  // namespace oasiskv
