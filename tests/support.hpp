// Shared test helpers: seeded random inputs (the seed is reported on failure), small caches,
// and a byte fingerprint (conformance/harness.hpp fingerprints a whole cache with it).
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "oasiskv/oasiskv.hpp"

namespace oasiskv::test {

// A fresh seed per run (OASISKV_TEST_SEED=N reproduces one); INFO prints it on failure.
inline std::uint64_t fresh_seed() {
  if (const char* s = std::getenv("OASISKV_TEST_SEED")) return std::strtoull(s, nullptr, 10);
  return (static_cast<std::uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
}

#define OASISKV_SEEDED_RNG(rng)                                      \
  const std::uint64_t rng##_seed = ::oasiskv::test::fresh_seed();   \
  INFO("seed = " << rng##_seed << " (rerun with OASISKV_TEST_SEED)"); \
  std::mt19937_64 rng(rng##_seed)

template <class T>
std::vector<T> random_rows(std::mt19937_64& rng, std::size_t n, float scale = 1.0f) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<T> out(n);
  for (auto& x : out) x = from_float<T>(dist(rng));
  return out;
}

// Block summaries ([unit][max | min][d]) folded from `rows` keys per unit as SummaryStore::add_key
// folds them (std::max / std::min, a unit's first row resets), so each channel's max is at least
// its min (admission refuses the other way round). value() draws each key element, row by row.
template <class Value>
std::vector<float> random_summaries(std::size_t units, int d, int rows, Value&& value) {
  const auto D = static_cast<std::size_t>(d);
  std::vector<float> s(units * 2 * D);
  for (std::size_t u = 0; u < units; ++u) {
    float* mx = s.data() + u * 2 * D;
    for (int r = 0; r < rows; ++r) {
      for (std::size_t c = 0; c < D; ++c) {
        const float k = value();
        mx[c] = r == 0 ? k : std::max(mx[c], k);
        mx[D + c] = r == 0 ? k : std::min(mx[D + c], k);
      }
    }
  }
  return s;
}

// Random block summaries: two standard normal keys folded per unit.
inline std::vector<float> random_summaries(std::mt19937_64& rng, std::size_t units, int d) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  return random_summaries(units, d, 2, [&] { return dist(rng); });
}

inline CacheConfig small_config(int budget_tokens = 128, std::int64_t capacity = 1024, int sequences = 3) {
  CacheConfig c;
  c.shape = ModelShape{2, 4, 2, 16};
  c.block_tokens = 16;
  c.budget_tokens = budget_tokens;
  c.sink_tokens = 16;
  c.recent_tokens = 32;
  c.max_sequences = sequences;
  c.max_tokens_per_sequence = capacity;
  return c;
}

// FNV-1a over bytes.
struct Fingerprint {
  std::uint64_t h = 1469598103934665603ull;
  void add(const void* p, std::size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (std::size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  }
  template <class V>
  void add_value(const V& v) {
    add(&v, sizeof(v));
  }
};

}  // namespace oasiskv::test
