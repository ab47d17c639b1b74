// oasiskv_engine_bench: end-to-end SmolLM2-135M engine benchmarks (examples/smollm2), measured with
// Google Benchmark so that scripts/bench-report can set them against llama.cpp's llama-bench
// (scripts/llama-cpp-bench) measured in the same scripts/bench run, and sparse decode against this
// engine's own dense decode.
//
// BM_EngineDecode/mode:M/context:C/threads:T  teacher-forced decode at context depth C, as
//   llama-bench's `-p 0 -n N -d C` does: the first C tokens of the text are prefilled (untimed,
//   once, shared by every benchmark at that depth), then each iteration is one decode step of the
//   text's next token (one untimed warm-up step first). mode:dense is dense_decode_step over the
//   fp16 DenseKv; mode:sparse is an OasisKvSession<fp16_t> (examples/smollm2/oasiskv_session.hpp;
//   budget 256 tokens per layer and kv head at context 1,024, else 1,024, as scripts/demo runs
//   them; the session's default options: engine_cache_options) built from the same prefill, steered by the n-gram
//   drafter's lookahead row as smollm2-generate does by default (a step runs the current token and,
//   when the last 2-3 tokens occurred before, the lookahead row; the counter lookahead_share is the
//   share of steps that had one). mode:sparse_previous is the same session without the lookahead row:
//   the current row's queries plan the next step (smollm2-generate --drafter previous), one row a
//   step as dense.
// BM_EnginePrefill/tokens:4096/threads:T  one dense prefill of the text's first 4,096 tokens per
//   iteration, into a fresh fp16 DenseKv.
//
// Weights quantized-int8 (the engine's fastest path, llama.cpp's activation quantisation), KV fp16
// (llama.cpp's default) everywhere. Times are wall-clock per step (manual timing: the engine's
// pool threads do the work); the counter tokens_per_s is steps over their summed time.
//
// --profile (this program's own flag, before Google Benchmark's): each decode benchmark also
// reports its step's phases as counters, milliseconds per step (step_profile.hpp: qkv_ms,
// attention_ms, output_mlp_ms, logits_ms, append_ms, prefetch_ms, attend_cache_ms; the cache's
// acquire_wait_ms and copy_ms; the pool's threads, summed: pool_busy_ms, pool_spin_ms,
// pool_caller_wait_ms). Off by default: it reads the clock a few hundred times a step.
//
// The model is found as the examples find it (model_files.hpp: $OASISKV_MODEL_PATH,
// $OASISKV_MODEL_DIR, <repo>/.cache/models); without it every benchmark is skipped with an error.
// The text is GPL-3, LGPL-3 and Apache-2.0 from /usr/share/common-licenses, one after the other
// (11.8K tokens: scripts/demo's long prompt; or the file $OASISKV_ENGINE_TEXT, its tokens
// repeated when too short). $OASISKV_ENGINE_STEPS sets the decode steps per benchmark (default 32).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>
#include <oasiskv/cpu/isa.hpp>

#include "dense_attention.hpp"
#include "dense_kv.hpp"
#include "drafters.hpp"
#include "gguf_reader.hpp"
#include "llama_model.hpp"
#include "model_files.hpp"
#include "oasiskv_session.hpp"
#include "step_profile.hpp"
#include "thread_pool.hpp"
#include "tokenizer.hpp"

namespace {

using Clock = std::chrono::steady_clock;

// The demo's budgets: 256 tokens at a 1,024-token context, 1,024 beyond.
int sparse_budget(std::int64_t context) { return context <= 1024 ? 256 : 1024; }
constexpr int kPrefillTokens = 4096;
constexpr const char* kDefaultTexts[] = {"/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/LGPL-3",
                                         "/usr/share/common-licenses/Apache-2.0"};
constexpr const char* kDrafter = "ngram";

int decode_steps() {
  const char* env = std::getenv("OASISKV_ENGINE_STEPS");
  const int steps = env ? std::atoi(env) : 32;
  return steps > 0 ? steps : 32;
}

std::string text_path() {
  const char* env = std::getenv("OASISKV_ENGINE_TEXT");
  return env && *env ? env : "GPL-3 + LGPL-3 + Apache-2.0 (/usr/share/common-licenses)";
}

std::string read_text() {
  const char* env = std::getenv("OASISKV_ENGINE_TEXT");
  if (env && *env) return smollm2::read_text_file(env);
  std::string all;
  for (const char* path : kDefaultTexts) all += smollm2::read_text_file(path);
  return all;
}

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

bool profiling = false;  // --profile

// The phases of `steps` profiled steps as counters, ms per step.
void profile_counters(benchmark::State& state, const smollm2::StepProfile& p, const smollm2::ThreadPool::Times& pool) {
  if (!profiling) return;
  const double n = static_cast<double>(std::max<std::int64_t>(1, p.steps));
  auto ms = [&](std::int64_t ns) { return static_cast<double>(ns) / 1e6 / n; };
  state.counters["qkv_ms"] = ms(p.qkv_ns);
  state.counters["attention_ms"] = ms(p.attention_ns);
  state.counters["output_mlp_ms"] = ms(p.output_mlp_ns);
  state.counters["logits_ms"] = ms(p.logits_ns);
  state.counters["append_ms"] = ms(p.append_ns);
  state.counters["prefetch_ms"] = ms(p.prefetch_ns);
  state.counters["attend_cache_ms"] = ms(p.attend_cache_ns);
  state.counters["pool_busy_ms"] = ms(pool.busy_ns);
  state.counters["pool_spin_ms"] = ms(pool.spin_ns);
  state.counters["pool_caller_wait_ms"] = ms(pool.caller_wait_ns);
}

// The model, its tokens of the text, and the shared prefix: loaded on first use, kept for the run.
struct Engine {
  std::string error;  // set when the model or the text could not be loaded
  std::unique_ptr<smollm2::GgufFile> file;
  std::unique_ptr<smollm2::LlamaModel> model;
  std::vector<std::int32_t> text;  // at least context_length tokens
  // Dense fp16 KV of text[0, filled): every decode benchmark's prefill, extended as contexts grow
  // (benchmarks run in increasing context) and truncated back after each run.
  std::unique_ptr<smollm2::DenseKv> prefix;
  std::int64_t filled = 0;
};

Engine& engine() {
  static Engine e = [] {
    Engine out;
    std::string path;
    try {
      path = smollm2::find_model("");
    } catch (const std::exception&) {
      out.error = "model not found: run scripts/fetch-model";
      return out;
    }
    try {
      out.file = std::make_unique<smollm2::GgufFile>(path);
      out.model = std::make_unique<smollm2::LlamaModel>(*out.file, smollm2::WeightFormat::quantized_int8);
      const smollm2::Tokenizer tokenizer(*out.file);
      const auto once = tokenizer.encode(read_text());
      if (once.empty()) throw std::runtime_error("the text " + text_path() + " has no tokens");
      const auto& c = out.model->config();
      while (static_cast<std::int64_t>(out.text.size()) < c.context_length) {
        out.text.insert(out.text.end(), once.begin(), once.end());
      }
      out.prefix = std::make_unique<smollm2::DenseKv>(c.num_layers, c.kv_width(), c.context_length,
                                                      smollm2::KvPrecision::fp16);
    } catch (const std::exception& ex) {
      out.error = std::string("could not load the engine: ") + ex.what();
    }
    return out;
  }();
  return e;
}

// The shared prefix holding exactly text[0, context).
smollm2::DenseKv& prefix_of(Engine& e, std::int64_t context) {
  auto& kv = *e.prefix;
  e.filled = std::min(e.filled, context);
  kv.truncate(e.filled);
  if (e.filled < context) {
    std::fprintf(stderr, "engine-bench: prefilling tokens [%lld, %lld) with %d thread(s) (untimed)\n",
                 static_cast<long long>(e.filled), static_cast<long long>(context), smollm2::engine_threads());
    const auto t0 = Clock::now();
    smollm2::prefill(*e.model, kv, std::span(e.text).subspan(static_cast<std::size_t>(e.filled),
                                                             static_cast<std::size_t>(context - e.filled)));
    std::fprintf(stderr, "engine-bench: prefill done in %.1f s\n", since(t0));
    e.filled = context;
  }
  return kv;
}

// Loads the engine and sets the thread count; false (and the benchmark skipped) on failure.
Engine* setup(benchmark::State& state, int threads, std::int64_t tokens_needed) {
  Engine& e = engine();
  if (!e.error.empty()) {
    state.SkipWithError(e.error.c_str());
    return nullptr;
  }
  if (tokens_needed > e.model->config().context_length) {
    state.SkipWithError("context + decode steps exceed the model's context length");
    return nullptr;
  }
  if (smollm2::engine_threads() != threads) smollm2::set_engine_threads(threads);
  return &e;
}

void finish(benchmark::State& state, double seconds, std::int64_t tokens, std::int64_t context, int threads) {
  state.counters["tokens_per_s"] = seconds > 0 ? static_cast<double>(tokens) / seconds : 0.0;
  state.counters["context"] = static_cast<double>(context);
  state.counters["threads"] = threads;
}

void decode_dense(benchmark::State& state, std::int64_t context, int threads) {
  const std::int64_t steps = state.max_iterations;
  Engine* e = setup(state, threads, context + steps + 1);
  if (!e) return;
  auto& kv = prefix_of(*e, context);
  const auto& text = e->text;
  std::int64_t pos = context;
  auto warm = smollm2::dense_decode_step(*e->model, kv, text[static_cast<std::size_t>(pos++)]);  // warm-up
  benchmark::DoNotOptimize(warm.data());
  smollm2::StepProfile profile;
  smollm2::engine_pool().set_profiling(profiling);
  smollm2::engine_pool().reset_times();
  double total = 0;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    auto logits = smollm2::dense_decode_step(*e->model, kv, text[static_cast<std::size_t>(pos++)], nullptr,
                                             profiling ? &profile : nullptr);
    benchmark::DoNotOptimize(logits.data());
    const double dt = since(t0);
    state.SetIterationTime(dt);
    total += dt;
  }
  kv.truncate(context);
  finish(state, total, state.iterations(), context, threads);
  profile_counters(state, profile, smollm2::engine_pool().times());
}

// lookahead: a step also runs the n-gram drafter's lookahead row when it has a draft, whose
// queries plan the next step (the paper's protocol); otherwise, the current row's queries plan it.
void decode_sparse(benchmark::State& state, std::int64_t context, int threads, bool lookahead) {
  const std::int64_t steps = state.max_iterations;
  const std::int64_t capacity = context + steps + 2;
  Engine* e = setup(state, threads, capacity);
  if (!e) return;
  const auto& kv = prefix_of(*e, context);
  const auto& c = e->model->config();
  const auto& text = e->text;
  oasiskv::CacheConfig config;
  config.shape = smollm2::model_shape(c);
  config.budget_tokens = sparse_budget(context);
  config.fetch_ratio = 1.0;
  config.max_sequences = 1;
  config.max_tokens_per_sequence = capacity;
  // A fresh session per run: the cache holds the prefix and grows by this run's steps only.
  smollm2::OasisKvSession<oasiskv::fp16_t> session(*e->model, config, kv, context);
  smollm2::NgramDrafter drafter;
  std::int64_t drafted = 0;  // steps with a lookahead row
  // The first working set from the first step's own row (its token is known: teacher forcing).
  session.start(smollm2::dense_row_queries(*e->model, kv, text[static_cast<std::size_t>(context)],
                                           static_cast<std::int32_t>(context)));
  auto step = [&](std::int64_t pos) {
    const auto history = std::span(text).first(static_cast<std::size_t>(pos) + 1);  // last: the current token
    std::optional<std::int32_t> draft;
    if (lookahead) draft = drafter.draft(history, -1);
    drafted += draft.has_value();
    return session.step(history.back(), draft);
  };
  std::int64_t pos = context;
  auto warm = step(pos++);  // warm-up
  benchmark::DoNotOptimize(warm.data());
  session.cache().reset_statistics();
  drafted = 0;
  smollm2::StepProfile profile;
  session.set_profile(profiling ? &profile : nullptr);
  smollm2::engine_pool().set_profiling(profiling);
  smollm2::engine_pool().reset_times();
  double total = 0;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    auto logits = step(pos++);
    benchmark::DoNotOptimize(logits.data());
    const double dt = since(t0);
    state.SetIterationTime(dt);
    total += dt;
  }
  finish(state, total, state.iterations(), context, threads);
  const auto stats = session.cache().statistics().total();
  const double n = static_cast<double>(std::max<std::int64_t>(1, state.iterations()));
  state.counters["blocks_per_step"] = static_cast<double>(stats.blocks_fetched) / n;
  state.counters["budget_tokens"] = config.budget_tokens;
  state.counters["lookahead_share"] = static_cast<double>(drafted) / n;
  profile_counters(state, profile, smollm2::engine_pool().times());
  if (profiling) {
    state.counters["acquire_wait_ms"] = static_cast<double>(stats.acquire_wait_ns) / 1e6 / n;
    state.counters["copy_ms"] = static_cast<double>(stats.copy_ns) / 1e6 / n;
  }
}

void prefill(benchmark::State& state, std::int64_t tokens, int threads) {
  Engine* e = setup(state, threads, tokens);
  if (!e) return;
  const auto& c = e->model->config();
  smollm2::DenseKv kv(c.num_layers, c.kv_width(), tokens, smollm2::KvPrecision::fp16);
  double total = 0;
  for (auto _ : state) {
    kv.truncate(0);
    const auto t0 = Clock::now();
    auto result = smollm2::prefill(*e->model, kv, std::span(e->text).first(static_cast<std::size_t>(tokens)));
    benchmark::DoNotOptimize(result.last_logits.data());
    const double dt = since(t0);
    state.SetIterationTime(dt);
    total += dt;
  }
  finish(state, total, tokens * state.iterations(), 0, threads);
}

}  // namespace

int main(int argc, char** argv) {
  // --profile is this program's: taken out before Google Benchmark reads the rest.
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--profile") {
      profiling = true;
    } else {
      argv[kept++] = argv[i];
    }
  }
  argc = kept;
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;

  const int steps = decode_steps();
  // Registration order is run order: contexts increase so that the shared prefix only grows, and
  // dense and sparse at one (context, threads) follow each other.
  for (const std::int64_t context : {1024, 4096, 8000}) {
    for (const int threads : {1, 2}) {
      for (const char* mode : {"dense", "sparse", "sparse_previous"}) {
        const std::string name = std::string("BM_EngineDecode/mode:") + mode + "/context:" + std::to_string(context) +
                                 "/threads:" + std::to_string(threads);
        const bool dense = std::string(mode) == "dense", lookahead = std::string(mode) == "sparse";
        benchmark::RegisterBenchmark(name.c_str(), [=](benchmark::State& s) {
          if (dense) decode_dense(s, context, threads);
          else decode_sparse(s, context, threads, lookahead);
        })->Iterations(steps)->UseManualTime()->Unit(benchmark::kMillisecond);
      }
    }
  }
  for (const int threads : {1, 2}) {
    const std::string name = "BM_EnginePrefill/tokens:" + std::to_string(kPrefillTokens) + "/threads:" + std::to_string(threads);
    benchmark::RegisterBenchmark(name.c_str(), [=](benchmark::State& s) { prefill(s, kPrefillTokens, threads); })
        ->Iterations(1)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  }

  std::string model = "not found (scripts/fetch-model)";
  try {
    model = std::filesystem::path(smollm2::find_model("")).lexically_normal().string();
  } catch (const std::exception&) {
  }
  benchmark::AddCustomContext("engine_model", model);
  benchmark::AddCustomContext("engine_text", text_path());
  benchmark::AddCustomContext("engine_weights", "quantized-int8");
  benchmark::AddCustomContext("engine_kv", "fp16");
  benchmark::AddCustomContext("engine_sparse_budget_tokens", "256 at context 1024, else 1024");
  // Results name the machine and the instruction-set level they were measured at
  // (OASISKV_CPU_ISA=avx2 on an AVX-512 machine measures the path an AVX2-only CPU runs).
  benchmark::AddCustomContext("engine_cpu", oasiskv::cpu_model_name());
  benchmark::AddCustomContext("engine_isa", std::string(oasiskv::to_string(oasiskv::cpu_isa())));
  benchmark::AddCustomContext("engine_sparse_drafter", kDrafter);
  benchmark::AddCustomContext("engine_decode_steps", std::to_string(steps));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
