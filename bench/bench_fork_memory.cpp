// Host memory of forked sequences: a 4,096-token prompt forked 8 times, each fork extended by 256
// tokens (n = 8 sampling, beam search, a shared prefix), against 8 independent sequences holding
// the same tokens. Both are built in each iteration of one benchmark, so the ratio is from one run.
// Counters: the host pool's bytes in use (Statistics::host_bytes_in_use) and the process's resident
// memory growth (the pool, summaries and slots are committed by the OS page by page on first
// touch), in MiB, and independent / forked for each.
#include "bench_support.hpp"

#include <unistd.h>

#include <cstdio>
#include <memory>
#include <vector>

namespace oasiskv::bench {
namespace {

constexpr std::int64_t kPrompt = 4096;
constexpr std::int64_t kExtension = 256;
constexpr int kForks = 8;

double resident_mib() {
  long pages = 0, resident = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return static_cast<double>(resident) * static_cast<double>(::sysconf(_SC_PAGESIZE)) / (1024.0 * 1024.0);
}

struct Footprint {
  double pool_mib = 0, resident_mib = 0;
};

// Appends `rows` rows to `ids` (one sequence at a time: a prompt, then the extensions).
void fill(Cache<cpu, fp16_t>& cache, const std::vector<SeqId>& ids, std::int64_t rows, const std::vector<fp16_t>& kv) {
  const std::vector<std::int32_t> n{static_cast<std::int32_t>(rows)};
  for (SeqId id : ids) {
    cache.append(std::span(&id, 1), 0, n, rows_view(kv.data(), rows), rows_view(kv.data(), rows));
  }
}

Footprint build(bool forked, const std::vector<fp16_t>& kv) {
  const double before = resident_mib();
  CacheConfig config = layer_config(kPrompt + kExtension, 1.0, kForks + 1);
  auto cache = std::make_unique<Cache<cpu, fp16_t>>(config);
  std::vector<SeqId> ids;
  for (int i = 1; i <= kForks; ++i) ids.push_back(static_cast<SeqId>(i));
  if (forked) {
    cache->add_sequence(0);
    fill(*cache, {0}, kPrompt, kv);
    for (SeqId id : ids) cache->fork(0, id);
  } else {
    for (SeqId id : ids) cache->add_sequence(id);
    fill(*cache, ids, kPrompt, kv);
  }
  fill(*cache, ids, kExtension, kv);
  Footprint f;
  f.pool_mib = static_cast<double>(cache->statistics().host_bytes_in_use) / (1024.0 * 1024.0);
  f.resident_mib = resident_mib() - before;
  return f;
}

void BM_ForkHostMemory(benchmark::State& state) {
  std::vector<fp16_t> kv(static_cast<std::size_t>(kPrompt * kKvHeads * kHeadDim));
  fill_uniform(kv, 4);
  Footprint forked, independent;
  for (auto _ : state) {
    forked = build(true, kv);
    independent = build(false, kv);
  }
  state.counters["forked_pool_MiB"] = forked.pool_mib;
  state.counters["independent_pool_MiB"] = independent.pool_mib;
  state.counters["pool_ratio"] = independent.pool_mib / forked.pool_mib;
  state.counters["forked_rss_MiB"] = forked.resident_mib;
  state.counters["independent_rss_MiB"] = independent.resident_mib;
  state.counters["rss_ratio"] = forked.resident_mib > 0 ? independent.resident_mib / forked.resident_mib : 0.0;
}
BENCHMARK(BM_ForkHostMemory)->UseRealTime()->Unit(benchmark::kMillisecond)->Iterations(1);

}  // namespace
}  // namespace oasiskv::bench
