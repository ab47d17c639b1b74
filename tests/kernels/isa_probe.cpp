// What a program sees of OASISKV_CPU_ISA (tests/kernels/CMakeLists.txt runs it with good and bad
// values): prints the level in use beside the CPU, builds a Cache<cpu, float>, and exits 0; prints
// the Error and exits 3 where the value cannot be honoured. `isa_probe --above` reruns itself with
// the level above the CPU's (exit 77, "skipped", where the CPU has the highest).
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include <oasiskv/oasiskv.hpp>

int main(int argc, char** argv) {
  using namespace oasiskv;
  if (argc > 1 && std::string_view(argv[1]) == "--above") {
    if (cpu_isa_supported() == CpuIsa::avx512) {
      std::printf("skipped: this CPU supports every level\n");
      return 77;
    }
    const CpuIsa above = static_cast<CpuIsa>(static_cast<int>(cpu_isa_supported()) + 1);
    ::setenv(kCpuIsaVariable, std::string(to_string(above)).c_str(), 1);
    char* args[] = {argv[0], nullptr};
    ::execv("/proc/self/exe", args);
    std::perror("execv");
    return 1;
  }
  try {
    std::printf("%s\n", cpu_isa_description().c_str());
  } catch (const Error& e) {
    std::printf("cpu_isa_description: %s\n", e.what());
  }
  try {
    CacheConfig config;
    config.shape = ModelShape{1, 2, 1, 16};
    config.budget_tokens = 128;
    config.max_sequences = 1;
    config.max_tokens_per_sequence = 256;
    Cache<cpu, float> cache(config);
    std::printf("a Cache<cpu, float> was built at %s\n", std::string(to_string(cpu_isa())).c_str());
    return 0;
  } catch (const Error& e) {
    std::printf("Cache<cpu, float>: %s\n", e.what());
    return 3;
  }
}
