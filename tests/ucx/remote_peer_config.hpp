// What the prefill-process peer (remote_peer.cpp) and the tests that spawn it share: the cache
// config, and the peer's prompt rows and lookahead queries as functions of its seed, so that a
// test regenerates the rows a peer holds without asking it (and the tests' counting source). Values come from the raw bits of
// mt19937_64 (fully specified), not from a distribution (whose output the library chooses).
#pragma once

#include <oasiskv/cache.hpp>

#include <atomic>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

namespace oasiskv::test::peer {

// As tests/test_remote_admission.cpp's remote_config(): budget 128, 16-token blocks, sinks 16,
// ring 32, 2048 tokens per sequence, up to 3 sequences, a quarter of the budget fetched per step.
inline CacheConfig config() {
  CacheConfig c;
  c.shape = ModelShape{2, 4, 2, 16};
  c.block_tokens = 16;
  c.budget_tokens = 128;
  c.sink_tokens = 16;
  c.recent_tokens = 32;
  c.max_sequences = 3;
  c.max_tokens_per_sequence = 2048;
  c.fetch_ratio = 0.25;
  return c;
}

// n floats uniform in [-scale, scale).
inline std::vector<float> uniform_floats(std::mt19937_64& rng, std::size_t n, float scale = 1.0f) {
  std::vector<float> out(n);
  for (float& x : out) x = scale * (static_cast<float>(rng() >> 40) * 0x1p-23f - 1.0f);
  return out;
}

// The peer's prompt: per layer, keys then values, [length][kv heads][head dim] each.
struct Prompt {
  std::vector<std::vector<float>> k, v;
};

inline Prompt prompt_rows(const CacheConfig& c, std::uint64_t seed, std::int64_t length) {
  std::mt19937_64 rng(seed);
  const auto n = static_cast<std::size_t>(length) * static_cast<std::size_t>(c.shape.num_kv_heads * c.shape.head_dim);
  Prompt p;
  for (int l = 0; l < c.shape.num_layers; ++l) {
    p.k.push_back(uniform_floats(rng, n));
    p.v.push_back(uniform_floats(rng, n));
  }
  return p;
}

// The first plan's lookahead queries: one row per layer.
inline std::vector<float> lookahead_queries(const CacheConfig& c, std::uint64_t seed) {
  std::mt19937_64 rng(seed ^ 0x9e3779b97f4a7c15ull);
  return uniform_floats(rng, static_cast<std::size_t>(c.shape.num_layers * c.shape.num_q_heads * c.shape.head_dim), 4.0f);
}

// A cache holding the peer's sequence `id` (its prompt rows, every layer).
inline void fill(Cache<cpu, float>& cache, SeqId id, const Prompt& p, std::int64_t length) {
  cache.add_sequence(id);
  const std::int32_t rows[] = {static_cast<std::int32_t>(length)};
  for (int l = 0; l < cache.layout().num_layers(); ++l) {
    cache.append(std::span(&id, 1), l, rows, rows_view(p.k[static_cast<std::size_t>(l)].data(), length),
                 rows_view(p.v[static_cast<std::size_t>(l)].data(), length));
  }
}

// Counts the reads a decode cache makes through a source (on its copy thread): proof that the
// plans read remote blocks.
class CountingSource final : public RemoteBlockSource {
 public:
  explicit CountingSource(std::shared_ptr<RemoteBlockSource> inner) : inner_(std::move(inner)) {}
  void read(std::span<const RemoteBlockRead> reads) override {
    inner_->read(reads);
    reads_ += reads.size();
  }
  std::size_t reads() const { return reads_; }

 private:
  std::shared_ptr<RemoteBlockSource> inner_;
  std::atomic<std::size_t> reads_{0};
};

}  // namespace oasiskv::test::peer
