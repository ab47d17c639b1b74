// smollm2-evaluate: the teacher-forced prediction-quality evaluation (experiments/smollm2/README.md).
// Table on stdout, JSON to --json, progress on stderr.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>

#include "cli_args.hpp"
#include "evaluation.hpp"
#include "gguf_reader.hpp"
#include "model_files.hpp"
#include "thread_pool.hpp"

using namespace smollm2;

namespace {
const char* kUsage = R"(usage: smollm2-evaluate --text FILE [options]
  --model PATH            GGUF model (default: $OASISKV_MODEL_PATH, $OASISKV_MODEL_DIR, .cache/models)
  --weights FORMAT        fp32 (the reference path) | quantized (fast path, fp32 activations) |
                          quantized-int8 (fastest: int8 activations, as llama.cpp)   [fp32]
  --threads N             threads for the matrix products and attention   [1]
  --budgets LIST          tokens resident per (layer, kv head)     [256,512,1024,2048]
  --drafters LIST         oracle,ngram,early-exit,previous          [all four]
  --fetch-ratios LIST     admits per step as a share of the budget  [1.0,0.05]
  --prompt-tokens N       prompt length (0: longest the context and text allow) [0]
  --decode-tokens N       teacher-forced decode window              [512]
  --sink-tokens LIST      always-resident first tokens              [CacheConfig default]
  --recent-tokens LIST    always-resident recent window             [CacheConfig default]
  --block-tokens N                                                  [CacheConfig default]
  --reductions LIST       GQA reduction: max, sum, softmax_sum      [CacheConfig default]
  --early-exit-layers N   layers of the early-exit drafter          [8]
  --speculate LIST        drafts per target forward: 0 = lookahead only (drafts thrown away),
                          K > 0 = speculative decoding that keeps the drafts matching the text [0]
  --remainder LIST        added to the attention over the resident blocks: none, clusters, quantized
                          (the cache's estimates, CacheConfig::remainder; clusters:R sets
                          remainder_cluster_rows, quantized:B remainder_bits) or exact (the ceiling:
                          the exact non-resident attention, read from every row) [CacheConfig default];
                          NAME@L merges
                          no remainder below layer L; NAME/prefetch estimates the current row
                          from the lookahead query that planned the step, not the true query;
                          NAME*S multiplies the estimate's mass by S. Experiments read from every
                          row, as exact: mirror-groups:R (the centroid estimate over R-row groups
                          of each non-resident block), mirror-clusters:R (over k-means clusters of
                          the prompt's keys, R rows a cluster on average, restricted to
                          non-resident rows), mirror-whole-clusters:R (each cluster's means over
                          all its rows, weighted by its non-resident rows' count), mirror-quant:B
                          (the non-resident rows rounded to B bits, as quantized codes them;
                          mirror-quant:Bd with the noise offset, as quantized does;
                          mirror-quant:KxV keys at K bits, values at V)
  --scorers LIST          block scorers: quest, spread:ALPHA, runs:ROWS (CacheConfig::scorer with
                          spread_alpha / run_tokens)                [CacheConfig default: quest]
  --profiles LIST         budgets by layer and kv head: uniform, dense-first:N (layers below N get
                          every block of the window, the rest share the remaining total) or a
                          profile FILE (oasiskv::BudgetProfile, made for one budget)   [uniform]
  --calibrate-profile OUT calibrate instead: one exact run over the window records each (layer, kv
                          head)'s attention mass of its best k blocks; the water-filling profile for
                          the one --budgets value is written to OUT
  --json PATH             write the results as JSON
)";
}

int main(int argc, char** argv) try {
  const CliArgs args(argc, argv,
                     {"text", "model", "weights", "threads", "budgets", "drafters", "fetch-ratios", "prompt-tokens", "decode-tokens",
                      "sink-tokens", "recent-tokens", "block-tokens", "reductions", "early-exit-layers", "speculate", "remainder", "scorers", "profiles", "calibrate-profile", "json"},
                     {"help"});
  if (args.has("help") || !args.has("text")) {
    std::fputs(kUsage, args.has("help") ? stdout : stderr);
    return args.has("help") ? 0 : 2;
  }
  EvaluationOptions o;
  o.text_name = std::filesystem::path(args.get("text")).filename().string();
  o.budgets = args.get_list<int>("budgets", o.budgets);
  o.drafters = args.get_list<std::string>("drafters", o.drafters);
  o.fetch_ratios = args.get_list<double>("fetch-ratios", o.fetch_ratios);
  o.prompt_tokens = args.get_int("prompt-tokens", o.prompt_tokens);
  o.decode_tokens = args.get_int("decode-tokens", o.decode_tokens);
  o.sink_tokens = args.get_list<int>("sink-tokens", o.sink_tokens);
  o.recent_tokens = args.get_list<int>("recent-tokens", o.recent_tokens);
  o.block_tokens = args.get_int("block-tokens", o.block_tokens);
  o.early_exit_layers = args.get_int("early-exit-layers", o.early_exit_layers);
  o.speculate = args.get_list<int>("speculate", o.speculate);
  o.remainders = args.get_list<std::string>("remainder", o.remainders);
  o.scorers = args.get_list<std::string>("scorers", o.scorers);
  o.profiles = args.get_list<std::string>("profiles", o.profiles);
  o.calibrate_profile = args.get("calibrate-profile", "");
  for (int k : o.speculate) {
    if (k < 0) throw std::invalid_argument("--speculate: drafts per forward must be >= 0, got " + std::to_string(k));
  }
  if (args.has("reductions")) {
    o.reductions.clear();
    for (const auto& name : args.get_list<std::string>("reductions", {})) o.reductions.push_back(oasiskv::parse_reduction(name));
  }

  const auto t0 = std::chrono::steady_clock::now();
  GgufFile file(find_model(args.get("model")));
  LlamaModel model(file, parse_weight_format(args.get("weights", "fp32")));
  set_engine_threads(args.get_int("threads", 1));
  Tokenizer tokenizer(file);
  const auto tokens = tokenizer.encode(read_text_file(args.get("text")));
  std::fprintf(stderr, "model loaded, text %s: %zu tokens\n", o.text_name.c_str(), tokens.size());
  const auto result = evaluate(model, tokens, o, [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); });
  std::fputs(to_table(result).c_str(), stdout);
  if (args.has("json")) {
    std::ofstream(args.get("json")) << to_json(result);
    std::fprintf(stderr, "wrote %s\n", args.get("json").c_str());
  }
  std::fprintf(stderr, "total %.1f s\n", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "smollm2-evaluate: %s\n", e.what());
  return 1;
}
