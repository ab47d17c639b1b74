// Shared pieces of the OasisKV microbenchmarks: the model shape they measure, random data,
// the memcpy limit every bandwidth figure is set against, and the label that names a benchmark's
// reference so that scripts/bench-report can compute the ratio from the same run.
#pragma once

#include <oasiskv/oasiskv.hpp>

#include <benchmark/benchmark.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace oasiskv::bench {

// Llama-3-8B-like attention shape, per layer: 32 query heads, 8 kv heads, head dim 128, fp16.
// The benchmarks build caches with num_layers = 1: the whole model (32 layers x batch 8 x 32K
// tokens) is 32 GiB of KV, more than this machine holds, and every cost measured here is per layer.
inline constexpr int kQueryHeads = 32;
inline constexpr int kKvHeads = 8;
inline constexpr int kHeadDim = 128;
inline constexpr int kGroup = kQueryHeads / kKvHeads;
inline constexpr int kBatch = 8;
inline constexpr int kBlockTokens = 16;
inline constexpr int kBudgetTokens = 2048;
inline constexpr std::int64_t kLongContext = 32768;
// Bytes of one block of one kv head: K and V, 16 x 128 fp16 each.
inline constexpr std::size_t kBlockBytes = 2u * kBlockTokens * kHeadDim * sizeof(fp16_t);

// The per-layer cache config of the shape above.
CacheConfig layer_config(std::int64_t max_tokens, double fetch_ratio, int max_sequences = kBatch);

// Deterministic fast random numbers (xorshift): benchmark data need not be statistically good.
class Random {
 public:
  explicit Random(std::uint64_t seed) : state_(seed * 0x9E3779B97F4A7C15ull + 1) {}
  std::uint64_t next() noexcept {
    state_ ^= state_ << 13;
    state_ ^= state_ >> 7;
    state_ ^= state_ << 17;
    return state_;
  }
  // Uniform in [-1, 1).
  float uniform() noexcept { return static_cast<float>(next() >> 40) * (2.0f / 16777216.0f) - 1.0f; }

 private:
  std::uint64_t state_;
};

void fill_uniform(std::span<float> out, std::uint64_t seed);
void fill_uniform(std::span<fp16_t> out, std::uint64_t seed);

// Bytes per second of one std::memcpy of `footprint` bytes (clamped to [4 KiB, 256 MiB]: beyond
// that every size is DRAM-bound), best of several copies over about 50 ms, measured once per size
// and cached. The same footprint keeps the limit at the cache level the measured code runs from.
double memcpy_bytes_per_second(std::size_t footprint);

// Sets the counters of a benchmark whose natural rate is bytes moved or read per second:
// bytes_per_second (Google Benchmark's), memcpy_GBps (the limit at the same footprint) and
// of_memcpy (the rate over the limit; 1.0 means at memcpy speed).
void set_memcpy_limit(benchmark::State& state, std::size_t bytes_per_iteration, std::size_t footprint);

// Names the reference benchmark(s) (same work, same binary) that scripts/bench-report divides by:
// ratio = time of the reference / time of this benchmark.
void set_reference(benchmark::State& state, const std::string& reference_names);

}  // namespace oasiskv::bench
