// The doctest main of the test binaries that ctest runs once per instruction-set level
// (cmake/OasisKVTesting.cmake: oasiskv_discover_isa_tests). Each entry sets OASISKV_CPU_ISA and
// passes the same level as --oasiskv-isa=<level>; a level this CPU lacks is reported as skipped
// (exit 77), a variable that disagrees with the argument, or names no level, fails.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include <oasiskv/cpu/isa.hpp>
#include <oasiskv/error.hpp>

int main(int argc, char** argv) {
  std::string_view wanted;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a.starts_with("--oasiskv-isa=")) wanted = a.substr(std::string_view("--oasiskv-isa=").size());
  }
  if (!wanted.empty()) {
    const char* env = std::getenv(oasiskv::kCpuIsaVariable);
    if (env == nullptr || wanted != env) {
      std::fprintf(stderr, "--oasiskv-isa=%.*s needs %s=%.*s in the environment (it is read when the library loads)\n",
                   static_cast<int>(wanted.size()), wanted.data(), oasiskv::kCpuIsaVariable,
                   static_cast<int>(wanted.size()), wanted.data());
      return 1;
    }
    try {
      if (oasiskv::parse_cpu_isa(wanted) > oasiskv::cpu_isa_supported()) {
        std::printf("skipped: this CPU (%s) supports up to %s, not %.*s\n", oasiskv::cpu_model_name().c_str(),
                    std::string(oasiskv::to_string(oasiskv::cpu_isa_supported())).c_str(),
                    static_cast<int>(wanted.size()), wanted.data());
        return 77;
      }
    } catch (const oasiskv::Error& e) {
      std::fprintf(stderr, "%s\n", e.what());
      return 1;
    }
  }
  try {
    // stderr: stdout is parsed for test names when ctest lists them.
    std::fprintf(stderr, "%s\n", oasiskv::cpu_isa_description().c_str());
  } catch (const oasiskv::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
