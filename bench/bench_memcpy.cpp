// The physical limit: std::memcpy bandwidth on this machine, at the footprints the other
// benchmarks touch (L2-, L3- and DRAM-sized). Rate = bytes copied per second (each byte read once
// and written once).
#include "bench_support.hpp"

#include <cstring>
#include <memory>

namespace oasiskv::bench {
namespace {

void BM_Memcpy(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  auto src = std::make_unique<std::byte[]>(bytes);
  auto dst = std::make_unique<std::byte[]>(bytes);
  std::memset(src.get(), 1, bytes);
  std::memset(dst.get(), 2, bytes);
  for (auto _ : state) {
    std::memcpy(dst.get(), src.get(), bytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
}
BENCHMARK(BM_Memcpy)->UseRealTime()->Arg(64 << 10)->Arg(2 << 20)->Arg(16 << 20)->Arg(256 << 20);

}  // namespace
}  // namespace oasiskv::bench
