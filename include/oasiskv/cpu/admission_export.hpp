// The prefill side of an admission (prefill-decode disaggregation): the AdmissionMessage fields a
// Cache<cpu, T> holds for one of its sequences (shape, length, summaries, what its
// CacheConfig::remainder keeps (the block sums and key clusters of `clusters`), the run key sums
// of the runs scorer, the first working
// set and the lookahead queries of the first plan), and the sequence's host pool blocks to export.
// The transport fills in the remote fields (oasiskv::ucx::PrefillServer::export_request).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "oasiskv/admission.hpp"
#include "oasiskv/cpu/cache.hpp"

namespace oasiskv {
inline namespace v0 {

// lookahead_queries: [layer][lookahead_rows][num_q_heads][head_dim] floats, the queries the
// first decode step's plan uses (Cache::prefetch of every layer). The working set of each (layer,
// kv head) is its sinks, its recent ring and the blocks the selector picks from those queries.
template <KvElement T>
AdmissionMessage make_admission(const Cache<cpu, T>& cache, SeqId id, std::span<const float> lookahead_queries,
                                int lookahead_rows, std::int64_t next_step_rows = 1) {
  const CacheLayout& L = cache.layout();
  const std::int64_t length = cache.sequence_length(id, 0);
  for (int l = 1; l < L.num_layers(); ++l) {
    if (cache.sequence_length(id, l) != length) {
      fail("make_admission: sequence {} has layers of different lengths ({} at layer 0, {} at layer {})", id, length,
           cache.sequence_length(id, l), l);
    }
  }
  const auto per_layer = static_cast<std::size_t>(lookahead_rows) * static_cast<std::size_t>(L.q_row_elems);
  if (lookahead_rows < 1 || lookahead_queries.size() != per_layer * static_cast<std::size_t>(L.num_layers())) {
    fail("make_admission: {} lookahead query floats for {} rows; {} layers x {} rows x {} need {}",
         lookahead_queries.size(), lookahead_rows, L.num_layers(), lookahead_rows, L.q_row_elems,
         per_layer * static_cast<std::size_t>(L.num_layers()));
  }
  const int slot = cache.block_table().find(id);
  const auto& host = cache.host_tier();
  const auto& summaries = cache.backend().summaries();
  AdmissionMessage m;
  m.shape = L.config.shape;
  m.block_tokens = L.block_tokens();
  m.dtype = dtype_of_v<T>;
  m.length = length;
  m.lookahead_rows = lookahead_rows;
  m.next_step_rows = next_step_rows;
  m.lookahead_queries.assign(lookahead_queries.begin(), lookahead_queries.end());
  const std::int64_t nb = L.blocks_for(length);
  if (L.score.runs > 0) m.run_tokens = L.config.run_tokens;
  // What the remainder estimate keeps (the clusters' block sums and key clusters), when it has any.
  if (const auto* remainder = cache.backend().remainder_store()) remainder->export_admission(slot, length, m);
  const auto block_bytes = static_cast<std::size_t>(L.block_elems) * sizeof(T);
  std::vector<std::int32_t> ids;
  for (int l = 0; l < L.num_layers(); ++l) {
    const auto picked = cache.select_blocks(
        id, l, rows_view(lookahead_queries.data() + static_cast<std::size_t>(l) * per_layer, lookahead_rows));
    for (int h = 0; h < L.num_kv_heads(); ++h) {
      if (nb > 0) {
        const float* s = summaries.block(slot, l, h, 0);
        m.summaries.insert(m.summaries.end(), s, s + nb * 2 * L.head_dim());
      }
      if (nb > 0 && L.score.runs > 0) {  // the run sums; a run past the end (never folded here) as zeros
        const float* r = summaries.runs(slot, l, h, 0);
        const std::size_t first = m.run_sums.size();
        m.run_sums.insert(m.run_sums.end(), r, r + nb * L.score.runs * L.head_dim());
        const std::int64_t started = (length - 1) % L.block_tokens() / L.config.run_tokens + 1;  // last block's
        std::fill(m.run_sums.begin() + static_cast<std::ptrdiff_t>(first) +
                      static_cast<std::ptrdiff_t>(((nb - 1) * L.score.runs + started) * L.head_dim()),
                  m.run_sums.end(), 0.0f);
      }
      ids.clear();
      for (std::int64_t b = 0; b < nb; ++b) {
        if (L.pinned_block(b, length)) ids.push_back(static_cast<std::int32_t>(b));
      }
      ids.insert(ids.end(), picked[static_cast<std::size_t>(h)].begin(), picked[static_cast<std::size_t>(h)].end());
      std::sort(ids.begin(), ids.end());
      ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
      m.working_set_counts.push_back(static_cast<std::int32_t>(ids.size()));
      for (std::int32_t b : ids) {
        m.working_set_blocks.push_back(b);
        const auto* rows = reinterpret_cast<const std::byte*>(host.block(slot, l, h, b));
        m.working_set_rows.insert(m.working_set_rows.end(), rows, rows + block_bytes);
      }
    }
  }
  return m;
}

// The sequence's host pool blocks in logical order: each holds every layer and kv head of one
// block (HostTier::pool_block_bytes bytes), as AdmissionMessage::block_addresses expects.
template <KvElement T>
std::vector<const void*> host_blocks_of(const Cache<cpu, T>& cache, SeqId id) {
  const int slot = cache.block_table().find(id);
  if (slot < 0) fail("host_blocks_of: sequence {} is not in the cache", id);
  const auto& host = cache.host_tier();
  std::vector<const void*> blocks;
  const std::int64_t count = cache.layout().blocks_for(cache.sequence_length(id, 0));
  for (std::int64_t b = 0; b < count; ++b) {
    const std::int32_t p = host.pool().at(slot, b);
    if (p < 0) fail("host_blocks_of: block {} of sequence {} is not in this host tier (remote)", b, id);
    blocks.push_back(host.pool_block(p, 0, 0));
  }
  return blocks;
}

}  // namespace v0
}  // namespace oasiskv
