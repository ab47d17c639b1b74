#include "bench_support.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>

namespace oasiskv::bench {

CacheConfig layer_config(std::int64_t max_tokens, double fetch_ratio, int max_sequences) {
  CacheConfig c;
  c.shape = ModelShape{1, kQueryHeads, kKvHeads, kHeadDim};
  c.block_tokens = kBlockTokens;
  c.budget_tokens = kBudgetTokens;
  c.fetch_ratio = fetch_ratio;
  c.max_sequences = max_sequences;
  c.max_tokens_per_sequence = max_tokens;
  return c;
}

void fill_uniform(std::span<float> out, std::uint64_t seed) {
  Random r(seed);
  for (float& x : out) x = r.uniform();
}

void fill_uniform(std::span<fp16_t> out, std::uint64_t seed) {
  Random r(seed);
  for (fp16_t& x : out) x = to_fp16(r.uniform());
}

double memcpy_bytes_per_second(std::size_t footprint) {
  constexpr std::size_t kMin = 4096, kMax = std::size_t{256} << 20;
  const std::size_t bytes = std::clamp(footprint, kMin, kMax);
  static std::mutex mutex;
  static std::map<std::size_t, double> measured;
  std::lock_guard lock(mutex);
  if (auto it = measured.find(bytes); it != measured.end()) return it->second;

  auto src = std::make_unique<std::byte[]>(bytes);
  auto dst = std::make_unique<std::byte[]>(bytes);
  std::memset(src.get(), 1, bytes);
  std::memset(dst.get(), 2, bytes);
  // Small copies are timed in batches so that clock resolution does not matter.
  const std::size_t reps = std::max<std::size_t>(1, (std::size_t{1} << 20) / bytes);
  using clock = std::chrono::steady_clock;
  double best = 1e30;
  const auto deadline = clock::now() + std::chrono::milliseconds(50);
  for (int round = 0; round < 3 || clock::now() < deadline; ++round) {
    const auto start = clock::now();
    for (std::size_t r = 0; r < reps; ++r) {
      std::memcpy(dst.get(), src.get(), bytes);
      benchmark::ClobberMemory();
    }
    best = std::min(best, std::chrono::duration<double>(clock::now() - start).count() / static_cast<double>(reps));
  }
  const double rate = static_cast<double>(bytes) / best;
  measured.emplace(bytes, rate);
  return rate;
}

void set_memcpy_limit(benchmark::State& state, std::size_t bytes_per_iteration, std::size_t footprint) {
  const double limit = memcpy_bytes_per_second(footprint);
  const double total = static_cast<double>(bytes_per_iteration) * static_cast<double>(state.iterations());
  state.SetBytesProcessed(static_cast<std::int64_t>(total));
  state.counters["memcpy_GBps"] = benchmark::Counter(limit / 1e9);
  state.counters["of_memcpy"] = benchmark::Counter(total / limit, benchmark::Counter::kIsRate);
}

void set_reference(benchmark::State& state, const std::string& reference_names) {
  state.SetLabel("ref=" + reference_names);
}

}  // namespace oasiskv::bench
