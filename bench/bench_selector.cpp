// Block scoring (LookaheadSelector::score) as bytes of summaries read per second over memcpy of
// the same bytes, each block scorer's cost against Quest's bound, and top-K selection
// (LookaheadSelector::top_k) against std::nth_element on the same scores.
#include "bench_support.hpp"

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <vector>

namespace oasiskv::bench {
namespace {

// Summaries of `pairs` (sequence, kv head) pairs of a 32K context with random keys.
struct SummaryFixture {
  CacheLayout layout;
  SummaryStore summaries;
  std::int64_t first = 0, last = 0;  // the candidate blocks prefetch scores (outside sinks and ring)

  explicit SummaryFixture(int sequences)
      : layout(CacheLayout::from(layer_config(kLongContext, 1.0, sequences))), summaries(layout) {
    // Summaries are min/max per block: fill them directly from random keys, one block at a time.
    std::vector<fp16_t> keys(static_cast<std::size_t>(kBlockTokens * kHeadDim));
    for (int s = 0; s < sequences; ++s) {
      for (int h = 0; h < kKvHeads; ++h) {
        for (std::int64_t b = 0; b < layout.blocks_for(kLongContext); ++b) {
          fill_uniform(keys, static_cast<std::uint64_t>(((s * kKvHeads + h) << 20) + b));
          for (int r = 0; r < kBlockTokens; ++r) {
            summaries.add_key(s, 0, h, b * kBlockTokens + r, keys.data() + r * kHeadDim);
          }
        }
      }
    }
    first = layout.sink_blocks;
    last = std::min(layout.blocks_for(kLongContext), layout.ring_start(kLongContext + 1));
  }
  std::size_t bytes_per_pair() const {
    return static_cast<std::size_t>(last - first) * 2 * kHeadDim * sizeof(float);
  }
};

// Built once per size and kept: Google Benchmark calls a benchmark several times while it sizes
// the iteration count, and filling 8 sequences of summaries takes seconds.
const SummaryFixture& summary_fixture(int sequences) {
  static std::map<int, std::unique_ptr<SummaryFixture>> built;
  auto& f = built[sequences];
  if (!f) f = std::make_unique<SummaryFixture>(sequences);
  return *f;
}

// Scores every candidate block of `sequences` x 8 kv heads against `queries` query vectors
// (group 4 x lookahead rows). sequences = 1 reads 2 MiB per kv head (cache-resident);
// sequences = 8 is one whole layer of the batch (128 MiB, DRAM).
void BM_Score(benchmark::State& state) {
  const int sequences = static_cast<int>(state.range(0));
  const int queries = static_cast<int>(state.range(1));
  const SummaryFixture& f = summary_fixture(sequences);
  LookaheadSelector selector(f.layout);
  std::vector<float> q(static_cast<std::size_t>(queries * kHeadDim));
  fill_uniform(q, 7);
  std::vector<float> scores;
  for (auto _ : state) {
    for (int s = 0; s < sequences; ++s) {
      for (int h = 0; h < kKvHeads; ++h) {
        selector.score(f.summaries, s, 0, h, f.first, f.last, q.data(), queries, scores);
        benchmark::DoNotOptimize(scores.data());
      }
    }
  }
  const std::size_t bytes = f.bytes_per_pair() * static_cast<std::size_t>(sequences * kKvHeads);
  state.counters["blocks_per_s"] = benchmark::Counter(
      static_cast<double>((f.last - f.first) * sequences * kKvHeads) * static_cast<double>(state.iterations()),
      benchmark::Counter::kIsRate);
  set_memcpy_limit(state, bytes, bytes);
}
BENCHMARK(BM_Score)->UseRealTime()->ArgNames({"seqs", "queries"})
    ->Args({1, 1})->Args({1, kGroup})->Args({1, 2 * kGroup})->Args({kBatch, kGroup});

// Each block scorer (CacheConfig::scorer) on the same summaries and queries, against Quest's bound
// (the reference: same work, ratio = Quest's time / this one's). One sequence is cache-resident
// (the arithmetic shows), a whole batch layer streams from DRAM (the bytes do).
void BM_ScoreWith(benchmark::State& state) {
  const auto kind = static_cast<BlockScore>(state.range(0));
  const int sequences = static_cast<int>(state.range(1));
  const int queries = static_cast<int>(state.range(2));
  const SummaryFixture& f = summary_fixture(sequences);
  CacheConfig c = f.layout.config;
  c.scorer = kind;
  c.spread_alpha = 0.5f;
  LookaheadSelector selector(CacheLayout::from(c));
  std::vector<float> q(static_cast<std::size_t>(queries * kHeadDim));
  fill_uniform(q, 7);
  std::vector<float> scores;
  for (auto _ : state) {
    for (int s = 0; s < sequences; ++s) {
      for (int h = 0; h < kKvHeads; ++h) {
        selector.score(f.summaries, s, 0, h, f.first, f.last, q.data(), queries, scores);
        benchmark::DoNotOptimize(scores.data());
      }
    }
  }
  state.counters["blocks_per_s"] = benchmark::Counter(
      static_cast<double>((f.last - f.first) * sequences * kKvHeads) * static_cast<double>(state.iterations()),
      benchmark::Counter::kIsRate);
  // scorer 0 is quest, 1 spread (BlockScore's values).
  if (kind != BlockScore::quest) {
    set_reference(state, "BM_ScoreWith/scorer:0/seqs:" + std::to_string(sequences) + "/queries:" + std::to_string(queries));
  }
}
BENCHMARK(BM_ScoreWith)->UseRealTime()->ArgNames({"scorer", "seqs", "queries"})
    ->ArgsProduct({{0, 1}, {1, kBatch}, {kGroup}})->Args({0, 1, 1})->Args({1, 1, 1});

// Scores of the 2,042 candidate blocks of a 32K context (2,048 blocks minus the sink and the
// recent ring), K = 122 selectable slots of the 2,048-token budget.
std::vector<float> candidate_scores() {
  const CacheLayout layout = CacheLayout::from(layer_config(kLongContext, 1.0, 1));
  const auto n = static_cast<std::size_t>(
      std::min(layout.blocks_for(kLongContext), layout.ring_start(kLongContext + 1)) - layout.sink_blocks);
  std::vector<float> scores(n);
  fill_uniform(scores, 11);
  return scores;
}
int selectable_blocks() { return CacheLayout::from(layer_config(kLongContext, 1.0, 1)).selectable_blocks; }

void BM_TopK(benchmark::State& state) {
  const std::vector<float> scores = candidate_scores();
  const int k = selectable_blocks();
  std::vector<std::int32_t> selected;
  for (auto _ : state) {
    LookaheadSelector::top_k(scores, 1, k, selected);
    benchmark::DoNotOptimize(selected.data());
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(scores.size()) * state.iterations());  // scores per second
  state.counters["n"] = static_cast<double>(scores.size());
  state.counters["k"] = k;
  set_reference(state, "BM_NthElement");
}
BENCHMARK(BM_TopK)->UseRealTime();

// The reference: std::nth_element on a copy of the same float scores (the copy is part of the
// work, as top_k fills its index array), nothing else: no indices, no tie rule, no final sort.
void BM_NthElement(benchmark::State& state) {
  const std::vector<float> scores = candidate_scores();
  const int k = selectable_blocks();
  std::vector<float> work(scores.size());
  for (auto _ : state) {
    std::copy(scores.begin(), scores.end(), work.begin());
    std::nth_element(work.begin(), work.begin() + k, work.end(), std::greater<>());
    benchmark::DoNotOptimize(work.data());
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(scores.size()) * state.iterations());
  state.counters["n"] = static_cast<double>(scores.size());
  state.counters["k"] = k;
}
BENCHMARK(BM_NthElement)->UseRealTime();

}  // namespace
}  // namespace oasiskv::bench
