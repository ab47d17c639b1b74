// The conformance suite's test rig (every case file includes it): a Rig over a harness (its
// cache, its inputs, host copies of its views), the Shadow of the rows appended so far, and the
// check that a view holds exactly the shadow's rows of its blocks.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "harness.hpp"
#include "../reference_selection.hpp"

namespace oasiskv::test::conformance {

template <class H, class T>
struct Rig {
  H harness;
  std::unique_ptr<typename H::template CacheOf<T>> cache;
  CacheLayout layout;
  explicit Rig(const CacheConfig& c) : cache(harness.template make<T>(c)), layout(cache->layout()) {}
  template <class V>
  RowsView rows(const std::vector<V>& host, std::int64_t n) {
    return harness.input(host, n);
  }
  HostView<T> read(const LayerView<T>& v) { return harness.read(*cache, v); }
  int kv_width() const { return layout.num_kv_heads() * layout.head_dim(); }
  int q_width() const { return layout.num_q_heads() * layout.head_dim(); }
};

// Rows appended so far, per (sequence, layer): [token][kv head][head_dim], K and V.
template <class T>
struct Shadow {
  std::map<SeqId, std::vector<std::vector<T>>> k, v;
  int layers = 0;
  void add(SeqId id) {
    k[id].assign(static_cast<std::size_t>(layers), {});
    v[id].assign(static_cast<std::size_t>(layers), {});
  }
  void remove(SeqId id) {
    k.erase(id);
    v.erase(id);
  }
  std::int64_t length(SeqId id, int layer, int width) const {
    return static_cast<std::int64_t>(k.at(id)[static_cast<std::size_t>(layer)].size()) / width;
  }
};

// Every entry of the view holds, in its valid rows, the shadow's rows of its block; blocks
// ascend per pair, slots are distinct, and the pair fits the budget.
template <class T>
void check_view_rows(const HostView<T>& v, const Shadow<T>& shadow, const CacheLayout& L) {
  const int H = L.num_kv_heads(), d = L.head_dim(), bt = L.block_tokens();
  for (int i = 0; i < v.batch_size; ++i) {
    const SeqId id = v.ids[static_cast<std::size_t>(i)];
    const auto& ks = shadow.k.at(id)[static_cast<std::size_t>(v.layer)];
    const auto& vs = shadow.v.at(id)[static_cast<std::size_t>(v.layer)];
    REQUIRE(v.len[static_cast<std::size_t>(i)] == static_cast<std::int64_t>(ks.size()) / (H * d));
    for (int h = 0; h < H; ++h) {
      const int p = i * H + h;
      REQUIRE(v.indptr[static_cast<std::size_t>(p) + 1] - v.indptr[static_cast<std::size_t>(p)] <= L.budget_blocks);
      std::set<std::int32_t> slots;
      for (std::int32_t e = v.indptr[static_cast<std::size_t>(p)]; e < v.indptr[static_cast<std::size_t>(p) + 1]; ++e) {
        const auto ue = static_cast<std::size_t>(e);
        if (e > v.indptr[static_cast<std::size_t>(p)]) REQUIRE(v.block[ue - 1] < v.block[ue]);
        REQUIRE(slots.insert(v.slot[ue]).second);
        for (int r = 0; r < v.valid[ue]; ++r) {
          const std::int64_t t = static_cast<std::int64_t>(v.block[ue]) * bt + r;
          const T* key = v.keys(e) + static_cast<std::int64_t>(r) * d;
          const T* val = v.keys(e) + static_cast<std::int64_t>(bt + r) * d;
          const auto src = static_cast<std::size_t>((t * H + h) * d);
          REQUIRE(std::memcmp(key, ks.data() + src, sizeof(T) * static_cast<std::size_t>(d)) == 0);
          REQUIRE(std::memcmp(val, vs.data() + src, sizeof(T) * static_cast<std::size_t>(d)) == 0);
        }
      }
    }
  }
}

// Appends rows_per_seq random rows to the cache and the shadow.
template <class H, class T>
void append_random(Rig<H, T>& rig, Shadow<T>& shadow, std::mt19937_64& rng, const std::vector<SeqId>& batch, int layer,
                   const std::vector<std::int32_t>& rows) {
  std::int64_t total = 0;
  for (auto n : rows) total += n;
  const auto w = static_cast<std::size_t>(rig.kv_width());
  auto k = random_rows<T>(rng, static_cast<std::size_t>(total) * w);
  auto v = random_rows<T>(rng, static_cast<std::size_t>(total) * w);
  rig.cache->append(batch, layer, rows, rig.rows(k, total), rig.rows(v, total));
  std::size_t off = 0;
  for (std::size_t i = 0; i < batch.size(); ++i) {
    const std::size_t n = static_cast<std::size_t>(rows[i]) * w;
    auto& kk = shadow.k[batch[i]][static_cast<std::size_t>(layer)];
    auto& vv = shadow.v[batch[i]][static_cast<std::size_t>(layer)];
    kk.insert(kk.end(), k.begin() + static_cast<std::ptrdiff_t>(off), k.begin() + static_cast<std::ptrdiff_t>(off + n));
    vv.insert(vv.end(), v.begin() + static_cast<std::ptrdiff_t>(off), v.begin() + static_cast<std::ptrdiff_t>(off + n));
    off += n;
  }
}

}  // namespace oasiskv::test::conformance
