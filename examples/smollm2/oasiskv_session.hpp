// One sequence of SmolLM2 decoding through an OasisKV cache (oasiskv::Cache<cpu, T>): the
// integration an engine author reads and copies. The engine (engine/) computes every row's
// queries, keys and values and owns the attention kernel; the cache holds every row, decides which
// blocks are resident and copies them ahead of use. The protocol, per layer:
//
//   prefill    (the constructor) append the prompt's rows, prefilled densely by the engine.
//   start      one prefetch from the queries of a row at the first decode position (the draft's,
//              or the last prompt row's): the first working set.
//   step       append the current row; prefetch the next step's blocks from the lookahead row's
//              queries; attend the ticket the previous prefetch returned: the engine's attention
//              over the view (with CacheConfig::remainder, the cache's estimate of the blocks the
//              view leaves out merged in); then the MLP.
//   speculate  append the current row and the drafts (k + 1 rows), attend causally over the view;
//   accept     truncate the rejected drafts and plan the next step from the rows at the cut, for a
//              next step of next_step_rows rows.
//   remove     the request is done: its rows leave the cache.
//
// The session owns its cache and holds one sequence; a serving engine shares one cache among its
// sequences and passes them as one batch to each call.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include <oasiskv/oasiskv.hpp>

#include "dense_kv.hpp"
#include "llama_model.hpp"
#include "step_profile.hpp"

namespace smollm2 {

// The cache's model shape (layers, query and kv heads, head dim) from the engine's config.
oasiskv::ModelShape model_shape(const ModelConfig& c);

// The CPU cache's options for this engine: its pool lent to the cache, and the copies in the
// calling thread (split over the pool) rather than on a copy worker: docs/performance.md measures
// both.
oasiskv::CpuOptions engine_cache_options();

// T: the cache's element type: float, or oasiskv::fp16_t for the fp16 KV option (the prompt's
// DenseKv must then be fp16 too). The engine's rows are float; they are rounded to T on append.
template <class T>
class OasisKvSession {
 public:
  using KvCache = oasiskv::Cache<oasiskv::cpu, T>;

  // Prefill: the prompt's keys and values (prefilled densely into prompt_kv, first prompt_tokens
  // rows) are appended to the cache, layer by layer. profile: budgets by layer and kv head (null:
  // the uniform budget_tokens); options: the CPU backend's (default: engine_cache_options()).
  // Then call start().
  OasisKvSession(const LlamaModel& model, const oasiskv::CacheConfig& config, const DenseKv& prompt_kv,
                 std::int64_t prompt_tokens, const oasiskv::BudgetProfile* profile = nullptr,
                 const oasiskv::CpuOptions& options = engine_cache_options());

  // A sequence admitted from a prefill process (prefill-decode disaggregation): the cache admits
  // it from `message` and reads its prompt blocks from `source`; the message's first plan is the
  // first step's (no start()).
  OasisKvSession(const LlamaModel& model, const oasiskv::CacheConfig& config, const oasiskv::AdmissionMessage& message,
                 std::shared_ptr<oasiskv::RemoteBlockSource> source,
                 const oasiskv::CpuOptions& options = engine_cache_options());

  // The first working set: one prefetch per layer from the given queries ([layer][q_heads *
  // head_dim], e.g. dense_row_queries of the draft at the first decode position, or the prefill's
  // last row), for a first step of next_step_rows rows (1 + drafts).
  void start(const std::vector<std::vector<float>>& lookahead_queries, int next_step_rows = 1);

  // One decode step of `token` at position length(). With a draft, a lookahead row at the next
  // position runs beside it (never appended: it attends over the view plus its own k, v) and its
  // queries plan the next step; without one, the current row's queries do. Returns the current
  // row's logits.
  std::vector<float> step(std::int32_t token, std::optional<std::int32_t> draft);

  // Speculative decoding with acceptance. speculate runs `token` at position length() and the
  // drafts at the positions after it as one forward of 1 + drafts rows through the cache (every
  // row appended, causal attention over the view) and returns each row's logits: row r predicts
  // position length() + r + 1. accept(n) keeps the first n of those rows (the current one and
  // n - 1 accepted drafts): the cache truncates the rest, and every layer plans the next step from
  // the queries of the rows at and after the cut (the rejected drafts' rows stand for the next
  // tokens; with every draft accepted, the last row's), for a next step of next_step_rows rows
  // (default: as many as this one).
  std::vector<std::vector<float>> speculate(std::int32_t token, std::span<const std::int32_t> drafts);
  void accept(int rows, int next_step_rows = 0);

  // The request is done: its rows and resident blocks leave the cache (read the statistics
  // before). No step after it.
  void remove();

  std::int64_t length() const { return length_; }
  KvCache& cache() { return cache_; }
  // Per-phase times of the following step() and speculate() calls (null: off).
  void set_profile(StepProfile* profile) { profile_ = profile; }

 private:
  static constexpr oasiskv::SeqId kSequence = 1;
  // The cache's estimate of the blocks the view leaves out, merged into the attention of the
  // `rows` query rows q over the view (out, and lse: its log-sum-exp, [rows][q_heads]).
  void merge_remainder(const oasiskv::Ticket& ticket, const float* q, int rows, float* out, float* lse);

  const LlamaModel& model_;
  ModelConfig c_;
  KvCache cache_;
  bool fast_ = false;                          // the fast attention kernels (the model's fast path, or fp16 rows)
  bool merge_remainder_ = false;               // CacheConfig::remainder is not none
  std::vector<oasiskv::Ticket> tickets_;       // [layer]: the plan for the coming step
  std::vector<std::vector<float>> speculated_q_;  // [layer]: queries of the last speculate's rows
  int speculated_rows_ = 0;
  std::vector<T> k_rows_, v_rows_;             // this step's k, v in the cache's element type
  std::vector<float> lse_, rem_out_, rem_lse_;  // scratch: the view's and the remainder's states
  std::int64_t length_ = 0;                     // tokens in the cache (every layer, between steps)
  StepProfile* profile_ = nullptr;
};

// Attention of one query row over a LayerView (batch entry 0) plus optional scratch rows (in the
// view's element type: a lookahead row's own k, v, never appended); tokens of the view after
// `last_position` are left out (causal attention of a row among several). fast: the library's
// attention (oasiskv/cpu/attention.hpp: cpu_attend over the whole view, cpu_attend_query_row with
// scratch rows or an earlier last_position) on the engine's threads, else the reference
// attend_heads (float views only).
// lse (optional, [q_heads]): each head's log-sum-exp of its scaled scores, for merge_state.
template <class T>
void attend_view_row(const ModelConfig& c, const oasiskv::LayerView<T>& view, const float* q, const T* extra_k,
                     const T* extra_v, int extra_rows, float* out, std::int64_t last_position = INT64_MAX,
                     bool fast = true, float* lse = nullptr);

// A decode step's two rows over a LayerView (batch entry 0): the current row (q) and the lookahead
// row (q + q_width; it also sees its own k, v: own_k, own_v, [kv_heads][head_dim] in the view's
// element type, never appended). fast: oasiskv::cpu_attend over the view for each row, then the
// lookahead row's own k, v merged into its state; the current row's output is the same bits as
// attend_view_row's, the lookahead row's the same attention summed in another order. Not fast:
// attend_view_row for each row.
// out: [2][q_heads * head_dim]; lse (optional): [2][q_heads].
template <class T>
void attend_view_step_rows(const ModelConfig& c, const oasiskv::LayerView<T>& view, const float* q, const T* own_k,
                           const T* own_v, float* out, bool fast = true, float* lse = nullptr);

}  // namespace smollm2
