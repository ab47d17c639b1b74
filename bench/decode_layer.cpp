#include "decode_layer.hpp"

namespace oasiskv::bench {

namespace {
constexpr int kQuerySets = 16;
}

const DenseKv& dense_kv(std::int64_t context) {
  static std::unique_ptr<DenseKv> kept;
  if (!kept || kept->context != context) {
    kept.reset();  // free the previous context first: 1 GiB at 32K
    auto kv = std::make_unique<DenseKv>();
    kv->context = context;
    const auto n = static_cast<std::size_t>(kBatch) * static_cast<std::size_t>(context) * kKvHeads * kHeadDim;
    kv->k.resize(n);
    kv->v.resize(n);
    fill_uniform(kv->k, 101);
    fill_uniform(kv->v, 102);
    kept = std::move(kv);
  }
  return *kept;
}

DecodeLayer& decode_layer(std::int64_t context, double fetch_ratio) {
  static std::unique_ptr<DecodeLayer> kept;
  if (kept && kept->context == context && kept->fetch_ratio == fetch_ratio) return *kept;
  kept.reset();
  const DenseKv& kv = dense_kv(context);
  auto layer = std::make_unique<DecodeLayer>();
  layer->context = context;
  layer->fetch_ratio = fetch_ratio;
  layer->cache = std::make_unique<Cache<cpu, fp16_t>>(layer_config(context, fetch_ratio));
  for (int i = 0; i < kBatch; ++i) {
    layer->ids.push_back(static_cast<SeqId>(i + 1));
    layer->cache->add_sequence(layer->ids.back());
  }
  // Prefill: the whole context of every sequence in one append (rows in batch order).
  const std::vector<std::int32_t> rows(kBatch, static_cast<std::int32_t>(context));
  layer->cache->append(layer->ids, 0, rows, rows_view(kv.k.data(), kBatch * context),
                       rows_view(kv.v.data(), kBatch * context));
  // Random lookahead queries: every step's selection differs from the last (the worst case for
  // traffic; the fetch cap bounds it).
  const auto q_elems = static_cast<std::size_t>(kBatch) * kQueryHeads * kHeadDim;
  layer->lookahead.resize(kQuerySets);
  for (int s = 0; s < kQuerySets; ++s) {
    layer->lookahead[static_cast<std::size_t>(s)].resize(q_elems);
    fill_uniform(layer->lookahead[static_cast<std::size_t>(s)], 200 + static_cast<std::uint64_t>(s));
  }
  layer->query.resize(q_elems);
  fill_uniform(layer->query, 300);
  kept = std::move(layer);
  return *kept;
}

}  // namespace oasiskv::bench
