// The conformance suite's random test (conformance.hpp registers it): random use of the whole
// decode-side API, every acquired view checked against the rows appended.
#pragma once

#include "rig.hpp"

namespace oasiskv::test::conformance {

// The host tier holds every row of the shadow (synchronises the cache).
template <class CacheT, class T>
void check_host_rows(CacheT& cache, const Shadow<T>& shadow, const CacheLayout& L) {
  cache.synchronize();
  const int Hk = L.num_kv_heads(), d = L.head_dim(), width = Hk * d;
  for (const auto& [id, layers] : shadow.k) {
    const int slot = cache.block_table().find(id);
    REQUIRE(slot >= 0);
    for (int l = 0; l < L.num_layers(); ++l) {
      const std::int64_t len = shadow.length(id, l, width);
      REQUIRE(cache.sequence_length(id, l) == len);
      for (std::int64_t t = 0; t < len; ++t) {
        for (int h = 0; h < Hk; ++h) {
          const auto src = static_cast<std::size_t>((t * Hk + h) * d);
          REQUIRE(std::memcmp(cache.host_tier().key(slot, l, h, t), layers[static_cast<std::size_t>(l)].data() + src, sizeof(T) * static_cast<std::size_t>(d)) == 0);
          REQUIRE(std::memcmp(cache.host_tier().value(slot, l, h, t), shadow.v.at(id)[static_cast<std::size_t>(l)].data() + src, sizeof(T) * static_cast<std::size_t>(d)) == 0);
        }
      }
    }
  }
}

// Random append / truncate / prefetch (next_step_rows from 1 to past the recent ring) / acquire /
// release / remove: every acquired view equals the rows appended (less those truncated), and the
// host tier holds every row.
template <class H>
void random_integrity() {
  OASISKV_SEEDED_RNG(rng);
  CacheConfig c;
  c.shape = ModelShape{2, 4, 2, 8};
  c.budget_tokens = 128;  // 1 sink + 3 ring + 4 selectable blocks
  c.recent_tokens = 32;
  c.max_sequences = 4;
  c.max_tokens_per_sequence = 400;
  c.fetch_ratio = 0.05;  // cap of 1 admit: plans lag behind selections, victims churn
  Rig<H, float> rig(c);
  auto& cache = *rig.cache;
  const auto& L = rig.layout;
  const int Hk = L.num_kv_heads(), Hq = L.num_q_heads(), d = L.head_dim(), width = Hk * d;
  Shadow<float> shadow;
  shadow.layers = L.num_layers();
  std::vector<SeqId> live;
  SeqId next_id = 1;
  std::map<int, std::vector<Ticket>> outstanding;  // per layer, oldest first
  std::map<int, Ticket> acquired;
  int acquires = 0, truncates = 0;
  auto in_acquired = [&](SeqId id) {
    for (auto& [l, t] : acquired) {
      if (std::find(t.sequences.begin(), t.sequences.end(), id) != t.sequences.end()) return true;
    }
    return false;
  };
  auto random_batch = [&]() {
    std::vector<SeqId> b = live;
    std::shuffle(b.begin(), b.end(), rng);
    b.resize(std::uniform_int_distribution<std::size_t>(1, b.size())(rng));
    return b;
  };
  std::uniform_int_distribution<int> op(0, 99);
  for (int step = 0; step < H::random_steps; ++step) {
    const int o = op(rng);
    const int layer = std::uniform_int_distribution<int>(0, L.num_layers() - 1)(rng);
    if (o < 5 || live.empty()) {
      if (live.size() < static_cast<std::size_t>(c.max_sequences)) {
        cache.add_sequence(next_id);
        shadow.add(next_id);
        live.push_back(next_id++);
      }
    } else if (o < 8) {
      const SeqId id = live[std::uniform_int_distribution<std::size_t>(0, live.size() - 1)(rng)];
      if (in_acquired(id)) {
        CHECK_THROWS_AS(cache.remove_sequence(id), Error);
      } else {
        cache.remove_sequence(id);
        shadow.remove(id);
        live.erase(std::find(live.begin(), live.end(), id));
      }
    } else if (o < 12) {  // truncate: a rollback of some rows
      const SeqId id = live[std::uniform_int_distribution<std::size_t>(0, live.size() - 1)(rng)];
      std::int64_t longest = 0;
      for (int l = 0; l < L.num_layers(); ++l) longest = std::max(longest, shadow.length(id, l, width));
      const std::int64_t length = std::uniform_int_distribution<std::int64_t>(std::max<std::int64_t>(0, longest - 40), longest)(rng);
      if (in_acquired(id)) {
        CHECK_THROWS_AS(cache.truncate(id, length), Error);
      } else {
        cache.truncate(id, length);
        for (int l = 0; l < L.num_layers(); ++l) {
          auto& kk = shadow.k[id][static_cast<std::size_t>(l)];
          auto& vv = shadow.v[id][static_cast<std::size_t>(l)];
          const auto keep = static_cast<std::size_t>(std::min(length, shadow.length(id, l, width)) * width);
          kk.resize(keep);
          vv.resize(keep);
        }
        ++truncates;
      }
    } else if (o < 40) {
      const auto batch = random_batch();
      const bool busy = acquired.count(layer) != 0 && std::any_of(batch.begin(), batch.end(), [&](SeqId id) {
        const auto& s = acquired[layer].sequences;
        return std::find(s.begin(), s.end(), id) != s.end();
      });
      std::vector<std::int32_t> rows;
      bool fits = true;
      for (SeqId id : batch) {
        rows.push_back(std::uniform_int_distribution<std::int32_t>(0, o < 36 ? 2 : 40)(rng));
        fits = fits && shadow.length(id, layer, width) + rows.back() <= c.max_tokens_per_sequence;
      }
      if (busy || !fits) {
        const std::int64_t total = std::accumulate(rows.begin(), rows.end(), std::int64_t{0});
        auto k = random_rows<float>(rng, static_cast<std::size_t>(total * width));
        CHECK_THROWS_AS(cache.append(batch, layer, rows, rig.rows(k, total), rig.rows(k, total)), Error);
      } else {
        append_random(rig, shadow, rng, batch, layer, rows);
      }
      if (step % 97 == 0) check_host_rows(cache, shadow, L);
    } else if (o < 65) {
      prune_dead_tickets(cache, layer, outstanding[layer]);
      if (outstanding[layer].size() >= 2) continue;  // the protocol: at most two live per layer
      const auto batch = random_batch();
      const int R = std::uniform_int_distribution<int>(1, 2)(rng);
      auto q = random_rows<float>(rng, batch.size() * static_cast<std::size_t>(R * Hq * d), 2.0f);
      // Plans for steps of 1 row to well past the recent ring (a verify or prefill chunk).
      const std::int64_t next = std::bernoulli_distribution(0.5)(rng) ? 1 : std::uniform_int_distribution<std::int64_t>(1, 80)(rng);
      if (auto t = prefetch_unless_records_full(cache, batch, layer, rig.rows(q, static_cast<std::int64_t>(R * batch.size())), next)) {
        outstanding[layer].push_back(*t);
      }
    } else if (o < 85) {
      auto& list = outstanding[layer];
      if (!list.empty() && acquired.count(layer) == 0) {
        const Ticket t = std::bernoulli_distribution(0.3)(rng) ? list.front() : list.back();
        bool fresh = true;
        for (std::size_t i = 0; i < t.sequences.size(); ++i) {
          const int s = cache.block_table().find(t.sequences[i]);
          fresh = fresh && s >= 0 && cache.block_table().version(s) == t.generations[i];
        }
        try {
          const HostView<float> view = rig.read(cache.acquire(t));
          REQUIRE(fresh);
          check_view_rows(view, shadow, L);
          acquired[layer] = t;
          ++acquires;
        } catch (const Error&) {
          // stale, or superseded by a newer ticket already served
        }
        // t is served or refused; older tickets of t's sequences are superseded, others live on.
        list.erase(std::find_if(list.begin(), list.end(), [&](const Ticket& x) { return x.id == t.id; }));
        prune_dead_tickets(cache, layer, list);
      }
    } else if (acquired.count(layer) != 0) {
      cache.release(acquired[layer]);
      acquired.erase(layer);
    }
  }
  for (auto& [l, t] : acquired) cache.release(t);
  check_host_rows(cache, shadow, L);
  CHECK(acquires > H::random_steps / 50);
  CHECK(truncates > H::random_steps / 100);
}

}  // namespace oasiskv::test::conformance
