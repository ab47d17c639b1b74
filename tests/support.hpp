// Shared test helpers: seeded random inputs (the seed is reported on failure), small caches,
// and a fingerprint of a cache's observable state to show that a failed call changed nothing.
#pragma once

#include <doctest/doctest.h>

#include <cstdint>
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

// Sequences, lengths, host rows, planned residency and statistics of `ids`.
template <class T>
std::uint64_t fingerprint(const Cache<cpu, T>& cache, const std::vector<SeqId>& ids) {
  Fingerprint f;
  const auto& L = cache.layout();
  const auto& s = L.config.shape;
  f.add_value(cache.num_sequences());
  for (SeqId id : ids) {
    f.add_value(cache.has_sequence(id));
    if (!cache.has_sequence(id)) continue;
    const int slot = cache.block_table().find(id);
    f.add_value(cache.block_table().generation(slot));
    for (int l = 0; l < s.num_layers; ++l) {
      const std::int64_t len = cache.sequence_length(id, l);
      f.add_value(len);
      f.add_value(cache.block_table().next_plan(slot, l));
      for (int h = 0; h < s.num_kv_heads; ++h) {
        for (std::int64_t t = 0; t < len; ++t) {
          f.add(cache.host_tier().key(slot, l, h, t), sizeof(T) * static_cast<std::size_t>(s.head_dim));
          f.add(cache.host_tier().value(slot, l, h, t), sizeof(T) * static_cast<std::size_t>(s.head_dim));
        }
        for (std::int32_t b : cache.backend().planned_blocks(slot, l, h)) f.add_value(b);
      }
    }
  }
  for (const auto& ls : cache.statistics().layers) {
    f.add_value(ls.plans);
    f.add_value(ls.blocks_fetched);
    f.add_value(ls.admits_capped);
    f.add_value(ls.acquires);
    f.add_value(ls.observed_true_blocks);
  }
  return f.h;
}

}  // namespace oasiskv::test
