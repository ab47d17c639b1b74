// What the conformance suite needs of a backend, and the host-side copies it compares. A harness
// H provides:
//   template <class T> using CacheOf = Cache<backend, T>;
//   template <class T> std::unique_ptr<CacheOf<T>> make(const CacheConfig&);
//   template <class V> RowsView input(const std::vector<V>& host, std::int64_t rows);
//       rows in the memory the backend reads (device memory for CUDA), valid while H lives
//   template <class T> HostView<T> read(CacheOf<T>&, const LayerView<T>&);
//       the view's arrays and every entry's slot contents, on the host
//   static constexpr bool reads_values;   // the backend refuses non-finite inputs
//   static constexpr int random_steps;    // length of the random integrity test
//   static constexpr int sequence_ops;    // length of the random sequence-operations test
//   template <class T> std::vector<float> summaries(CacheOf<T>&);
//       the block summaries on the host (SummaryStore's layout), after cache.synchronize()
//   std::vector<std::shared_ptr<void>> keep;  // the inputs kept alive (cleared between steps)
// Host-tier rows are read through cache.host_tier() after cache.synchronize().
#pragma once

#include <cstdint>
#include <numeric>
#include <algorithm>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "oasiskv/oasiskv.hpp"
#include "../support.hpp"

namespace oasiskv::test {

// A LayerView copied to the host, with each entry's slot contents ([K|V][block_tokens][d]) at
// e * slot_stride of kv.
template <class T>
struct HostView : ViewGeometry {
  std::vector<SeqId> ids;
  std::vector<std::int64_t> len;
  std::vector<std::int32_t> indptr, slot, block, valid;
  std::vector<T> kv;

  const T* keys(std::int32_t e) const { return kv.data() + static_cast<std::int64_t>(e) * slot_stride; }
  // A LayerView over the copy (entry e in "slot" e of kv), for the reference attention.
  LayerView<T> view(std::vector<std::int32_t>& slots) const {
    slots.resize(block.size());
    std::iota(slots.begin(), slots.end(), 0);
    LayerView<T> v;
    v.geometry() = geometry();
    v.seq_ids = ids.data();
    v.seq_len = len.data();
    v.indptr = indptr.data();
    v.slot = slots.data();
    v.block = block.data();
    v.valid_tokens = valid.data();
    v.pool = kv.data();
    return v;
  }
};

// Copies a view whose arrays and pool the host can read (a device view: download them first).
template <class T>
HostView<T> copy_host_view(const LayerView<T>& v) {
  HostView<T> h;
  h.geometry() = v.geometry();
  const auto B = static_cast<std::size_t>(v.batch_size);
  h.ids.assign(v.seq_ids, v.seq_ids + B);
  h.len.assign(v.seq_len, v.seq_len + B);
  h.indptr.assign(v.indptr, v.indptr + v.num_pairs() + 1);
  const auto n = static_cast<std::size_t>(h.indptr.back());
  h.slot.assign(v.slot, v.slot + n);
  h.block.assign(v.block, v.block + n);
  h.valid.assign(v.valid_tokens, v.valid_tokens + n);
  for (std::size_t e = 0; e < n; ++e) {
    const T* src = v.pool + static_cast<std::int64_t>(h.slot[e]) * v.slot_stride;
    h.kv.insert(h.kv.end(), src, src + v.slot_stride);
  }
  return h;
}

// Sequences, lengths, plan numbers, host rows and statistics: what a refused call must not
// change. Synchronises the cache.
template <class CacheT>
std::uint64_t cache_fingerprint(CacheT& cache, const std::vector<SeqId>& ids) {
  using T = typename CacheT::element_type;
  cache.synchronize();
  Fingerprint f;
  const auto& s = cache.layout().config.shape;
  f.add_value(cache.num_sequences());
  for (SeqId id : ids) {
    f.add_value(cache.has_sequence(id));
    if (!cache.has_sequence(id)) continue;
    const int slot = cache.block_table().find(id);
    f.add_value(cache.block_table().generation(slot));
    for (int l = 0; l < s.num_layers; ++l) {
      const std::int64_t len = cache.sequence_length(id, l);
      f.add_value(len);
      f.add_value(cache.block_table().next_plan(slot, l));
      f.add_value(cache.block_table().acquired_plan(slot, l));
      for (int h = 0; h < s.num_kv_heads; ++h) {
        if constexpr (requires { cache.backend().planned_blocks(slot, l, h); }) {
          for (std::int32_t b : cache.backend().planned_blocks(slot, l, h)) f.add_value(b);  // CPU: residency
        }
        for (std::int64_t t = 0; t < len; ++t) {
          f.add(cache.host_tier().key(slot, l, h, t), sizeof(T) * static_cast<std::size_t>(s.head_dim));
          f.add(cache.host_tier().value(slot, l, h, t), sizeof(T) * static_cast<std::size_t>(s.head_dim));
        }
      }
    }
  }
  for (const auto& ls : cache.statistics().layers) {
    f.add_value(ls.plans);
    f.add_value(ls.blocks_fetched);
    f.add_value(ls.admits_capped);
    f.add_value(ls.acquires);
    f.add_value(ls.observed_true_blocks);
  }
  return f.h;
}

// Drops from `list` (a layer's outstanding tickets, not acquired) those the cache counts as dead:
// a sequence removed or truncated since, or a plan no newer than the one its sequence last served
// at that layer (Cache::sweep_tickets' rule). A backend with a limit on live tickets per layer
// (CUDA's tickets_per_layer) counts exactly the ones left.
// prefetch, or nothing where a backend with a bounded ticket pool (CUDA) refused it because every
// record is held by dead tickets whose copies still wait behind an older plan of their sequences
// (documented; never refused by a backend without the bound). Any other refusal propagates.
template <class CacheT, class... Args>
std::optional<Ticket> prefetch_unless_records_full(CacheT& cache, Args&&... args) {
  try {
    return cache.prefetch(std::forward<Args>(args)...);
  } catch (const Error& e) {
    if (std::string(e.what()).find("has no free ticket record") == std::string::npos) throw;
    return std::nullopt;
  }
}

template <class CacheT>
void prune_dead_tickets(const CacheT& cache, int layer, std::vector<Ticket>& list) {
  const auto dead = [&](const Ticket& t) {
    for (std::size_t i = 0; i < t.sequences.size(); ++i) {
      const int s = cache.block_table().find(t.sequences[i]);
      if (s < 0 || cache.block_table().version(s) != t.generations[i] ||
          t.plans[i] <= cache.block_table().acquired_plan(s, layer)) {
        return true;
      }
    }
    return false;
  };
  list.erase(std::remove_if(list.begin(), list.end(), dead), list.end());
}

}  // namespace oasiskv::test
