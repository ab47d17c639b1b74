// One decode layer of the Llama-3-8B-like shape for batch 8 at a given context: the dense KV
// (for dense attention), a Cache<cpu, fp16_t> with num_layers = 1 holding the same rows, and
// lookahead queries. Built once and kept, since filling 8 x 32K tokens takes seconds.
#pragma once

#include "bench_support.hpp"

#include <memory>
#include <vector>

namespace oasiskv::bench {

struct DenseKv {
  std::int64_t context = 0;
  std::vector<fp16_t> k, v;  // [batch][context][kv_heads][head_dim]: dense_attention_reference's layout
  std::size_t bytes() const { return (k.size() + v.size()) * sizeof(fp16_t); }
  const fp16_t* keys(int seq) const { return k.data() + static_cast<std::size_t>(seq) * static_cast<std::size_t>(context) * kKvHeads * kHeadDim; }
  const fp16_t* values(int seq) const { return v.data() + static_cast<std::size_t>(seq) * static_cast<std::size_t>(context) * kKvHeads * kHeadDim; }
};

struct DecodeLayer {
  std::int64_t context = 0;
  double fetch_ratio = 1.0;
  std::unique_ptr<Cache<cpu, fp16_t>> cache;
  std::vector<SeqId> ids;
  std::vector<std::vector<float>> lookahead;  // query sets, each [batch][q_heads][head_dim]
  std::vector<float> query;                   // the step's true query, [batch][q_heads][head_dim]
};

// The dense KV of `context` tokens (one context kept at a time).
const DenseKv& dense_kv(std::int64_t context);
// A filled per-layer cache (one (context, fetch ratio) kept at a time).
DecodeLayer& decode_layer(std::int64_t context, double fetch_ratio);

}  // namespace oasiskv::bench
