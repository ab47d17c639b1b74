// The conformance suite: one source, compiled for every backend (tests/test_conformance.cpp for
// the CPU, tests/cuda/test_conformance.cpp for CUDA, where it runs only with a GPU). Each case is
// a function template over a harness (harness.hpp); OASISKV_CONFORMANCE_CASES registers them all.
// Inputs are fresh seeded random rows (the seed is printed on failure; OASISKV_TEST_SEED reruns).
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
  for (int i = 0; i < v.batch; ++i) {
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

template <class H>
void lifecycle() {
  Rig<H, float> rig(small_config(128, 256, 3));
  auto& cache = *rig.cache;
  cache.add_sequence(5);
  cache.add_sequence(6);
  CHECK(cache.has_sequence(5));
  CHECK(cache.num_sequences() == 2);
  CHECK(cache.sequence_length(5, 1) == 0);
  CHECK_THROWS_WITH_AS(cache.add_sequence(5), doctest::Contains("sequence 5 is already in the cache"), Error);
  cache.add_sequence(7);
  CHECK_THROWS_WITH_AS(cache.add_sequence(8), doctest::Contains("all 3 sequence slots are in use"), Error);
  const std::uint32_t before = cache.block_table().generation(cache.block_table().find(6));
  cache.remove_sequence(6);
  CHECK_FALSE(cache.has_sequence(6));
  CHECK_THROWS_WITH_AS(cache.remove_sequence(6), doctest::Contains("sequence 6 is not in the cache"), Error);
  CHECK_THROWS_WITH_AS((void)cache.sequence_length(6, 0), doctest::Contains("sequence 6"), Error);
  CHECK_THROWS_WITH_AS((void)cache.sequence_length(5, 2), doctest::Contains("layer 2 is out of range [0, 2)"), Error);
  cache.add_sequence(6);
  CHECK(cache.block_table().generation(cache.block_table().find(6)) != before);
  CHECK(cache.num_sequences() == 3);
  CHECK_THROWS_WITH_AS(cache.abandon_capture(), doctest::Contains("no graph capture"), Error);
  CHECK(cache.layer_failure(0).empty());
}

// With a budget of at least the context, attention over the view equals dense attention.
template <class H, class T>
void dense_equivalence() {
  OASISKV_SEEDED_RNG(rng);
  Rig<H, T> rig(small_config(/*budget*/ 1024, /*capacity*/ 1024, /*sequences*/ 3));
  auto& cache = *rig.cache;
  const auto& L = rig.layout;
  const int H_ = L.num_kv_heads(), Hq = L.num_q_heads(), d = L.head_dim(), layers = L.num_layers();
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const std::vector<SeqId> batch{11, 22, 33};
  Shadow<T> shadow;
  shadow.layers = layers;
  for (SeqId id : batch) {
    cache.add_sequence(id);
    shadow.add(id);
  }
  std::vector<std::int32_t> prompt;
  for (std::size_t i = 0; i < batch.size(); ++i) prompt.push_back(std::uniform_int_distribution<std::int32_t>(1, 700)(rng));
  std::vector<Ticket> previous(static_cast<std::size_t>(layers));
  const auto B = static_cast<std::int64_t>(batch.size());
  // Rows per step: 1 (plain decoding) or more (verifying drafts); each plan is told how many the
  // step it serves appends (next_step_rows), so no block is lost leaving the recent ring.
  std::vector<std::int32_t> step_rows;
  for (int t = 0; t < 13; ++t) step_rows.push_back(t % 3 == 0 ? 1 : std::uniform_int_distribution<std::int32_t>(1, 20)(rng));
  for (int l = 0; l < layers; ++l) {
    append_random(rig, shadow, rng, batch, l, prompt);
    auto q = random_rows<float>(rng, static_cast<std::size_t>(B * Hq * d));
    previous[static_cast<std::size_t>(l)] = cache.prefetch(batch, l, rig.rows(q, B), step_rows[0]);
  }
  double worst = 0.0;
  for (int step = 0; step < 12; ++step) {
    for (int l = 0; l < layers; ++l) {
      append_random(rig, shadow, rng, batch, l, std::vector<std::int32_t>(batch.size(), step_rows[static_cast<std::size_t>(step)]));
      auto q_next = random_rows<float>(rng, static_cast<std::size_t>(2 * B * Hq * d));
      const Ticket next = cache.prefetch(batch, l, rig.rows(q_next, 2 * B), step_rows[static_cast<std::size_t>(step) + 1]);
      auto q = random_rows<float>(rng, static_cast<std::size_t>(B * Hq * d));
      std::vector<float> sparse(q.size()), dense(q.size());
      const HostView<T> hv = rig.read(cache.acquire(previous[static_cast<std::size_t>(l)]));
      cache.release(previous[static_cast<std::size_t>(l)]);
      check_view_rows(hv, shadow, L);
      std::vector<std::int32_t> slots;
      sparse_attention_reference(hv.view(slots), Hq, scale, q.data(), sparse.data());
      previous[static_cast<std::size_t>(l)] = next;
      for (std::size_t i = 0; i < batch.size(); ++i) {
        const auto& kk = shadow.k[batch[i]][static_cast<std::size_t>(l)];
        const auto& vv = shadow.v[batch[i]][static_cast<std::size_t>(l)];
        const auto len = static_cast<std::int64_t>(kk.size()) / (H_ * d);
        dense_attention_reference(kk.data(), vv.data(), len, Hq, H_, d, scale, q.data() + i * static_cast<std::size_t>(Hq * d),
                                  dense.data() + i * static_cast<std::size_t>(Hq * d));
      }
      for (std::size_t j = 0; j < dense.size(); j += static_cast<std::size_t>(d)) {
        double num = 0, den = 0;
        for (std::size_t c = 0; c < static_cast<std::size_t>(d); ++c) {
          num = std::max(num, std::fabs(static_cast<double>(sparse[j + c]) - dense[j + c]));
          den = std::max(den, std::fabs(static_cast<double>(dense[j + c])));
        }
        worst = std::max(worst, num / std::max(den, 1e-30));
      }
    }
  }
  CHECK(worst <= 1e-5);
  CHECK(cache.statistics().total().admits_capped == 0);
}

// The working set is the pinned blocks plus an independent brute-force top-K; select_blocks
// reports that ranking. (softmax_sum is CPU-exact only: see the CUDA parity tests.)
// Every block scorer (CacheConfig::scorer) against test::reference_block_score, bit for bit.
template <class H>
void working_set() {
  OASISKV_SEEDED_RNG(rng);
  for (GroupReduction reduction : {GroupReduction::max, GroupReduction::sum}) {
    for (int trial = 0; trial < 9; ++trial) {
      const BlockScore scorer = trial % 3 == 0 ? BlockScore::quest : BlockScore::spread;
      CAPTURE(reduction_name(reduction));
      CAPTURE(block_score_name(scorer));
      CacheConfig c = small_config(160, 2048, 1);  // 10 slots: 1 sink, 3 ring, 6 selected
      c.reduction = reduction;
      c.scorer = scorer;
      c.spread_alpha = std::uniform_real_distribution<float>(0.0f, 1.0f)(rng);
      CAPTURE(c.spread_alpha);
      Rig<H, float> rig(c);
      auto& cache = *rig.cache;
      const auto& L = rig.layout;
      const int Hk = L.num_kv_heads(), Hq = L.num_q_heads(), G = L.group_size, d = L.head_dim();
      cache.add_sequence(5);
      const std::vector<SeqId> batch{5};
      const std::int64_t rows = std::uniform_int_distribution<std::int64_t>(1, 500)(rng);
      const int R = std::uniform_int_distribution<int>(1, 3)(rng);
      auto k = random_rows<float>(rng, static_cast<std::size_t>(rows * Hk * d));
      auto v = random_rows<float>(rng, static_cast<std::size_t>(rows * Hk * d));
      auto q = random_rows<float>(rng, static_cast<std::size_t>(R * Hq * d));
      cache.append(batch, 1, std::vector<std::int32_t>{static_cast<std::int32_t>(rows)}, rig.rows(k, rows), rig.rows(v, rows));
      const Ticket t = cache.prefetch(batch, 1, rig.rows(q, R));
      const HostView<float> view = rig.read(cache.acquire(t));
      for (int h = 0; h < Hk; ++h) {
        CAPTURE(h);
        std::vector<float> head_keys;
        for (std::int64_t r = 0; r < rows; ++r) head_keys.insert(head_keys.end(), k.begin() + (r * Hk + h) * d, k.begin() + (r * Hk + h + 1) * d);
        const std::int64_t nb = L.blocks_for(rows);
        const std::int64_t first = L.sink_blocks;
        const std::int64_t last = std::max(first, std::min(nb, L.ring_start(rows + 1)));
        std::vector<float> scores;
        for (std::int64_t b = first; b < last; ++b) {
          float s = reduction == GroupReduction::max ? -INFINITY : 0.0f;
          for (int r = 0; r < R; ++r) {
            for (int g = 0; g < G; ++g) {
              const float x = reference_block_score(L.score, q.data() + (r * Hq + h * G + g) * d, head_keys, b * 16,
                                                    std::min<std::int64_t>(16, rows - b * 16), d);
              s = reduction == GroupReduction::max ? std::max(s, x) : s + x;
            }
          }
          scores.push_back(s);
        }
        std::vector<std::int32_t> expected = brute_top_k(scores, first, L.selectable_blocks);
        CHECK(cache.select_blocks(5, 1, rig.rows(q, R))[static_cast<std::size_t>(h)] == expected);
        for (std::int64_t b = 0; b < std::min<std::int64_t>(L.sink_blocks, nb); ++b) expected.push_back(static_cast<std::int32_t>(b));
        for (std::int64_t b = L.ring_start(rows); b < nb; ++b) expected.push_back(static_cast<std::int32_t>(b));
        std::sort(expected.begin(), expected.end());
        expected.erase(std::unique(expected.begin(), expected.end()), expected.end());
        std::vector<std::int32_t> got(view.block.begin() + view.indptr[static_cast<std::size_t>(h)],
                                      view.block.begin() + view.indptr[static_cast<std::size_t>(h) + 1]);
        CHECK(got == expected);
      }
      cache.release(t);
    }
  }
}

// The first plan fills the working set; later plans respect the fetch cap; statistics count it.
template <class H>
void fetch_cap_and_statistics() {
  OASISKV_SEEDED_RNG(rng);
  CacheConfig c = small_config(/*budget*/ 256, /*capacity*/ 2048, /*sequences*/ 1);
  c.fetch_ratio = 0.05;  // cap: 1 admit per (sequence, layer, kv head) and step
  Rig<H, float> rig(c);
  auto& cache = *rig.cache;
  const auto& L = rig.layout;
  REQUIRE(L.fetch_cap == 1);
  const int Hk = L.num_kv_heads(), Hq = L.num_q_heads(), d = L.head_dim();
  const std::vector<SeqId> batch{3};
  cache.add_sequence(3);
  const std::int64_t rows = 1000;
  auto k = random_rows<float>(rng, static_cast<std::size_t>(rows * Hk * d));
  cache.append(batch, 0, std::vector<std::int32_t>{static_cast<std::int32_t>(rows)}, rig.rows(k, rows), rig.rows(k, rows));
  auto q = random_rows<float>(rng, static_cast<std::size_t>(Hq * d));
  const Ticket first = cache.prefetch(batch, 0, rig.rows(q, 1));
  const LayerStatistics after_first = cache.statistics().total();
  CHECK(after_first.plans == static_cast<std::uint64_t>(Hk));
  CHECK(after_first.admits_capped == 0);
  CHECK(after_first.blocks_fetched == static_cast<std::uint64_t>(Hk * L.selectable_blocks));
  CHECK(after_first.bytes_fetched == after_first.blocks_fetched * static_cast<std::uint64_t>(L.block_elems) * sizeof(float));
  for (auto& x : q) x = -x;  // a very different query: many new blocks wanted, one admitted per kv head
  const Ticket second = cache.prefetch(batch, 0, rig.rows(q, 1));
  const LayerStatistics after_second = cache.statistics().total();
  CHECK(after_second.blocks_fetched - after_first.blocks_fetched == static_cast<std::uint64_t>(Hk));
  CHECK(after_second.admits_capped > 0);
  (void)rig.read(cache.acquire(second));
  // observe with the lookahead query as the true query: the first plan's blocks were all admitted.
  cache.observe(second, rig.rows(q, 1));
  cache.release(second);
  const LayerStatistics s = cache.statistics().total();
  CHECK(s.acquires == 1);
  CHECK(s.observed_true_blocks == static_cast<std::uint64_t>(Hk * L.selectable_blocks));
  CHECK(s.observed_hits <= s.observed_true_blocks);
  CHECK_THROWS_WITH_AS(cache.acquire(first), doctest::Contains("superseded"), Error);
  cache.reset_statistics();
  const LayerStatistics z = cache.statistics().total();
  CHECK(z.plans == 0);
  CHECK(z.blocks_fetched == 0);
  CHECK(z.observed_hits == 0);
  CHECK(z.acquires == 0);
}

// Tickets: supersede, release, stale, another cache's, and the copies of dead tickets.
template <class H>
void ticket_rules() {
  OASISKV_SEEDED_RNG(rng);
  CacheConfig c = small_config(96, 512, 2);
  c.fetch_ratio = 0.05;
  Rig<H, float> rig(c);
  auto& cache = *rig.cache;
  Shadow<float> shadow;
  shadow.layers = rig.layout.num_layers();
  const int Hq = rig.layout.num_q_heads(), d = rig.layout.head_dim();
  const std::vector<SeqId> batch{7};
  auto q = [&](float scale) { return random_rows<float>(rng, static_cast<std::size_t>(Hq * d), scale); };
  cache.add_sequence(7);
  shadow.add(7);
  append_random(rig, shadow, rng, batch, 0, {300});
  // a: acquired and released; b: pending behind a's gate; c: acquired, superseding b, whose
  // copies must still land first (c was planned against b's residency).
  auto qa = q(1.0f), qb = q(5.0f), qc = q(3.0f);
  const Ticket a = cache.prefetch(batch, 0, rig.rows(qa, 1));
  check_view_rows(rig.read(cache.acquire(a)), shadow, rig.layout);
  const Ticket b = cache.prefetch(batch, 0, rig.rows(qb, 1));
  const Ticket c2 = cache.prefetch(batch, 0, rig.rows(qc, 1));
  cache.release(a);
  CHECK_THROWS_WITH_AS(cache.acquire(a), doctest::Contains("was already acquired and released"), Error);
  check_view_rows(rig.read(cache.acquire(c2)), shadow, rig.layout);
  CHECK_THROWS_WITH_AS(cache.acquire(b), doctest::Contains("layer 0 already has ticket"), Error);
  cache.release(c2);
  CHECK_THROWS_WITH_AS(cache.acquire(b), doctest::Contains("superseded"), Error);
  // A ticket of another cache, even with the same id and sequences, is refused.
  Rig<H, float> other(c);
  other.cache->add_sequence(7);
  const Ticket foreign = other.cache->prefetch(batch, 0, other.rows(qa, 1));
  Ticket forged = foreign;
  forged.cache = cache.id();
  forged.id = 1000;
  CHECK_THROWS_WITH_AS(cache.acquire(foreign), doctest::Contains("issued by another cache"), Error);
  CHECK_THROWS_WITH_AS(cache.acquire(forged), doctest::Contains("stale"), Error);  // other generation
  // Every call that takes a ticket says so (the other cache's own ticket ids mean nothing here).
  CHECK_THROWS_WITH_AS(cache.release(foreign), doctest::Contains("release: ticket 1 was issued by another cache"), Error);
  CHECK_THROWS_WITH_AS(cache.observe(foreign, rig.rows(qa, 1)), doctest::Contains("observe: ticket 1 was issued by another cache"), Error);
  // Stale: removed, then removed and added again.
  const Ticket d1 = cache.prefetch(batch, 0, rig.rows(qa, 1));
  const Ticket d2 = cache.prefetch(batch, 1, rig.rows(qb, 1));
  cache.remove_sequence(7);
  shadow.remove(7);
  CHECK_THROWS_WITH_AS(cache.acquire(d1), doctest::Contains("sequence 7 was removed"), Error);
  cache.add_sequence(7);
  shadow.add(7);
  CHECK_THROWS_WITH_AS(cache.acquire(d2), doctest::Contains("removed and added again"), Error);
  // The new sequence 7 gets its own rows; a fresh ticket serves exactly them.
  append_random(rig, shadow, rng, batch, 0, {300});
  const Ticket fresh = cache.prefetch(batch, 0, rig.rows(qa, 1));
  check_view_rows(rig.read(cache.acquire(fresh)), shadow, rig.layout);
  CHECK_THROWS_WITH_AS(cache.acquire(fresh), doctest::Contains("layer 0 already has ticket"), Error);
  cache.release(fresh);
  Ticket unknown = fresh;
  unknown.id = 999;
  CHECK_THROWS_WITH_AS(cache.acquire(unknown), doctest::Contains("ticket 999 (layer 0) is unknown"), Error);
  // attend releases the ticket even when attention throws; the view it passes is the acquired one.
  const Ticket e1 = cache.prefetch(batch, 0, rig.rows(qb, 1));
  CHECK_THROWS_WITH_AS(cache.attend(e1, [](const LayerView<float>&) { throw std::runtime_error("attention failed"); }),
                       doctest::Contains("attention failed"), std::runtime_error);
  CHECK_THROWS_WITH_AS(cache.release(e1), doctest::Contains("is not acquired"), Error);
  const Ticket e2 = cache.prefetch(batch, 0, rig.rows(qc, 1));
  int calls = 0;
  cache.attend(e2, [&](const LayerView<float>& v) {
    ++calls;
    check_view_rows(rig.read(v), shadow, rig.layout);
  });
  CHECK(calls == 1);
  CHECK(cache.statistics().total().acquires >= 5);
}

// recover_layer: the layer's tickets are dropped and its next plan refills the working set.
template <class H>
void recover_layer() {
  OASISKV_SEEDED_RNG(rng);
  CacheConfig c = small_config(256, 2048, 2);
  c.fetch_ratio = 0.05;
  Rig<H, float> rig(c);
  auto& cache = *rig.cache;
  Shadow<float> shadow;
  shadow.layers = rig.layout.num_layers();
  const int Hk = rig.layout.num_kv_heads(), Hq = rig.layout.num_q_heads(), d = rig.layout.head_dim();
  const std::vector<SeqId> batch{1, 2};
  for (SeqId id : batch) {
    cache.add_sequence(id);
    shadow.add(id);
  }
  append_random(rig, shadow, rng, batch, 1, {700, 900});
  auto q = random_rows<float>(rng, static_cast<std::size_t>(2 * Hq * d));
  const Ticket t = cache.prefetch(batch, 1, rig.rows(q, 2));
  (void)cache.acquire(t);
  CHECK_THROWS_WITH_AS(cache.recover_layer(1), doctest::Contains("release it first"), Error);
  cache.release(t);
  const Ticket pending = cache.prefetch(batch, 1, rig.rows(q, 2));
  cache.recover_layer(1);
  CHECK_THROWS_AS(cache.acquire(pending), Error);
  cache.reset_statistics();
  for (auto& x : q) x = -x;
  const Ticket after = cache.prefetch(batch, 1, rig.rows(q, 2));
  CHECK(cache.statistics().total().blocks_fetched == static_cast<std::uint64_t>(2 * Hk * rig.layout.selectable_blocks));
  check_view_rows(rig.read(cache.acquire(after)), shadow, rig.layout);
  cache.release(after);
}

// truncate: views hold exactly the rows kept, the ring is rebuilt, tickets from before are stale,
// and the cache then selects exactly as a cache that never had the dropped rows.
template <class H>
void truncate_rows() {
  OASISKV_SEEDED_RNG(rng);
  CacheConfig c = small_config(160, 2048, 2);  // 1 sink, 3 ring, 6 selectable blocks
  c.fetch_ratio = 0.05;
  Rig<H, float> rig(c), fresh(c);
  auto& cache = *rig.cache;
  const auto& L = rig.layout;
  const int Hq = L.num_q_heads(), d = L.head_dim(), layers = L.num_layers();
  Shadow<float> shadow;
  shadow.layers = layers;
  const std::vector<SeqId> batch{3};
  cache.add_sequence(3);
  shadow.add(3);
  auto q = [&] { return random_rows<float>(rng, static_cast<std::size_t>(Hq * d), 2.0f); };
  for (int l = 0; l < layers; ++l) append_random(rig, shadow, rng, batch, l, {700});
  for (int l = 0; l < layers; ++l) {  // working sets filled: truncate has resident blocks to free
    const Ticket t0 = cache.prefetch(batch, l, rig.rows(q(), 1));
    check_view_rows(rig.read(cache.acquire(t0)), shadow, L);
    cache.release(t0);
  }
  // Refusals, each changing nothing.
  const Ticket held = cache.prefetch(batch, 0, rig.rows(q(), 1));
  (void)cache.acquire(held);
  const std::uint64_t before = cache_fingerprint(cache, {3});
  CHECK_THROWS_WITH_AS(cache.truncate(3, 600), doctest::Contains("release it first"), Error);
  CHECK_THROWS_WITH_AS(cache.truncate(3, 701), doctest::Contains("length 701 for sequence 3 is outside [0, 700]"), Error);
  CHECK_THROWS_WITH_AS(cache.truncate(3, -1), doctest::Contains("length -1"), Error);
  CHECK_THROWS_WITH_AS(cache.truncate(9, 0), doctest::Contains("sequence 9 is not in the cache"), Error);
  CHECK(cache_fingerprint(cache, {3}) == before);
  cache.release(held);
  // Rollbacks of drafts (inside a block, at block edges, into the ring and below it), then growth.
  for (const std::int64_t keep : {697, 690, 688, 640, 600, 17, 16, 3}) {
    CAPTURE(keep);
    const Ticket stale = cache.prefetch(batch, 1, rig.rows(q(), 1));
    cache.truncate(3, keep);
    for (int l = 0; l < layers; ++l) {
      shadow.k[3][static_cast<std::size_t>(l)].resize(static_cast<std::size_t>(keep * rig.kv_width()));
      shadow.v[3][static_cast<std::size_t>(l)].resize(static_cast<std::size_t>(keep * rig.kv_width()));
      CHECK(cache.sequence_length(3, l) == keep);
    }
    CHECK_THROWS_WITH_AS(cache.acquire(stale), doctest::Contains("was truncated after the prefetch"), Error);
    for (int l = 0; l < layers; ++l) {
      const Ticket t = cache.prefetch(batch, l, rig.rows(q(), 1));
      check_view_rows(rig.read(cache.acquire(t)), shadow, L);
      cache.release(t);
      append_random(rig, shadow, rng, batch, l, {std::uniform_int_distribution<std::int32_t>(1, 40)(rng)});
      const Ticket u = cache.prefetch(batch, l, rig.rows(q(), 1));
      check_view_rows(rig.read(cache.acquire(u)), shadow, L);
      cache.release(u);
    }
  }
  // A cache that only ever saw the rows kept selects the same blocks for any query.
  fresh.cache->add_sequence(3);
  for (int l = 0; l < layers; ++l) {
    const auto& kk = shadow.k[3][static_cast<std::size_t>(l)];
    const auto rows = static_cast<std::int64_t>(kk.size()) / rig.kv_width();
    fresh.cache->append(batch, l, std::vector<std::int32_t>{static_cast<std::int32_t>(rows)}, fresh.rows(kk, rows),
                        fresh.rows(shadow.v[3][static_cast<std::size_t>(l)], rows));
  }
  for (int trial = 0; trial < 20; ++trial) {
    const auto qq = q();
    const int l = trial % layers;
    CHECK(cache.select_blocks(3, l, rig.rows(qq, 1)) == fresh.cache->select_blocks(3, l, fresh.rows(qq, 1)));
  }
}

// Every bad call: an Error naming the bad value, and the cache unchanged.
template <class H>
void bad_calls() {
  OASISKV_SEEDED_RNG(rng);
  CacheConfig c = small_config(/*budget*/ 96, /*capacity*/ 256, /*sequences*/ 3);
  Rig<H, float> rig(c);
  auto& cache = *rig.cache;
  const int Hk = rig.layout.num_kv_heads(), Hq = rig.layout.num_q_heads(), d = rig.layout.head_dim();
  cache.add_sequence(1);
  cache.add_sequence(2);
  cache.add_sequence(3);
  cache.remove_sequence(3);
  const std::vector<SeqId> both{1, 2};
  for (int l = 0; l < rig.layout.num_layers(); ++l) {
    auto k = random_rows<float>(rng, static_cast<std::size_t>(80 * Hk * d));
    cache.append(both, l, std::vector<std::int32_t>{40, 40}, rig.rows(k, 80), rig.rows(k, 80));
  }
  auto q2h = random_rows<float>(rng, static_cast<std::size_t>(2 * Hq * d));
  const RowsView q2 = rig.rows(q2h, 2), q3 = rig.rows(q2h, 3);
  const Ticket acquired = cache.prefetch(both, 0, q2);
  const Ticket pending = cache.prefetch(both, 1, q2);
  (void)cache.acquire(acquired);

  const RowsView one = rig.rows(random_rows<float>(rng, static_cast<std::size_t>(Hk * d)), 1);
  const RowsView two = rig.rows(random_rows<float>(rng, static_cast<std::size_t>(2 * Hk * d)), 2);
  const RowsView q1 = rig.rows(random_rows<float>(rng, static_cast<std::size_t>(Hq * d)), 1);
  const RowsView big = rig.rows(random_rows<float>(rng, static_cast<std::size_t>(300 * Hk * d)), 300);
  const RowsView half = rig.rows(std::vector<fp16_t>(static_cast<std::size_t>(2 * Hk * d)), 2);
  const std::vector<SeqId> s1{1}, s2{2}, s99{99}, s3{3}, dup{1, 1}, none{};
  struct Case {
    const char* name;
    std::function<void()> call;
    const char* message;
  };
  std::vector<Case> cases = {
      {"append to an unknown sequence", [&] { cache.append(s99, 1, one, one); }, "sequence 99 is not in the cache"},
      {"append to a removed sequence", [&] { cache.append(s3, 1, one, one); }, "sequence 3 is not in the cache"},
      {"append at a layer past the model", [&] { cache.append(s2, 5, one, one); }, "layer 5 is out of range [0, 2)"},
      {"append at a negative layer", [&] { cache.append(s2, -1, one, one); }, "layer -1"},
      {"append past capacity", [&] { cache.append(s2, 1, std::vector<std::int32_t>{300}, big, big); }, "would hold 340 tokens, past its capacity of 256"},
      {"append a wrong row count", [&] { cache.append(both, 1, one, one); }, "k has 1 rows, expected 2"},
      {"append a wrong element type", [&] { cache.append(both, 1, half, two); }, "element type f16, but this cache holds f32"},
      {"append a null pointer", [&] { cache.append(both, 1, two, RowsView{nullptr, DType::f32, 2}); }, "v is a null pointer"},
      {"append a negative row count", [&] { cache.append(both, 1, std::vector<std::int32_t>{3, -1}, two, two); }, "rows_per_seq[1] (sequence 2) is negative: -1"},
      {"append row counts for another batch", [&] { cache.append(both, 1, std::vector<std::int32_t>{2}, two, two); }, "rows_per_seq has 1 entries for a batch of 2"},
      {"append one sequence twice", [&] { cache.append(dup, 1, two, two); }, "sequence 1 appears twice"},
      {"append an empty batch", [&] { cache.append(none, 1, RowsView{nullptr, DType::f32, 0}, RowsView{nullptr, DType::f32, 0}); }, "the batch is empty"},
      {"append under attention", [&] { cache.append(s1, 0, one, one); }, "sequence 1 at layer 0 is under attention"},
      {"prefetch q rows not a multiple of the batch", [&] { cache.prefetch(both, 1, q3); }, "q has 3 rows, expected a positive multiple of the batch size 2"},
      {"prefetch a null q", [&] { cache.prefetch(s1, 1, RowsView{nullptr, DType::f32, 1}); }, "q is a null pointer"},
      {"prefetch q of the wrong element type", [&] { cache.prefetch(s1, 1, RowsView{q1.data, DType::bf16, 1}); }, "element type bf16"},
      {"prefetch an unknown sequence", [&] { cache.prefetch(s99, 1, q1); }, "sequence 99"},
      {"prefetch at a layer past the model", [&] { cache.prefetch(s1, 2, q1); }, "layer 2 is out of range"},
      {"prefetch for a next step of no rows", [&] { cache.prefetch(s1, 1, q1, 0); }, "next_step_rows must be in [1, 256], got 0"},
      {"acquire before any prefetch", [&] { cache.acquire(Ticket{}); }, "empty ticket"},
      {"acquire while the layer holds another ticket", [&] { Ticket t = acquired; t.id += 100; cache.acquire(t); }, "layer 0 already has ticket"},
      {"acquire a ticket from another layer", [&] { Ticket t = pending; t.layer = 7; cache.acquire(t); }, "layer 7 is out of range"},
      {"acquire a malformed ticket", [&] { Ticket t = pending; t.plans.clear(); cache.acquire(t); }, "is malformed"},
      {"release a ticket that is not acquired", [&] { cache.release(pending); }, "is not acquired at layer 1"},
      {"observe a ticket that is not acquired", [&] { cache.observe(pending, q2); }, "is not acquired at layer 1"},
      {"observe with the wrong row count", [&] { cache.observe(acquired, q3); }, "q has 3 rows"},
      {"select_blocks of an unknown sequence", [&] { (void)cache.select_blocks(99, 0, q1); }, "sequence 99"},
      {"add a sequence twice", [&] { cache.add_sequence(2); }, "sequence 2 is already in the cache"},
      {"remove an unknown sequence", [&] { cache.remove_sequence(42); }, "sequence 42 is not in the cache"},
      {"remove a sequence under attention", [&] { cache.remove_sequence(2); }, "sequence 2 is in ticket"},
      {"recover a layer under attention", [&] { cache.recover_layer(0); }, "release it first"},
      {"length of an unknown sequence", [&] { (void)cache.sequence_length(77, 0); }, "sequence 77"},
  };
  auto nan_rows = random_rows<float>(rng, static_cast<std::size_t>(2 * Hk * d));
  nan_rows[5] = NAN;
  const RowsView nan = rig.rows(nan_rows, 2);
  if (H::reads_values) {
    cases.push_back({"append a NaN key", [&] { cache.append(both, 1, nan, two); }, "k holds a non-finite value (nan) at element 5"});
  }
  for (const auto& k : cases) {
    CAPTURE(k.name);
    const std::uint64_t before = cache_fingerprint(cache, {1, 2, 3});
    CHECK_THROWS_WITH_AS(k.call(), doctest::Contains(k.message), Error);
    CHECK(cache_fingerprint(cache, {1, 2, 3}) == before);
  }
  CHECK(cases.size() >= 30);
  cache.release(acquired);
}

}  // namespace oasiskv::test::conformance

namespace oasiskv::test::conformance {

// A plan whose next step appends more rows than the recent ring covers (next_step_rows past the
// ring: a verify or prefill chunk) never copies a block still being filled: every view shows
// exactly the rows appended. Every prompt length and step size of a small layout, with the
// copies landed before the step's rows (synchronize), and the budget covering every candidate.
template <class H>
void plan_past_the_ring() {
  OASISKV_SEEDED_RNG(rng);
  for (const int recent : {0, 16}) {
    for (const int sinks : {0, 16}) {
      CAPTURE(recent);
      CAPTURE(sinks);
      CacheConfig c = small_config(/*budget*/ 256, /*capacity*/ 256, /*sequences*/ 1);
      c.recent_tokens = recent;
      c.sink_tokens = sinks;
      Rig<H, float> rig(c);
      auto& cache = *rig.cache;
      const auto& L = rig.layout;
      const int ring_rows = L.ring_blocks * L.block_tokens();
      for (std::int64_t len = 1; len <= 50; len += 7) {
        for (std::int64_t next = 1; next <= ring_rows + 40; next += 3) {
          CAPTURE(len);
          CAPTURE(next);
          cache.add_sequence(1);
          Shadow<float> shadow;
          shadow.layers = L.num_layers();
          shadow.add(1);
          append_random(rig, shadow, rng, {1}, 0, {static_cast<std::int32_t>(len)});
          const auto q = random_rows<float>(rng, static_cast<std::size_t>(rig.q_width()), 2.0f);
          const Ticket t = cache.prefetch(std::vector<SeqId>{1}, 0, rig.rows(q, 1), next);
          cache.synchronize();  // the copies land before the step's rows arrive
          append_random(rig, shadow, rng, {1}, 0, {static_cast<std::int32_t>(next)});
          const HostView<float> view = rig.read(cache.acquire(t));
          check_view_rows(view, shadow, L);
          cache.release(t);
          cache.remove_sequence(1);
        }
      }
    }
  }
}

// Of a block shared by a sequence and its fork, both written by one append, one copy is taken:
// the second writer then holds the block alone. The pool accepts the batch exactly when it
// accepts the same appends one at a time.
template <class H>
void fork_batch_append() {
  OASISKV_SEEDED_RNG(rng);
  CacheConfig c = small_config(128, 256, 3);
  c.host_pool_blocks = 3;
  Rig<H, float> rig(c), apart(c);
  auto& cache = *rig.cache;
  const auto& pool = cache.host_tier().pool();
  Shadow<float> shadow;
  shadow.layers = rig.layout.num_layers();
  cache.add_sequence(1);
  shadow.add(1);
  for (int l = 0; l < shadow.layers; ++l) append_random(rig, shadow, rng, {1}, l, {20});  // block 1 partial
  REQUIRE(pool.blocks_in_use() == 2);
  cache.fork(1, 2);
  cache.fork(1, 3);
  for (SeqId id : {SeqId{2}, SeqId{3}}) {
    shadow.add(id);
    shadow.k[id] = shadow.k[1];
    shadow.v[id] = shadow.v[1];
  }
  // Three holders of block 1, one free block: three writers need two copies.
  const std::uint64_t before = cache_fingerprint(cache, {1, 2, 3});
  const std::vector<std::int32_t> ones{1, 1, 1};
  auto k3 = random_rows<float>(rng, static_cast<std::size_t>(3 * rig.kv_width()));
  CHECK_THROWS_WITH_AS(cache.append(std::vector<SeqId>{1, 2, 3}, 0, ones, rig.rows(k3, 3), rig.rows(k3, 3)),
                       doctest::Contains("needs 2 more blocks"), Error);
  CHECK(cache_fingerprint(cache, {1, 2, 3}) == before);
  cache.remove_sequence(3);
  shadow.remove(3);
  // Two holders: one copy, so the batch fits the one free block.
  for (int l = 0; l < shadow.layers; ++l) append_random(rig, shadow, rng, {1, 2}, l, {1, 1});
  CHECK(pool.blocks_in_use() == 3);
  CHECK(pool.free_blocks() == 0);
  for (SeqId id : {SeqId{1}, SeqId{2}}) {
    for (int l = 0; l < shadow.layers; ++l) {
      const auto q = random_rows<float>(rng, static_cast<std::size_t>(rig.q_width()), 2.0f);
      const Ticket t = cache.prefetch(std::vector<SeqId>{id}, l, rig.rows(q, 1));
      check_view_rows(rig.read(cache.acquire(t)), shadow, rig.layout);
      cache.release(t);
    }
  }
  // The same two appends one at a time take the same blocks.
  auto& other = *apart.cache;
  other.add_sequence(1);
  const auto k20 = random_rows<float>(rng, static_cast<std::size_t>(20 * rig.kv_width()));
  for (int l = 0; l < shadow.layers; ++l) other.append(std::vector<SeqId>{1}, l, std::vector<std::int32_t>{20}, apart.rows(k20, 20), apart.rows(k20, 20));
  other.fork(1, 2);
  const auto k1 = random_rows<float>(rng, static_cast<std::size_t>(rig.kv_width()));
  for (int l = 0; l < shadow.layers; ++l) {
    other.append(std::vector<SeqId>{1}, l, apart.rows(k1, 1), apart.rows(k1, 1));
    other.append(std::vector<SeqId>{2}, l, apart.rows(k1, 1), apart.rows(k1, 1));
  }
  CHECK(other.host_tier().pool().blocks_in_use() == pool.blocks_in_use());
}

// Fork: full blocks shared (the pool grows by nothing), the partial block copied by the first
// append that writes it (the source's rows untouched), the fork's first plan uncapped, removal
// freeing only blocks no one else holds, and a fork's selection equal to that of a sequence that
// only ever had the rows it forked.
template <class H>
void fork_shares_blocks() {
  OASISKV_SEEDED_RNG(rng);
  CacheConfig c = small_config(160, 2048, 4);  // 1 sink, 3 ring, 6 selectable blocks
  c.fetch_ratio = 0.05;                        // cap: 1 admit per step, except a first plan
  Rig<H, float> rig(c), fresh(c);
  auto& cache = *rig.cache;
  const auto& L = rig.layout;
  const auto& pool = cache.host_tier().pool();
  const int Hq = L.num_q_heads(), d = L.head_dim(), layers = L.num_layers();
  Shadow<float> shadow;
  shadow.layers = layers;
  auto q = [&] { return random_rows<float>(rng, static_cast<std::size_t>(Hq * d), 2.0f); };
  cache.add_sequence(1);
  shadow.add(1);
  for (int l = 0; l < layers; ++l) append_random(rig, shadow, rng, {1}, l, {1000});  // 62 full blocks + 8 rows
  CHECK(pool.blocks_in_use() == 63);
  auto copy_rows = [&](SeqId from, SeqId to, std::int64_t length) {
    shadow.add(to);
    for (int l = 0; l < layers; ++l) {
      const auto n = static_cast<std::ptrdiff_t>(length * rig.kv_width());
      shadow.k[to][static_cast<std::size_t>(l)].assign(shadow.k[from][static_cast<std::size_t>(l)].begin(), shadow.k[from][static_cast<std::size_t>(l)].begin() + n);
      shadow.v[to][static_cast<std::size_t>(l)].assign(shadow.v[from][static_cast<std::size_t>(l)].begin(), shadow.v[from][static_cast<std::size_t>(l)].begin() + n);
    }
  };
  // Refusals change nothing.
  const std::uint64_t before = cache_fingerprint(cache, {1});
  CHECK_THROWS_WITH_AS(cache.fork(9, 2), doctest::Contains("sequence 9 is not in the cache"), Error);
  CHECK_THROWS_WITH_AS(cache.fork(1, 1), doctest::Contains("1 is already in the cache"), Error);
  CHECK_THROWS_WITH_AS(cache.fork(1, 2, 1001), doctest::Contains("length 1001 for a fork of sequence 1 is outside [0, 1000]"), Error);
  CHECK_THROWS_WITH_AS(cache.fork(1, 2, -3), doctest::Contains("length -3"), Error);
  CHECK(cache_fingerprint(cache, {1}) == before);
  CHECK(!cache.has_sequence(2));

  cache.fork(1, 2);
  copy_rows(1, 2, 1000);
  CHECK(pool.blocks_in_use() == 63);  // nothing copied
  for (int l = 0; l < layers; ++l) CHECK(cache.sequence_length(2, l) == 1000);
  // The fork's first plan is uncapped, like a new sequence's: all 6 selectable blocks admitted.
  const Ticket first = cache.prefetch(std::vector<SeqId>{2}, 0, rig.rows(q(), 1));
  check_view_rows(rig.read(cache.acquire(first)), shadow, L);
  cache.release(first);
  CHECK(cache.statistics().layers[0].blocks_fetched == static_cast<std::uint64_t>(L.num_kv_heads() * L.selectable_blocks));
  // The first append to the shared partial block copies it; the source keeps its rows.
  for (int l = 0; l < layers; ++l) append_random(rig, shadow, rng, {2}, l, {3});
  CHECK(pool.blocks_in_use() == 64);
  for (int l = 0; l < layers; ++l) append_random(rig, shadow, rng, {1}, l, {20});  // 1's partial block is its own now
  CHECK(pool.blocks_in_use() == 65);
  // A fork inside a block: its partial block's summary comes from its own rows only.
  cache.fork(1, 3, 700);
  copy_rows(1, 3, 700);
  CHECK(pool.blocks_in_use() == 65);
  for (SeqId id : {SeqId{1}, SeqId{2}, SeqId{3}}) {
    for (int l = 0; l < layers; ++l) {
      const Ticket t = cache.prefetch(std::vector<SeqId>{id}, l, rig.rows(q(), 1));
      check_view_rows(rig.read(cache.acquire(t)), shadow, L);
      cache.release(t);
    }
  }
  fresh.cache->add_sequence(3);
  for (int l = 0; l < layers; ++l) {
    fresh.cache->append(std::vector<SeqId>{3}, l, std::vector<std::int32_t>{700}, fresh.rows(shadow.k[3][static_cast<std::size_t>(l)], 700),
                        fresh.rows(shadow.v[3][static_cast<std::size_t>(l)], 700));
  }
  for (int trial = 0; trial < 10; ++trial) {
    const auto qq = q();
    for (int l = 0; l < layers; ++l) {
      CHECK(cache.select_blocks(3, l, rig.rows(qq, 1)) == fresh.cache->select_blocks(3, l, fresh.rows(qq, 1)));
    }
  }
  // Removal frees only what no one else holds: 1 holds 64 blocks, 62 shared with 2 and 44 with 3.
  cache.remove_sequence(1);
  CHECK(pool.blocks_in_use() == 63);  // 1's blocks 62 and 63 went back
  cache.remove_sequence(2);
  CHECK(pool.blocks_in_use() == 44);  // 3: 43 full blocks and its partial one
  cache.remove_sequence(3);
  CHECK(pool.blocks_in_use() == 0);
  CHECK(pool.free_blocks() == pool.capacity());
}

}  // namespace oasiskv::test::conformance

#include "random_integrity.hpp"
#include "random_sequence_ops.hpp"

// Registers every conformance case for harness H with TEST_MACRO (TEST_CASE, or a macro that
// counts cases), names prefixed by PREFIX (a string literal). No commas or semicolons in the names:
// ctest discovery drops the labels of the one and splits the other.
#define OASISKV_CONFORMANCE_CASES(H, TEST_MACRO, PREFIX)                                                          \
  TEST_MACRO(PREFIX "conformance: sequence lifecycle") { ::oasiskv::test::conformance::lifecycle<H>(); }          \
  TEST_MACRO(PREFIX "conformance: a budget covering the context gives dense attention (float)") {                \
    ::oasiskv::test::conformance::dense_equivalence<H, float>();                                                  \
  }                                                                                                               \
  TEST_MACRO(PREFIX "conformance: a budget covering the context gives dense attention (fp16)") {                 \
    ::oasiskv::test::conformance::dense_equivalence<H, ::oasiskv::fp16_t>();                                      \
  }                                                                                                               \
  TEST_MACRO(PREFIX "conformance: a budget covering the context gives dense attention (bf16)") {                 \
    ::oasiskv::test::conformance::dense_equivalence<H, ::oasiskv::bf16_t>();                                      \
  }                                                                                                               \
  TEST_MACRO(PREFIX "conformance: the working set is the pinned blocks plus the brute-force top-K") {            \
    ::oasiskv::test::conformance::working_set<H>();                                                               \
  }                                                                                                               \
  TEST_MACRO(PREFIX "conformance: the fetch cap and the statistics") {                                           \
    ::oasiskv::test::conformance::fetch_cap_and_statistics<H>();                                                  \
  }                                                                                                               \
  TEST_MACRO(PREFIX "conformance: ticket rules - supersede release stale and another cache") {                    \
    ::oasiskv::test::conformance::ticket_rules<H>();                                                              \
  }                                                                                                               \
  TEST_MACRO(PREFIX "conformance: recover_layer drops the layer's tickets and refills it") {                     \
    ::oasiskv::test::conformance::recover_layer<H>();                                                             \
  }                                                                                                               \
  TEST_MACRO(PREFIX "conformance: truncate keeps exactly the rows below the length as if never appended") {    \
    ::oasiskv::test::conformance::truncate_rows<H>();                                                             \
  }                                                                                                               \
  TEST_MACRO(PREFIX "conformance: bad calls are refused with the value named and change nothing") {              \
    ::oasiskv::test::conformance::bad_calls<H>();                                                                 \
  }                                                                                                               \
  TEST_MACRO(PREFIX "conformance: random use keeps every view and the host tier equal to the rows appended") {   \
    ::oasiskv::test::conformance::random_integrity<H>();                                                          \
  }                                                                                                               \
  TEST_MACRO(PREFIX "conformance: fork shares full blocks and copies the partial block on first write") {     \
    ::oasiskv::test::conformance::fork_shares_blocks<H>();                                                        \
  }                                                                                                               \
  TEST_MACRO(PREFIX "conformance: random sequence operations with forks match a reference model bit for bit") {   \
    ::oasiskv::test::conformance::random_sequence_ops<H>();                                                       \
  }                                                                                                               \
  TEST_MACRO(PREFIX "conformance: a plan past the recent ring never serves a block still being filled") {        \
    ::oasiskv::test::conformance::plan_past_the_ring<H>();                                                        \
  }                                                                                                               \
  TEST_MACRO(PREFIX "conformance: a sequence and its fork appended in one batch take one copy of their block") { \
    ::oasiskv::test::conformance::fork_batch_append<H>();                                                         \
  }
