// Summary update per appended token: SummaryStore::add_key alone, and Cache::append of decode
// rows (one row per sequence, batch 8) and of prefill chunks, as bytes of K and V appended per
// second over memcpy of the same bytes.
#include "bench_support.hpp"

#include <vector>

namespace oasiskv::bench {
namespace {

// One fp16 key of head dim 128 folded into its block's min/max summary, tokens in order, so a
// block's first row resets the summary and the other 15 update it, as in a real append.
void BM_SummaryAddKey(benchmark::State& state) {
  const std::int64_t tokens = 4096;
  const CacheLayout layout = CacheLayout::from(layer_config(tokens, 1.0, 1));
  SummaryStore summaries(layout);
  std::vector<fp16_t> keys(static_cast<std::size_t>(tokens * kHeadDim));
  fill_uniform(keys, 1);
  std::int64_t t = 0;
  for (auto _ : state) {
    summaries.add_key(0, 0, 0, t, keys.data() + t * kHeadDim);
    t = (t + 1) % tokens;
  }
  benchmark::DoNotOptimize(summaries.key_max(0, 0, 0, 0));
  state.SetItemsProcessed(state.iterations());  // keys per second
  // Bytes: the key read (the summary itself stays in L1 for a block's 16 rows).
  set_memcpy_limit(state, kHeadDim * sizeof(fp16_t), static_cast<std::size_t>(tokens * kHeadDim) * sizeof(fp16_t));
}
BENCHMARK(BM_SummaryAddKey)->UseRealTime();

// Cache::append for batch 8 with `rows` rows per sequence per call at the per-layer shape.
// Sequences are dropped and re-added (timer paused) when they reach capacity.
void BM_CacheAppend(benchmark::State& state) {
  const auto rows = static_cast<std::int32_t>(state.range(0));
  const int batch = static_cast<int>(state.range(1));
  const std::int64_t capacity = 8192;
  Cache<cpu, fp16_t> cache(layer_config(capacity, 1.0, batch));
  std::vector<SeqId> ids(static_cast<std::size_t>(batch));
  for (int i = 0; i < batch; ++i) cache.add_sequence(ids[static_cast<std::size_t>(i)] = static_cast<SeqId>(i + 1));
  const std::int64_t total_rows = static_cast<std::int64_t>(rows) * batch;
  std::vector<fp16_t> k(static_cast<std::size_t>(total_rows * kKvHeads * kHeadDim)), v(k.size());
  fill_uniform(k, 2);
  fill_uniform(v, 3);
  const std::vector<std::int32_t> rows_per_seq(static_cast<std::size_t>(batch), rows);
  // Steady state: one untimed pass to capacity first, so that the host tier's, the slots' and the
  // summaries' pages are committed, as in a serving process whose freed blocks are reused (and as
  // the memcpy limit's buffers are). Otherwise the first pass of every run pays a page fault per
  // 4 KiB written, which is the OS's first-touch cost, not append's.
  for (std::int64_t filled = 0; filled + rows <= capacity; filled += rows) {
    cache.append(ids, 0, rows_per_seq, rows_view(k.data(), total_rows), rows_view(v.data(), total_rows));
  }
  for (SeqId id : ids) {
    cache.remove_sequence(id);
    cache.add_sequence(id);
  }
  std::int64_t length = 0;
  for (auto _ : state) {
    if (length + rows > capacity) {
      state.PauseTiming();
      for (SeqId id : ids) {
        cache.remove_sequence(id);
        cache.add_sequence(id);
      }
      length = 0;
      state.ResumeTiming();
    }
    cache.append(ids, 0, rows_per_seq, rows_view(k.data(), total_rows), rows_view(v.data(), total_rows));
    length += rows;
  }
  state.SetItemsProcessed(total_rows * state.iterations());  // rows (tokens) per second
  const std::size_t bytes = 2 * k.size() * sizeof(fp16_t);  // K and V appended per call
  // Limit at the footprint of the host tier being filled (DRAM-sized), where the rows land.
  set_memcpy_limit(state, bytes, static_cast<std::size_t>(capacity) * static_cast<std::size_t>(batch) * kKvHeads * 2 * kHeadDim * sizeof(fp16_t));
}
BENCHMARK(BM_CacheAppend)->UseRealTime()->ArgNames({"rows", "batch"})->Args({1, kBatch})->Args({1024, 1});

}  // namespace
}  // namespace oasiskv::bench
