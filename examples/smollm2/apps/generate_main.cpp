// smollm2-generate: free greedy generation, dense and through OasisKV side by side, with tokens/s.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>
#include <thread>

#include <fmt/format.h>

#include <oasiskv/cpu/isa.hpp>

#include "cli_args.hpp"
#include "dense_attention.hpp"
#include "drafters.hpp"
#include "gguf_reader.hpp"
#include "model_files.hpp"
#include "oasiskv_session.hpp"
#include "step_profile.hpp"
#include "thread_pool.hpp"
#include "tokenizer.hpp"

using namespace smollm2;

namespace {
const char* kUsage = R"(usage: smollm2-generate (--prompt TEXT | --prompt-file FILE) [options]
  --model PATH           GGUF model (default: $OASISKV_MODEL_PATH, $OASISKV_MODEL_DIR, .cache/models)
  --weights FORMAT       quantized-int8 (Q4_1 / Q8_0 as in the file, int8 activations, as llama.cpp:
                         the fastest) | quantized (fp32 activations) | fp32 (dequantised at load:
                         the reference path)   [quantized-int8]
  --threads N            threads for the matrix products and attention   [all cores]
  --kv PRECISION         fp16 | fp32: the KV rows of both the dense cache and the OasisKV cache
                         (fp16 is llama.cpp's default)   [fp16]
  --tokens N             tokens to generate (at most; stops at end-of-sequence) [64]
  --ignore-eos           keep generating past end-of-sequence
  --chat                 wrap the prompt in the model's chat template (user turn)
  --prompt-tokens N      keep only the last N prompt tokens (0: all) [0]
  --budget N             OasisKV tokens per (layer, kv head)   [256]
  --drafter NAME         ngram: prompt lookup, a lookahead row when the last 2-3 tokens occurred
                         before (ngram:N: a match of at least N tokens; ngram:0 a row every step)
                         | previous (no lookahead row) [ngram]
                         (oracle and early-exit are the evaluation's: experiments/smollm2)
  --fetch-ratio R                                              [1.0]
  --sink-tokens N / --recent-tokens N / --reduction R   [CacheConfig defaults]
  --scorer S             block scorer: quest | spread:ALPHA | runs[:ROWS] (run_tokens) [quest]
  --speculate K          speculative decoding with acceptance: the drafter proposes up to K tokens,
                         the target runs the current token and the drafts in one forward through the
                         cache, greedy verification keeps the matching prefix, the cache truncates
                         the rest   [0: lookahead only]
  --copy-thread on|off   where the cache's block copies run: on (its own worker thread) or off (in
                         the call that lets them start, split over the engine's threads)   [off]
  --profile              per-phase time of a decode step, dense and OasisKV: weight products,
                         attention, each cache call, the copies, the pool's threads
  --print-ids            also print the token ids: prompt, dense and OasisKV outputs (one line
                         each, "prompt ids: 1 2 3"), for comparisons with other engines
                         (examples/python checks its tokens against these)
)";

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }
std::int32_t argmax(const std::vector<float>& v) {
  return static_cast<std::int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}
// --copy-thread: on or off.
bool parse_copy_thread(const std::string& value) {
  if (value == "on") return true;
  if (value == "off") return false;
  throw std::invalid_argument("--copy-thread " + value + ": use on or off");
}

// The --profile table: milliseconds per decode step by phase, dense beside OasisKV.
void print_profile(const StepProfile& dense, const ThreadPool::Times& dense_pool, const StepProfile& sparse,
                   const ThreadPool::Times& sparse_pool, const oasiskv::LayerStatistics& stats, bool copy_thread) {
  auto ms = [](std::int64_t ns, const StepProfile& p) {
    return static_cast<double>(ns) / 1e6 / static_cast<double>(std::max<std::int64_t>(1, p.steps));
  };
  auto row = [&](const char* name, std::int64_t StepProfile::*field) {
    std::printf("  %-38s %8.3f %8.3f\n", name, ms(dense.*field, dense), ms(sparse.*field, sparse));
  };
  auto other = [&](const StepProfile& p) {
    return p.total_ns - p.qkv_ns - p.attention_ns - p.output_mlp_ns - p.logits_ns - p.append_ns - p.prefetch_ns -
           p.attend_cache_ns;
  };
  std::printf("profile: ms per decode step (%lld dense steps, %lld OasisKV steps)\n",
              static_cast<long long>(dense.steps), static_cast<long long>(sparse.steps));
  std::printf("  %-38s %8s %8s\n", "phase", "dense", "OasisKV");
  row("q/k/v products (norm, RoPE)", &StepProfile::qkv_ns);
  row("attention kernel", &StepProfile::attention_ns);
  row("output product + MLP", &StepProfile::output_mlp_ns);
  row("LM head", &StepProfile::logits_ns);
  row("append (dense: KV write)", &StepProfile::append_ns);
  row("prefetch (scoring, top-K, plan)", &StepProfile::prefetch_ns);
  row("attend less kernel (acquire, release)", &StepProfile::attend_cache_ns);
  std::printf("  %-38s %8.3f %8.3f\n", "other (embedding, buffers)", ms(other(dense), dense), ms(other(sparse), sparse));
  row("step", &StepProfile::total_ns);
  std::printf("  cache: acquire waited %.3f ms/step; copies ran %.3f ms/step (%s)\n", ms(stats.acquire_wait_ns, sparse),
              ms(stats.copy_ns, sparse), copy_thread ? "copy worker thread" : "in the caller");
  auto pool = [&](const char* name, const ThreadPool::Times& t, const StepProfile& p) {
    std::printf("  pool (%s, summed over threads): %.0f regions/step, busy %.3f, spinning %.3f, asleep %.3f, caller waits %.3f ms/step\n",
                name, static_cast<double>(t.regions) / static_cast<double>(std::max<std::int64_t>(1, p.steps)),
                ms(t.busy_ns, p), ms(t.spin_ns, p), ms(t.sleep_ns, p), ms(t.caller_wait_ns, p));
  };
  pool("dense", dense_pool, dense);
  pool("OasisKV", sparse_pool, sparse);
}
}  // namespace

int main(int argc, char** argv) try {
  const CliArgs args(argc, argv,
                     {"prompt", "prompt-file", "model", "tokens", "prompt-tokens", "budget", "drafter", "fetch-ratio",
                      "sink-tokens", "recent-tokens", "reduction", "scorer", "speculate", "weights",
                      "threads", "kv", "copy-thread"},
                     {"help", "chat", "ignore-eos", "print-ids", "profile"});
  if (args.has("help") || (!args.has("prompt") && !args.has("prompt-file"))) {
    std::fputs(kUsage, args.has("help") ? stdout : stderr);
    return args.has("help") ? 0 : 2;
  }
  // The instruction-set level the library's and the engine's kernels run at, beside the CPU's
  // name (an OASISKV_CPU_ISA that cannot be honoured stops here, naming it).
  const std::string cpu = oasiskv::cpu_isa_description();
  GgufFile file(find_model(args.get("model")));
  const std::string weights = args.get("weights", "quantized-int8");
  LlamaModel model(file, parse_weight_format(weights));
  set_engine_threads(args.get_int("threads", static_cast<int>(std::max(1u, std::thread::hardware_concurrency()))));
  const KvPrecision precision = parse_kv_precision(args.get("kv", "fp16"));
  Tokenizer tokenizer(file);
  const ModelConfig& c = model.config();
  std::string prompt = args.has("prompt") ? args.get("prompt") : read_text_file(args.get("prompt-file"));
  if (args.has("chat")) prompt = "<|im_start|>user\n" + prompt + "<|im_end|>\n<|im_start|>assistant\n";
  auto tokens = tokenizer.encode(prompt, /*parse_special=*/args.has("chat"));
  const int keep = args.get_int("prompt-tokens", 0);
  if (keep > 0 && static_cast<int>(tokens.size()) > keep) tokens.erase(tokens.begin(), tokens.end() - keep);
  const int n_new = args.get_int("tokens", 64);
  const int speculate = args.get_int("speculate", 0);
  if (speculate < 0) throw std::invalid_argument("--speculate must be >= 0");
  const std::int64_t capacity = static_cast<std::int64_t>(tokens.size()) + n_new + 2 + speculate;
  if (capacity > c.context_length) throw std::invalid_argument("prompt + tokens exceed the model context");
  const std::string drafter_name = args.get("drafter", "ngram");
  const std::unique_ptr<Drafter> drafter = make_drafter(drafter_name);

  auto t0 = Clock::now();
  DenseKv kv(c.num_layers, c.kv_width(), capacity, precision);
  const PrefillResult pre = prefill(model, kv, tokens);
  const double prefill_s = since(t0);
  const std::int64_t P = static_cast<std::int64_t>(tokens.size());

  // Dense greedy decode.
  t0 = Clock::now();
  const bool stop_at_eos = !args.has("ignore-eos");
  auto finished = [&](const std::vector<std::int32_t>& out) {
    return static_cast<int>(out.size()) >= n_new || (stop_at_eos && out.back() == tokenizer.eos_id());
  };
  const bool profiling = args.has("profile");
  StepProfile dense_profile, sparse_profile;
  ThreadPool::Times dense_pool, sparse_pool;
  engine_pool().set_profiling(profiling);
  engine_pool().reset_times();
  std::vector<std::int32_t> dense_out{argmax(pre.last_logits)};
  while (!finished(dense_out)) {
    dense_out.push_back(argmax(dense_decode_step(model, kv, dense_out.back(), nullptr, profiling ? &dense_profile : nullptr)));
  }
  const double dense_s = since(t0);
  dense_pool = engine_pool().times();
  kv.truncate(P);

  // OasisKV decode from the same prefill.
  oasiskv::CacheConfig config;
  config.shape = model_shape(c);
  config.budget_tokens = args.get_int("budget", 256);
  config.sink_tokens = args.get_int("sink-tokens", config.sink_tokens);
  config.recent_tokens = args.get_int("recent-tokens", config.recent_tokens);
  if (args.has("reduction")) config.reduction = oasiskv::parse_reduction(args.get("reduction"));
  if (args.has("scorer")) apply_scorer(args.get("scorer"), config);
  config.fetch_ratio = args.get_double("fetch-ratio", 1.0);
  config.max_sequences = 1;
  config.max_tokens_per_sequence = capacity;
  std::vector<std::int32_t> sparse_out{dense_out.front()};  // the first token comes from the dense prefill
  std::int64_t forwards = 0, proposed = 0, accepted = 0, drafted = 0;  // drafted: forwards with a draft
  oasiskv::LayerStatistics stats, start_stats;  // the decode loop's; the first working set's
  // The OasisKV cache holds the dense cache's element type.
  oasiskv::CpuOptions options = engine_cache_options();
  if (args.has("copy-thread")) options.copy_thread = parse_copy_thread(args.get("copy-thread"));
  // Timed apart: filling the cache with the prompt's rows and planning the first working set are
  // prefill work (once per request); the decode loop is what tokens/s compares with dense.
  double fill_s = 0, start_s = 0, sparse_s = 0;
  auto run_sparse = [&]<class T>() {
    auto t = Clock::now();
    OasisKvSession<T> session(model, config, kv, P, nullptr, options);
    fill_s = since(t);
    t = Clock::now();
    std::vector<std::int32_t> history = tokens;
    history.push_back(sparse_out.back());
    // The first working set: planned from the queries of the draft's row at the first decode
    // position, which attends densely over the prompt's rows in float (an fp16 prefill's rows
    // widened; the row's own k, v not rounded); without a draft, from the last prompt row's.
    if (const auto first_draft = drafter->draft(history, -1)) {
      session.start(dense_row_queries(model, kv.to_fp32(P), *first_draft, static_cast<std::int32_t>(P)), 1 + speculate);
    } else {
      session.start(pre.last_queries, 1 + speculate);
    }
    start_s = since(t);
    // Profile the steps only (not the first working set's planning above).
    session.set_profile(profiling ? &sparse_profile : nullptr);
    start_stats = session.cache().statistics().total();
    session.cache().reset_statistics();
    engine_pool().reset_times();
    t = Clock::now();
    while (!finished(sparse_out)) {
      ++forwards;
      if (speculate == 0) {
        const auto draft = drafter->draft(history, -1);  // none: this step has no lookahead row
        drafted += draft.has_value();
        sparse_out.push_back(argmax(session.step(history.back(), draft)));
        history.push_back(sparse_out.back());
        continue;
      }
      // Speculate: K drafts, one forward of K + 1 rows, keep the prefix the target agrees with.
      std::vector<std::int32_t> drafts, scratch = history;
      for (int i = 0; i < speculate; ++i) {  // the drafter's chain ends where it has no proposal
        const auto d = drafter->draft(scratch, -1);
        if (!d) break;
        scratch.push_back(drafts.emplace_back(*d));
      }
      const int k = static_cast<int>(drafts.size());
      drafted += k > 0;
      const auto logits = session.speculate(history.back(), drafts);
      int a = 0;
      while (a < k && argmax(logits[static_cast<std::size_t>(a)]) == drafts[static_cast<std::size_t>(a)]) ++a;
      session.accept(a + 1, 1 + speculate);  // the next forward carries up to K + 1 rows
      proposed += k;
      accepted += a;
      for (int i = 0; i <= a && !finished(sparse_out); ++i) {
        sparse_out.push_back(i < a ? drafts[static_cast<std::size_t>(i)] : argmax(logits[static_cast<std::size_t>(a)]));
        history.push_back(sparse_out.back());
      }
    }
    sparse_s = since(t);
    stats = session.cache().statistics().total();
    sparse_pool = engine_pool().times();
    session.remove();
  };
  if (precision == KvPrecision::fp16) {
    run_sparse.template operator()<oasiskv::fp16_t>();
  } else {
    run_sparse.template operator()<float>();
  }

  std::size_t same = 0;
  while (same < dense_out.size() && same < sparse_out.size() && dense_out[same] == sparse_out[same]) ++same;
  const double dense_steps = std::max<double>(1.0, static_cast<double>(dense_out.size()) - 1);
  const double sparse_steps = std::max<double>(1.0, static_cast<double>(sparse_out.size()) - 1);
  std::printf("weights %s, KV %s, %d thread(s), %s\n", weights.c_str(), kv_precision_name(precision),
              engine_threads(), cpu.c_str());
  std::printf("prompt: %lld tokens, prefill %.2f s (%.0f tokens/s)\n", static_cast<long long>(P), prefill_s, P / prefill_s);
  const double dense_rate = dense_steps / dense_s, sparse_rate = sparse_steps / sparse_s;
  std::printf("=== dense (%.2f tokens/s) ===\n%s\n", dense_rate, tokenizer.decode(dense_out).c_str());
  std::printf("=== OasisKV budget %d, drafter %s (a draft in %lld of %lld forwards), fetch ratio %g (%.2f tokens/s "
              "incl. lookahead rows) ===\n%s\n",
              config.budget_tokens, drafter_name.c_str(), static_cast<long long>(drafted),
              static_cast<long long>(forwards), config.fetch_ratio, sparse_rate, tokenizer.decode(sparse_out).c_str());
  // Prefill work of the sparse path, once per request (not in its tokens/s, as the dense
  // prefill is not in dense's).
  std::printf("OasisKV before decoding: the prompt's rows into the cache %.3f s, the first working set %.3f s\n",
              fill_s, start_s);
  const double ratio = sparse_rate / dense_rate;
  std::printf("OasisKV decodes at %.2fx dense's speed here (%s, %d thread(s))%s\n", ratio, cpu.c_str(),
              engine_threads(), ratio < 1.0 ? ": SLOWER than dense on this machine" : "");
  // All blocks fetched (what another engine planning the same working sets moves), then the part the
  // decode loop moved per target forward.
  std::printf("identical for the first %zu of %zu tokens; blocks fetched %llu (the first working set %llu, then %.1f per "
              "target forward), capped %llu\n",
              same, dense_out.size(), static_cast<unsigned long long>(start_stats.blocks_fetched + stats.blocks_fetched),
              static_cast<unsigned long long>(start_stats.blocks_fetched),
              static_cast<double>(stats.blocks_fetched) / static_cast<double>(std::max<std::int64_t>(1, forwards)),
              static_cast<unsigned long long>(start_stats.admits_capped + stats.admits_capped));
  if (profiling) {
    print_profile(dense_profile, dense_pool, sparse_profile, sparse_pool, stats, options.copy_thread);
  }
  if (args.has("print-ids")) {
    auto ids = [](const char* what, const std::vector<std::int32_t>& v) {
      std::printf("%s ids:", what);
      for (const std::int32_t t : v) std::printf(" %d", t);
      std::printf("\n");
    };
    ids("prompt", tokens);
    ids("dense", dense_out);
    ids("oasiskv", sparse_out);
  }
  if (speculate > 0) {
    std::printf("speculate %d: acceptance %.3f (%lld of %lld drafts), %.2f tokens per target forward (%lld forwards)\n",
                speculate, proposed > 0 ? static_cast<double>(accepted) / static_cast<double>(proposed) : 0.0,
                static_cast<long long>(accepted), static_cast<long long>(proposed),
                static_cast<double>(sparse_out.size() - 1) / static_cast<double>(std::max<std::int64_t>(1, forwards)),
                static_cast<long long>(forwards));
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "smollm2-generate: %s\n", e.what());
  return 1;
}
