#include "oasiskv/version.hpp"

// OASISKV_VERSION_* come from CMake (PROJECT_VERSION), see CMakeLists.txt.
#if !defined(OASISKV_VERSION_STRING) || !defined(OASISKV_VERSION_MAJOR) || !defined(OASISKV_VERSION_MINOR) || \
    !defined(OASISKV_VERSION_PATCH)
#error "OASISKV_VERSION_* must be defined by the build system"
#endif

namespace oasiskv {
inline namespace v0 {

std::string_view version_string() noexcept { return OASISKV_VERSION_STRING; }
int version_major() noexcept { return OASISKV_VERSION_MAJOR; }
int version_minor() noexcept { return OASISKV_VERSION_MINOR; }
int version_patch() noexcept { return OASISKV_VERSION_PATCH; }

}  // namespace v0
}  // namespace oasiskv
