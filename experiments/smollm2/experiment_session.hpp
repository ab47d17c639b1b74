// The evaluation's decode session: the protocol of OasisKvSession (examples/smollm2/
// oasiskv_session.hpp) step for step (the same appends, prefetches, attention and remainder merge,
// hence the same logits and blocks fetched: tests/model/test_experiment_session.cpp checks it), plus
// what only an experiment needs: a float mirror of every key and value the cache holds, the
// per-step measurements against it (StepMetrics: agreement of the planned and the true selection,
// attention-mass recall, attention error, the remainder's dropped mass, mass-vs-budget curves for
// calibration), and remainder variants computed from the mirror (the exact ceiling, finer or
// key-clustered centroid groups, a low-bit copy of the tail) or steered differently (first layer,
// mass scale, the lookahead query). The mirror reads every row: none of this belongs in an engine.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include <oasiskv/oasiskv.hpp>

#include "dense_kv.hpp"
#include "llama_model.hpp"
#include "oasiskv_session.hpp"  // model_shape, attend_view_row

namespace smollm2 {

// Per-step measurements. Indexed [layer * kv_heads + kv_head] unless stated.
struct StepMetrics {
  std::vector<double> agreement;        // |S_draft and S_true| / |S_true| (empty entries skipped: NaN)
  std::vector<double> mass_recall;      // true query's attention mass inside the resident blocks
  std::vector<double> exact_topk_mass;  // mass inside the best possible resident set of that size
  std::vector<double> attn_rel_err;     // [layer]: ||out_sparse - out_dense|| / ||out_dense||
  // With a remainder (ExperimentSession::remainder() not none): per [layer * q_heads + q head], the
  // true query's attention mass outside the resident blocks, and the share the remainder state
  // claims (its mass over the resident attention's plus its own). NaN without a remainder.
  std::vector<double> dropped_mass_true, dropped_mass_est;
  // Set by the caller to get topk_mass_curve: per [layer * kv_heads + kv_head], the true query's
  // mass (over the group, / group size) inside the pinned blocks plus the best k candidate blocks,
  // k = 0 .. the candidates (the mass-vs-budget curve a BudgetProfile is calibrated from).
  bool want_curves = false;
  std::vector<std::vector<double>> topk_mass_curve;
};

// What the session adds to the attention over the resident blocks: nothing; the cache's estimate
// (CacheConfig::remainder, which must then not be none); or, as a ceiling, the exact attention
// over the non-resident blocks computed from the mirror's rows (a cheat: it reads every row).
// grouped and clustered are experiments that ask how much a finer or better-shaped summary of the
// same kind would give, computed from the mirror (they read every row, as exact does): the
// centroid estimate (count x exp(scale q.mean key), mean value) over groups of
// remainder_group_rows consecutive rows of each non-resident block (16: the cache's centroid), or
// over k-means clusters of the prompt's keys (per layer and kv head, about remainder_group_rows
// rows a cluster, within segments of 1,024 rows) restricted to their non-resident rows.
// quantized: the exact attention over the non-resident rows with their keys and values rounded to
// remainder_bits bits (keys per channel over each block, values per row in groups of 32 channels,
// min/max asymmetric; values at remainder_value_bits where set apart), from the mirror: what a
// low-bit copy of the tail would give.
enum class RemainderMode { none, estimate, exact, grouped, clustered, quantized };

// Which query the estimate of step t uses for the current row: the true query, known only when
// the step's attention runs (the estimate then sits on the step's critical path), or the
// lookahead query of the same position planned in step t - 1 (known at prefetch time, so the
// estimate could run beside the copies, off the critical path). The lookahead row of a step has no
// earlier query and always uses its own.
enum class RemainderQuery { attend, prefetch };

// T: the cache's element type (float, or oasiskv::fp16_t for the fp16 KV option; then the prompt's
// DenseKv must be fp16 too and the mirror holds its rows widened to float).
template <class T>
class ExperimentSession {
 public:
  using KvCache = oasiskv::Cache<oasiskv::cpu, T>;
  // The prompt's keys and values (prefilled densely) are copied from prompt_kv, first
  // prompt_tokens rows, into the cache and into this session's mirror (of `capacity` rows: the
  // prompt and every row the run appends). profile: budgets by layer and kv head (null: the
  // uniform budget_tokens).
  ExperimentSession(const LlamaModel& model, const oasiskv::CacheConfig& config, const DenseKv& prompt_kv,
                    std::int64_t prompt_tokens, std::int64_t capacity, const oasiskv::BudgetProfile* profile = nullptr);

  // First working set: one prefetch per layer from the given lookahead queries
  // ([layer][q_heads * head_dim]), for a first step of next_step_rows rows (1 + drafts).
  void start(const std::vector<std::vector<float>>& lookahead_queries, int next_step_rows = 1);

  // One decode step of `token` at position length(). With a draft token, a lookahead row at the
  // next position plans the next step; without one the current row's queries do. Returns the
  // current row's logits. With `metrics`, fills it (costs a dense pass over the mirror).
  std::vector<float> step(std::int32_t token, std::optional<std::int32_t> draft, StepMetrics* metrics);

  // Speculative decoding with acceptance. speculate runs `token` at position length() and the
  // drafts at the positions after it as one forward of 1 + drafts rows through the cache (append of
  // every row, causal attention over the resident blocks) and returns each row's logits: row r
  // predicts position length() + r + 1. accept(n) keeps the first n of those rows (the current one
  // and n - 1 accepted drafts): the cache and the mirror truncate the rest, and every layer plans
  // the next step from the queries of the rows at and after the cut (the rejected drafts' rows
  // stand for the next tokens; with every draft accepted, the last row's), for a next step of
  // next_step_rows rows (default: as many as this one).
  // With `metrics`, measures the current row (row 0) as step() measures its row: against the
  // resident set planned from the previous forward's rows.
  std::vector<std::vector<float>> speculate(std::int32_t token, std::span<const std::int32_t> drafts,
                                            StepMetrics* metrics = nullptr);
  void accept(int rows, int next_step_rows = 0);

  // The remainder merged into every step's attention (default: estimate when the config has one,
  // else none, as OasisKvSession does). estimate needs CacheConfig::remainder; the others read the
  // mirror.
  void set_remainder(RemainderMode mode);
  RemainderMode remainder() const { return remainder_; }
  // Layers below `layer` attend over the resident blocks only (no remainder merged); default 0.
  void set_remainder_first_layer(int layer) { remainder_first_layer_ = layer; }
  // The query the estimate uses for the current row (default attend). The exact ceiling always
  // uses the true query.
  void set_remainder_query(RemainderQuery query) { remainder_query_ = query; }
  // Multiplies the estimate's mass (not the exact ceiling's) by `scale` before merging: 1 keeps it.
  void set_remainder_mass_scale(float scale) { remainder_mass_scale_ = scale; }
  // Rows per group (grouped) or mean rows per cluster (clustered).
  void set_remainder_group_rows(int rows) { remainder_group_rows_ = rows; }
  // clustered: each cluster's means over all its rows (resident too), weighted by its count of
  // non-resident rows (what a cache could do from its resident blocks' cluster ids alone).
  void set_remainder_whole_clusters(bool whole) { remainder_whole_clusters_ = whole; }
  // quantized: key and value bits of the mirror's quantized remainder (value_bits 0: the key bits).
  void set_remainder_bits(int bits, int value_bits = 0) {
    remainder_bits_ = bits;
    remainder_value_bits_ = value_bits > 0 ? value_bits : bits;
  }
  // quantized: lower each logit by half its expected rounding-noise variance.
  void set_remainder_debias(bool debias) { remainder_debias_ = debias; }

  std::int64_t length() const { return length_; }
  const DenseKv& mirror() const { return mirror_; }
  KvCache& cache() { return cache_; }

 private:
  static constexpr oasiskv::SeqId kSequence = 1;
  // Row q_current at causal length n (the mirror's rows [0, n)) against the view.
  void measure(int layer, const float* q_current, const oasiskv::LayerView<T>& view, const float* sparse_out,
               std::int64_t n, StepMetrics& m);
  void reset_metrics(StepMetrics& m) const;
  void measure_agreement(int layer, const float* q_current, StepMetrics& m);
  void mirror_append(int layer, int rows);  // k_rows_, v_rows_ (rows of them) into the mirror
  // The remainder state of the `rows` query rows q over the blocks the view leaves out, merged into
  // out (their attention over the view, whose log-sum-exp is lse [rows][q_heads]). Keeps the
  // first row's states for measure().
  void merge_remainder(int layer, const oasiskv::Ticket& ticket, const oasiskv::LayerView<T>& view, const float* q,
                       int rows, float* out, float* lse);

  const LlamaModel& model_;
  ModelConfig c_;
  KvCache cache_;
  DenseKv mirror_;
  std::vector<oasiskv::Ticket> tickets_;                       // [layer]: plan for the coming step
  std::vector<std::vector<std::vector<std::int32_t>>> drafted_;  // [layer][kv head]: S_draft
  std::vector<std::vector<float>> speculated_q_;                 // [layer]: queries of the last speculate's rows
  int speculated_rows_ = 0;
  bool fast_ = false;       // the fast attention kernels (the model's fast path, or fp16 rows)
  std::vector<T> k_rows_, v_rows_;  // this step's k, v in the cache's element type
  RemainderMode remainder_ = RemainderMode::none;
  int remainder_first_layer_ = 0;
  float remainder_mass_scale_ = 1.0f;
  int remainder_group_rows_ = 16;
  bool remainder_whole_clusters_ = false;
  int remainder_bits_ = 4;
  int remainder_value_bits_ = 4;
  bool remainder_debias_ = false;
  // clustered: per layer, per kv head, the cluster of each clustered row (the prompt's), made on
  // first use.
  std::vector<std::vector<std::vector<std::int32_t>>> cluster_of_;
  std::vector<std::int32_t> cluster_count_;  // [layer * kv_heads + kv head]
  void make_clusters(int layer);
  void quantize_block(int layer, int h, std::int64_t t0, std::int64_t t1, std::vector<float>& k, std::vector<float>& v) const;
  void mirror_estimate(int layer, const oasiskv::LayerView<T>& view, const float* q, int rows);
  RemainderQuery remainder_query_ = RemainderQuery::attend;
  std::vector<std::vector<float>> planned_q_;  // [layer]: the lookahead query that planned the coming step
  std::vector<float> rem_q_;                    // scratch: the queries the estimate uses
  std::vector<float> lse_, rem_out_, rem_lse_;  // scratch of merge_remainder
  std::vector<float> row0_lse_, row0_rem_lse_;  // the first row's view and remainder lse, for measure()
  std::int64_t length_ = 0;  // tokens in the cache (every layer, between steps)
};

}  // namespace smollm2
