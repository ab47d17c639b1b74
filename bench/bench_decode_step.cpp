// The decode step of one layer for batch 8 at the Llama-3-8B-like shape: one whole prefetch step
// (scoring, top-K, plan, copy) beside a dense attention step, and sparse attention over the
// 2,048-token working set beside dense attention over the whole context. Per layer: the caches
// have num_layers = 1 (the 32-layer model at 32K is 32 GiB of KV, over this machine's memory).
#include "decode_layer.hpp"
#include "dense_attention_tight.hpp"
#include "oasiskv/cpu/detail/remainder/key_clusters.hpp"

#include <cmath>
#include <memory>
#include <string>
#include <vector>

namespace oasiskv::bench {
namespace {

const float kScale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));

std::string context_suffix(std::int64_t context) { return "/context:" + std::to_string(context); }

// Steady state of the per-layer protocol: prefetch for step t+1, then acquire and release the
// ticket of step t (attention itself left out: it is measured below). An iteration's time is the
// scoring, top-K and planning of 8 x 8 (sequence, kv head) pairs plus whatever part of the
// previous plan's copies (on the pipeline's worker thread) they did not hide.
void BM_PrefetchStep(benchmark::State& state) {
  const std::int64_t context = state.range(0);
  DecodeLayer& f = decode_layer(context, static_cast<double>(state.range(1)) / 100.0);
  auto& cache = *f.cache;
  const auto lookahead = [&](std::size_t i) { return rows_view(f.lookahead[i % f.lookahead.size()].data(), kBatch); };
  const auto no_attention = [](const LayerView<fp16_t>&) {};
  Ticket previous = cache.prefetch(f.ids, 0, lookahead(0));
  cache.attend(previous, no_attention);
  previous = cache.prefetch(f.ids, 0, lookahead(1));
  cache.reset_statistics();
  std::size_t i = 2;
  for (auto _ : state) {
    Ticket next = cache.prefetch(f.ids, 0, lookahead(i++));
    cache.attend(previous, no_attention);
    previous = std::move(next);
  }
  cache.attend(previous, no_attention);
  const LayerStatistics st = cache.statistics().total();
  const double steps = static_cast<double>(state.iterations());
  state.counters["fetched_MiB_per_step"] = static_cast<double>(st.bytes_fetched) / steps / (1 << 20);
  state.counters["blocks_per_step"] = static_cast<double>(st.blocks_fetched) / steps;
  state.counters["capped_per_step"] = static_cast<double>(st.admits_capped) / steps;
  state.counters["wait_ms_per_step"] = static_cast<double>(st.acquire_wait_ns) / steps / 1e6;
  state.SetItemsProcessed(state.iterations());  // layer steps per second
  set_reference(state, "BM_DenseAttentionTight" + context_suffix(context) + ",BM_DenseAttentionReference" + context_suffix(context));
}

// sparse_attention_reference over an acquired LayerView (sinks, 122 selected blocks, recent ring).
void BM_SparseAttention(benchmark::State& state) {
  const std::int64_t context = state.range(0);
  DecodeLayer& f = decode_layer(context, 1.0);
  auto& cache = *f.cache;
  const Ticket ticket = cache.prefetch(f.ids, 0, rows_view(f.lookahead[0].data(), kBatch));
  const LayerView<fp16_t> view = cache.acquire(ticket);
  std::vector<float> out(f.query.size());
  for (auto _ : state) {
    sparse_attention_reference(view, kQueryHeads, kScale, f.query.data(), out.data());
    benchmark::DoNotOptimize(out.data());
  }
  std::int64_t tokens = 0;
  for (int e = 0; e < view.indptr[view.num_pairs()]; ++e) tokens += view.valid_tokens[e];
  cache.release(ticket);
  state.counters["tokens_per_kv_head"] = static_cast<double>(tokens) / view.num_pairs();
  const auto bytes = static_cast<std::size_t>(tokens) * 2 * kHeadDim * sizeof(fp16_t);
  set_memcpy_limit(state, bytes, bytes);
  set_reference(state, "BM_DenseAttentionReference" + context_suffix(context));
}

// Cache::remainder: the estimate (clusters, or quantized: rows at `bits` bits, the argument bits:4 or bits:8) of the attention over the blocks the view leaves out (context - 2,048 tokens per kv
// head), for the step's true queries of the 8 sequences.
// Its cost per layer and step; the report divides the dense attention step of the same shape by it.
void BM_Remainder(benchmark::State& state, int bits) {
  const std::int64_t context = state.range(0);
  const auto kind = static_cast<RemainderEstimate>(state.range(1));
  struct Kept {
    std::int64_t context = 0;
    RemainderEstimate kind = RemainderEstimate::none;
    int bits = 0;
    std::unique_ptr<Cache<cpu, fp16_t>> cache;
    std::vector<SeqId> ids;
  };
  static Kept kept;
  if (!kept.cache || kept.context != context || kept.kind != kind || kept.bits != bits) {
    kept.cache.reset();
    CacheConfig config = layer_config(context, 1.0);
    config.remainder = kind;
    config.remainder_bits = bits;
    kept = Kept{context, kind, bits, std::make_unique<Cache<cpu, fp16_t>>(config), {}};
    const DenseKv& kv = dense_kv(context);
    for (int i = 0; i < kBatch; ++i) {
      kept.ids.push_back(static_cast<SeqId>(i + 1));
      kept.cache->add_sequence(kept.ids.back());
    }
    const std::vector<std::int32_t> rows(kBatch, static_cast<std::int32_t>(context));
    kept.cache->append(kept.ids, 0, rows, rows_view(kv.k.data(), kBatch * context), rows_view(kv.v.data(), kBatch * context));
  }
  auto& cache = *kept.cache;
  std::vector<float> q(static_cast<std::size_t>(kBatch) * kQueryHeads * kHeadDim), out(q.size()),
      lse(static_cast<std::size_t>(kBatch) * kQueryHeads);
  fill_uniform(q, 300);
  const Ticket ticket = cache.prefetch(kept.ids, 0, rows_view(q.data(), kBatch));
  const LayerView<fp16_t> view = cache.acquire(ticket);
  for (auto _ : state) {
    cache.remainder(ticket, rows_view(q.data(), kBatch), out, lse);
    benchmark::DoNotOptimize(out.data());
  }
  std::int64_t resident = 0;
  for (int e = 0; e < view.indptr[view.num_pairs()]; ++e) resident += view.valid_tokens[e];
  cache.release(ticket);
  state.counters["estimated_blocks_per_kv_head"] =
      static_cast<double>(context / kBlockTokens) - static_cast<double>(resident) / kBlockTokens / view.num_pairs();
  state.SetItemsProcessed(state.iterations());  // layer steps per second
  set_reference(state, "BM_DenseAttentionTight" + context_suffix(context));
}

// RemainderEstimate::clusters' price at prefill: the k-means of one 1,024-row segment of one kv
// head (64 clusters of 16 rows, head_dim 128, 8 rounds), which the cache runs for every kv head
// and layer when a segment fills. The report divides one dense attention step (8 sequences, 4K)
// by it; a prefill of 4K tokens runs 4 segments x kv heads of it per layer.
void BM_KeyClusters(benchmark::State& state) {
  const DenseKv& kv = dense_kv(4096);
  const int rows = kClusterSegmentBlocks * kBlockTokens;
  std::vector<float> keys(static_cast<std::size_t>(rows) * kHeadDim), centres, scratch;
  for (int r = 0; r < rows; ++r) {
    for (int i = 0; i < kHeadDim; ++i) {
      keys[static_cast<std::size_t>(r) * kHeadDim + i] = to_float(kv.keys(0)[static_cast<std::size_t>(r) * kKvHeads * kHeadDim + i]);
    }
  }
  std::vector<std::uint8_t> ids(static_cast<std::size_t>(rows));
  for (auto _ : state) {
    detail::kmeans_keys(keys.data(), rows, kHeadDim, rows / 16, detail::KeyClusters::kIterations, ids.data(), centres,
                        scratch);
    benchmark::DoNotOptimize(ids.data());
  }
  state.SetItemsProcessed(state.iterations());  // segments per second
  set_reference(state, "BM_DenseAttentionTight/context:4096");
}

// oasiskv::dense_attention_reference for each of the 8 sequences over the whole context.
void BM_DenseAttentionReference(benchmark::State& state) {
  const DenseKv& kv = dense_kv(state.range(0));
  std::vector<float> q(static_cast<std::size_t>(kBatch) * kQueryHeads * kHeadDim), out(q.size());
  fill_uniform(q, 300);
  for (auto _ : state) {
    for (int s = 0; s < kBatch; ++s) {
      const std::size_t off = static_cast<std::size_t>(s) * kQueryHeads * kHeadDim;
      dense_attention_reference(kv.keys(s), kv.values(s), kv.context, kQueryHeads, kKvHeads, kHeadDim, kScale,
                                q.data() + off, out.data() + off);
    }
    benchmark::DoNotOptimize(out.data());
  }
  set_memcpy_limit(state, kv.bytes(), kv.bytes());
}

// The tighter dense loop (dense_attention_tight.hpp) for each of the 8 sequences.
void BM_DenseAttentionTight(benchmark::State& state) {
  const DenseKv& kv = dense_kv(state.range(0));
  std::vector<float> q(static_cast<std::size_t>(kBatch) * kQueryHeads * kHeadDim), out(q.size()), scratch;
  fill_uniform(q, 300);
  for (auto _ : state) {
    for (int s = 0; s < kBatch; ++s) {
      const std::size_t off = static_cast<std::size_t>(s) * kQueryHeads * kHeadDim;
      dense_attention_tight(kv.keys(s), kv.values(s), kv.context, kQueryHeads, kKvHeads, kHeadDim, kScale,
                            q.data() + off, out.data() + off, scratch);
    }
    benchmark::DoNotOptimize(out.data());
  }
  set_memcpy_limit(state, kv.bytes(), kv.bytes());
}

}  // namespace

// Registered from main, after the static registrations so that these (the slowest) run last, and
// in an order that builds each (context, fetch ratio) cache once.
void register_decode_step_benchmarks() {
  for (const std::int64_t context : {std::int64_t{4096}, kLongContext}) {
    benchmark::RegisterBenchmark("BM_PrefetchStep", BM_PrefetchStep)
        ->UseRealTime()->ArgNames({"context", "fetch_pct"})->Args({context, 100});
    benchmark::RegisterBenchmark("BM_SparseAttention", BM_SparseAttention)
        ->UseRealTime()->ArgName("context")->Arg(context);
    benchmark::RegisterBenchmark("BM_PrefetchStep", BM_PrefetchStep)
        ->UseRealTime()->ArgNames({"context", "fetch_pct"})->Args({context, 5});
    for (const RemainderEstimate kind : {RemainderEstimate::clusters, RemainderEstimate::quantized}) {
      // clusters at the long context would first cluster 8 x 8 x 32 segments (about a minute)
      if (kind == RemainderEstimate::clusters && context != 4096) continue;
      if (kind == RemainderEstimate::quantized) {
        for (const int bits : {4, 8}) {
          benchmark::RegisterBenchmark("BM_Remainder", BM_Remainder, bits)
              ->UseRealTime()->ArgNames({"context", "estimate", "bits"})->Args({context, static_cast<std::int64_t>(kind), bits});
        }
        continue;
      }
      benchmark::RegisterBenchmark("BM_Remainder", BM_Remainder, CacheConfig{}.remainder_bits)
          ->UseRealTime()->ArgNames({"context", "estimate"})->Args({context, static_cast<std::int64_t>(kind)});
    }
    if (context == 4096) benchmark::RegisterBenchmark("BM_KeyClusters", BM_KeyClusters)->UseRealTime();
    benchmark::RegisterBenchmark("BM_DenseAttentionTight", BM_DenseAttentionTight)
        ->UseRealTime()->ArgName("context")->Arg(context);
    benchmark::RegisterBenchmark("BM_DenseAttentionReference", BM_DenseAttentionReference)
        ->UseRealTime()->ArgName("context")->Arg(context);
  }
}

}  // namespace oasiskv::bench
