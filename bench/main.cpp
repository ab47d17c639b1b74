// oasiskv_bench: Google Benchmark main plus the run's context (shape, what "per layer" means).
#include "bench_support.hpp"

#include <string>

namespace oasiskv::bench {
void register_decode_step_benchmarks();
}

int main(int argc, char** argv) {
  using namespace oasiskv::bench;
  register_decode_step_benchmarks();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::AddCustomContext("oasiskv_version", std::string(oasiskv::version_string()));
  // The CPU and the level its kernels ran at (OASISKV_CPU_ISA caps it): results name both.
  benchmark::AddCustomContext("oasiskv_cpu", oasiskv::cpu_isa_description());
  benchmark::AddCustomContext(
      "oasiskv_shape",
      "Llama-3-8B-like per layer: " + std::to_string(kQueryHeads) + " query heads, " + std::to_string(kKvHeads) +
          " kv heads, head dim " + std::to_string(kHeadDim) + ", fp16, batch " + std::to_string(kBatch) +
          ", block " + std::to_string(kBlockTokens) + " tokens, budget " + std::to_string(kBudgetTokens) +
          " tokens per kv head");
  benchmark::AddCustomContext("oasiskv_per_layer",
                              "decode-step benchmarks use caches with num_layers = 1: times are per layer "
                              "(the 32-layer model at 32K x batch 8 is 32 GiB of KV)");
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
