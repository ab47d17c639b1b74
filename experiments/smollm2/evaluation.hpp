// The project's teacher-forced prediction-quality protocol (its steps and metrics are written up
// in experiments/smollm2/README.md, "The protocol" and "What is measured"): a dense reference
// run, then one sparse run (an ExperimentSession) per (budget, drafter, speculate, fetch ratio,
// reduction, sinks, recent window, remainder, scorer, profile), all over the same prompt and
// decode window; or, with calibrate_profile, one calibration run.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <oasiskv/config.hpp>

#include "llama_model.hpp"
#include "tokenizer.hpp"

namespace smollm2 {

struct EvaluationOptions {
  std::string model_name = "SmolLM2-135M-Instruct.Q4_1";
  std::string text_name;
  std::vector<int> budgets{256, 512, 1024, 2048};
  std::vector<std::string> drafters{"oracle", "ngram", "early-exit", "previous"};
  std::vector<double> fetch_ratios{1.0, 0.05};
  int prompt_tokens = 0;  // 0: as long as the context and the text allow
  int decode_tokens = 512;
  int block_tokens = oasiskv::CacheConfig{}.block_tokens;
  // Each run is one combination of budget, drafter, fetch ratio, reduction, sinks and recent
  // window (the last three are lists so that ablations share one dense reference).
  // Defaults follow the library's CacheConfig, so the evaluation measures what users get.
  std::vector<int> sink_tokens{oasiskv::CacheConfig{}.sink_tokens};
  std::vector<int> recent_tokens{oasiskv::CacheConfig{}.recent_tokens};
  std::vector<oasiskv::GroupReduction> reductions{oasiskv::CacheConfig{}.reduction};
  int early_exit_layers = 8;
  // Drafts per target forward: 0 is lookahead only (the drafts are a prefetch signal and then
  // thrown away: "force-rejected"); K > 0 is speculative decoding with acceptance (K drafts and the
  // current token in one forward, the prefix that matches the text kept, the rest truncated).
  std::vector<int> speculate{0};
  // What each run adds to its attention over the resident blocks (a list, as another ablation
  // dimension): none, a cache estimate (oasiskv::parse_remainder: clusters, quantized), or
  // exact (the ceiling: the exact attention over the non-resident blocks, a cheat that reads every
  // row).
  std::vector<std::string> remainders{std::string(oasiskv::remainder_name(oasiskv::CacheConfig{}.remainder))};
  // Block scorers (another ablation dimension): NAME[:PARAM], apply_scorer's syntax (cli_args.hpp).
  std::vector<std::string> scorers{std::string(oasiskv::block_score_name(oasiskv::CacheConfig{}.scorer))};
  // Budgets by layer and kv head (a list, as another ablation dimension): uniform (every head
  // budget_tokens), dense-first:N (oasiskv::BudgetProfile::first_layers_dense: layers below N get
  // every block of the window, the rest share what is left) or a profile file (BudgetProfile::load;
  // made for one total budget).
  std::vector<std::string> profiles{"uniform"};
  // Not empty: calibrate instead of evaluating. One run with every block resident (exact
  // attention) records each (layer, kv head)'s mass-vs-budget curve over the decode window, and
  // the profile BudgetProfile::from_mass_curves makes of them for the one budget of `budgets` is
  // saved to this path.
  std::string calibrate_profile;
};

struct RunResult {
  int budget = 0;
  std::string drafter;
  double fetch_ratio = 1.0;
  oasiskv::GroupReduction reduction = oasiskv::GroupReduction::max;
  int sink_tokens = 0, recent_tokens = 0;
  double agreement_mean = 0, agreement_p5 = 0;
  double mass_recall_mean = 0, mass_recall_p5 = 0, exact_topk_mass_mean = 0;
  double attn_rel_err_mean = 0;
  double top1_agreement = 0, kl_mean = 0, ppl = 0;
  double blocks_fetched_per_step = 0, bytes_fetched_per_step = 0, capped_per_step = 0;
  double draft_accuracy = 0;    // share of steps whose draft equals the true next token
  double drafted_share = 0;     // share of steps (forwards, with speculate) that had a draft
  double resident_recall = 0;   // the cache's own observe() statistic (hit rate of the true query's top-K)
  int speculate = 0;            // drafts per target forward (0: lookahead only)
  double acceptance = 0;        // accepted / proposed drafts (speculate > 0)
  double tokens_per_forward = 1;
  int forwards = 0;             // target forwards over the window
  double blocks_fetched_per_forward = 0;
  double seconds = 0;
  std::vector<double> agreement_by_layer, mass_recall_by_layer;  // means over steps and kv heads
  std::string remainder = "none";
  std::string scorer = "quest";  // the --scorers entry of the run
  std::string profile = "uniform";
  // With a remainder: the true query's attention mass outside the resident blocks and the share
  // the remainder state claims, per (step, layer, query head): means, the bias (estimate - true)
  // and the correlation; by layer, the means of both.
  double dropped_mass_true_mean = 0, dropped_mass_est_mean = 0, dropped_mass_bias = 0, dropped_mass_corr = 0;
  std::vector<double> dropped_mass_true_by_layer, dropped_mass_est_by_layer, attn_rel_err_by_layer;
  // At each step whose top-1 differs from dense's: dense's margin there, its best log-probability
  // minus its second best (how near a tie the flip was).
  std::vector<double> top1_flip_margins;
};

struct EvaluationResult {
  EvaluationOptions options;
  int prompt_tokens = 0;
  int decode_tokens = 0;
  double dense_ppl = 0;
  double dense_seconds = 0;
  std::vector<RunResult> runs;
};

using Progress = std::function<void(const std::string&)>;

EvaluationResult evaluate(const LlamaModel& model, const std::vector<std::int32_t>& text_tokens,
                          const EvaluationOptions& options, const Progress& progress);

std::string to_json(const EvaluationResult& result);
std::string to_table(const EvaluationResult& result);

}  // namespace smollm2
