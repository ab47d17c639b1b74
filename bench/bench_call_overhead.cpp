// BM_CallOverhead: one decode step of one layer through the public calls, batch 8: append (one row
// per sequence), prefetch (one lookahead row per sequence, float32 queries), acquire and release of
// the previous step's ticket. bench/python/bench_call_overhead.py makes exactly these calls, with
// the same shape, context and iteration count, through the Python module and divides: the ratio
// is the Python binding's cost over the C++ calls (docs/performance.md).
//
// Fixed iterations (kIterations, the Python script's default) so that both sides walk the same
// sequence lengths, context -> context + kIterations. context:256 is all resident (the budget
// covers it: the calls do little work, so the binding's own cost shows); context:4096 plans for real.
#include "bench_support.hpp"

#include <vector>

namespace oasiskv::bench {
namespace {

constexpr int kIterations = 1000;

void BM_CallOverhead(benchmark::State& state) {
  const std::int64_t context = state.range(0);
  Cache<cpu, fp16_t> cache(layer_config(context + kIterations + 16, 1.0));
  std::vector<SeqId> batch;
  for (int i = 0; i < kBatch; ++i) {
    batch.push_back(static_cast<SeqId>(i + 1));
    cache.add_sequence(batch.back());
  }
  const std::size_t row = static_cast<std::size_t>(kKvHeads) * kHeadDim;
  std::vector<fp16_t> prompt(static_cast<std::size_t>(context) * kBatch * row);
  fill_uniform(prompt, 1);
  const std::vector<std::int32_t> rows(kBatch, static_cast<std::int32_t>(context));
  const auto n = static_cast<std::int64_t>(context) * kBatch;
  cache.append(batch, 0, rows, rows_view(prompt.data(), n), rows_view(prompt.data(), n));
  std::vector<fp16_t> k(kBatch * row), v(kBatch * row);
  std::vector<float> q(static_cast<std::size_t>(kBatch) * kQueryHeads * kHeadDim);
  fill_uniform(k, 2);
  fill_uniform(v, 3);
  fill_uniform(q, 4);
  Ticket previous = cache.prefetch(batch, 0, rows_view(q.data(), kBatch));
  for (auto _ : state) {
    cache.append(batch, 0, rows_view(k.data(), kBatch), rows_view(v.data(), kBatch));
    Ticket next = cache.prefetch(batch, 0, rows_view(q.data(), kBatch));
    const LayerView<fp16_t> view = cache.acquire(previous);
    benchmark::DoNotOptimize(view.indptr);
    cache.release(previous);
    previous = std::move(next);
  }
  state.counters["context"] = static_cast<double>(context);
}

BENCHMARK(BM_CallOverhead)
    ->ArgName("context")
    ->Arg(256)
    ->Arg(4096)
    ->Iterations(kIterations)
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

}  // namespace
}  // namespace oasiskv::bench
