// Dense attention paths of the engine: prefill (causal, many rows) and one decode row over the
// full DenseKv plus optional scratch rows that are not in the cache (a draft token's own k, v).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "dense_kv.hpp"
#include "llama_model.hpp"
#include "step_profile.hpp"

namespace smollm2 {

// One query row ([q_heads][head_dim]) over tokens [0, n) of `layer` and `extra_rows` scratch
// rows (k, v: [extra_rows][kv_heads][head_dim]). out: [q_heads][head_dim]. fast: the fast path's
// kernels (the library's oasiskv/cpu/attention.hpp; always for an fp16 cache), else the reference attend_heads.
void attend_dense_row(const ModelConfig& c, const DenseKv& kv, int layer, std::int64_t n, const float* q,
                      const float* extra_k, const float* extra_v, int extra_rows, float* out, bool fast = false);

// Softmax attention weights of one query head over tokens [0, n): probs[n]. Float caches only.
void attention_probabilities(const ModelConfig& c, const DenseKv& kv, int layer, std::int64_t n,
                             const float* q_head, int kv_head, float* probs);

struct PrefillResult {
  std::vector<float> last_logits;                 // [vocab] of the last prompt token
  std::vector<std::vector<float>> last_queries;   // [layer][q_heads * head_dim] of the last token
  std::vector<float> all_logits;                  // [tokens][vocab] when requested
};

// Dense causal prefill of `tokens` at positions [kv.length(0), ...), appending to kv. Processes
// rows in chunks so activations stay small while weight rows are reused across a chunk.
PrefillResult prefill(const LlamaModel& model, DenseKv& kv, std::span<const std::int32_t> tokens,
                      bool keep_all_logits = false, int chunk_rows = 64);

// One dense decode step for one token at position kv.length(0): appends its k, v, returns logits.
// If queries is not null it receives [layer][q_heads * head_dim]; profile (optional) gets the
// step's phases.
std::vector<float> dense_decode_step(const LlamaModel& model, DenseKv& kv, std::int32_t token,
                                     std::vector<std::vector<float>>* queries = nullptr,
                                     StepProfile* profile = nullptr);

}  // namespace smollm2

namespace smollm2 {

// Per-layer queries ([layer][q_heads * head_dim]) of `token` at `position`, attending densely to
// tokens [0, position) of kv and to itself; kv is not modified. Gives the lookahead row that
// picks the first working set after a prefill.
std::vector<std::vector<float>> dense_row_queries(const LlamaModel& model, const DenseKv& kv, std::int32_t token,
                                                  std::int32_t position);

}  // namespace smollm2
