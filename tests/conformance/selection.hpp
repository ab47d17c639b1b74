// Conformance cases (conformance.hpp registers them): what a plan selects and copies. A budget
// covering the context gives dense attention, the working set is the pinned blocks plus the
// brute-force top-K under every scorer, the fetch cap and the statistics, and a plan past the
// recent ring never serving a block still being filled.
#pragma once

#include "rig.hpp"

namespace oasiskv::test::conformance {

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

}  // namespace oasiskv::test::conformance
