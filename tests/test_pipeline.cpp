// The prefetch pipeline under random use: integrity of every resident slot and of the host tier,
// and stale tickets. Runs under TSan (suite "pipeline").
#include <cstring>
#include <map>
#include <set>

#include "support.hpp"

using namespace oasiskv;

namespace {

// Rows appended so far, in the host tier's block layout, per (sequence, layer, kv head).
struct ShadowTier {
  int layers, heads, dim, block_tokens;
  std::map<SeqId, std::vector<std::vector<float>>> data;  // [layer * heads + head]: blocks [K|V][bt][d]
  std::map<SeqId, std::vector<std::int64_t>> len;

  void add(SeqId id) {
    data[id].assign(static_cast<std::size_t>(layers * heads), {});
    len[id].assign(static_cast<std::size_t>(layers), 0);
  }
  void remove(SeqId id) {
    data.erase(id);
    len.erase(id);
  }
  void append(SeqId id, int layer, const float* k, const float* v, std::int64_t rows) {
    auto& n = len[id][static_cast<std::size_t>(layer)];
    const std::size_t be = static_cast<std::size_t>(2 * block_tokens * dim);
    for (std::int64_t r = 0; r < rows; ++r, ++n) {
      for (int h = 0; h < heads; ++h) {
        auto& d = data[id][static_cast<std::size_t>(layer * heads + h)];
        const std::size_t b = static_cast<std::size_t>(n / block_tokens), off = static_cast<std::size_t>(n % block_tokens);
        if (d.size() < (b + 1) * be) d.resize((b + 1) * be, 0.0f);
        std::memcpy(&d[b * be + off * static_cast<std::size_t>(dim)], k + (r * heads + h) * dim, sizeof(float) * static_cast<std::size_t>(dim));
        std::memcpy(&d[b * be + (static_cast<std::size_t>(block_tokens) + off) * static_cast<std::size_t>(dim)], v + (r * heads + h) * dim,
                    sizeof(float) * static_cast<std::size_t>(dim));
      }
    }
  }
  // K and V rows [0, valid) of block b.
  bool block_equals(SeqId id, int layer, int head, std::int64_t b, const float* kv, int valid) const {
    const auto& d = data.at(id)[static_cast<std::size_t>(layer * heads + head)];
    const std::size_t be = static_cast<std::size_t>(2 * block_tokens * dim);
    const std::size_t rows = static_cast<std::size_t>(valid) * static_cast<std::size_t>(dim) * sizeof(float);
    const float* ref = &d[static_cast<std::size_t>(b) * be];
    return std::memcmp(kv, ref, rows) == 0 &&
           std::memcmp(kv + block_tokens * dim, ref + block_tokens * dim, rows) == 0;
  }
};

void check_host_equals_shadow(const Cache<cpu, float>& cache, const ShadowTier& shadow) {
  const auto& L = cache.layout();
  for (const auto& [id, lens] : shadow.len) {
    const int slot = cache.block_table().find(id);
    REQUIRE(slot >= 0);
    for (int l = 0; l < shadow.layers; ++l) {
      const std::int64_t len = lens[static_cast<std::size_t>(l)];
      REQUIRE(cache.sequence_length(id, l) == len);
      for (int h = 0; h < shadow.heads; ++h) {
        const std::int64_t full = len / shadow.block_tokens;
        const float* host = cache.host_tier().block(slot, l, h, 0);
        const auto& d = shadow.data.at(id)[static_cast<std::size_t>(l * shadow.heads + h)];
        if (full > 0) {
          REQUIRE(std::memcmp(host, d.data(), static_cast<std::size_t>(full * L.block_elems) * sizeof(float)) == 0);
        }
        if (len % shadow.block_tokens != 0) {
          REQUIRE(shadow.block_equals(id, l, h, full, cache.host_tier().block(slot, l, h, full), static_cast<int>(len % shadow.block_tokens)));
        }
      }
    }
  }
}

// Every entry of an acquired view equals the host-tier block it names, for its valid rows.
void check_view(const LayerView<float>& view, const ShadowTier& shadow, const CacheLayout& L) {
  for (int i = 0; i < view.batch_size; ++i) {
    const SeqId id = view.seq_ids[i];
    REQUIRE(view.seq_len[i] == shadow.len.at(id)[static_cast<std::size_t>(view.layer)]);
    for (int h = 0; h < view.num_kv_heads; ++h) {
      const int p = i * view.num_kv_heads + h;
      REQUIRE(view.indptr[p + 1] - view.indptr[p] <= L.budget_blocks);
      std::set<std::int32_t> slots;
      for (std::int32_t e = view.indptr[p]; e < view.indptr[p + 1]; ++e) {
        if (e > view.indptr[p]) REQUIRE(view.block[e - 1] < view.block[e]);
        REQUIRE(slots.insert(view.slot[e]).second);
        REQUIRE(shadow.block_equals(id, view.layer, h, view.block[e], view.keys(e), view.valid_tokens[e]));
      }
    }
  }
}

}  // namespace

TEST_SUITE("pipeline") {
TEST_CASE("random append / prefetch / acquire / release / remove keeps every slot equal to the host tier") {
  OASISKV_SEEDED_RNG(rng);
  CacheConfig c;
  c.shape = ModelShape{2, 4, 2, 8};
  c.budget_tokens = 128;  // 1 sink + 3 ring + 4 selectable blocks
  c.recent_tokens = 32;
  c.max_sequences = 4;
  c.max_tokens_per_sequence = 400;
  c.fetch_ratio = 0.05;  // cap of 1 admit: plans lag behind selections, victims churn
  Cache<cpu, float> cache(c);
  const auto& L = cache.layout();
  const int H = c.shape.num_kv_heads, Hq = c.shape.num_q_heads, d = c.shape.head_dim;
  ShadowTier shadow{c.shape.num_layers, H, d, c.block_tokens, {}, {}};
  std::vector<SeqId> live;
  SeqId next_id = 1;
  std::map<int, std::vector<Ticket>> outstanding;  // per layer, oldest first
  std::map<int, Ticket> acquired;
  std::map<int, LayerView<float>> views;  // of the acquired tickets
  std::uniform_int_distribution<int> op(0, 99);
  int acquires = 0, stale_refused = 0;

  auto in_acquired = [&](SeqId id) {
    for (auto& [l, t] : acquired)
      if (std::find(t.sequences.begin(), t.sequences.end(), id) != t.sequences.end()) return true;
    return false;
  };
  auto random_batch = [&]() {
    std::vector<SeqId> b = live;
    std::shuffle(b.begin(), b.end(), rng);
    b.resize(std::uniform_int_distribution<std::size_t>(1, b.size())(rng));
    return b;
  };

  const int steps = 10000;
  for (int step = 0; step < steps; ++step) {
    const int o = op(rng);
    const int layer = std::uniform_int_distribution<int>(0, c.shape.num_layers - 1)(rng);
    if (o < 5 || live.empty()) {  // add
      if (live.size() < static_cast<std::size_t>(c.max_sequences)) {
        cache.add_sequence(next_id);
        shadow.add(next_id);
        live.push_back(next_id++);
      }
    } else if (o < 8) {  // remove
      const SeqId id = live[std::uniform_int_distribution<std::size_t>(0, live.size() - 1)(rng)];
      if (in_acquired(id)) {
        CHECK_THROWS_AS(cache.remove_sequence(id), Error);
      } else {
        cache.remove_sequence(id);
        shadow.remove(id);
        live.erase(std::find(live.begin(), live.end(), id));
      }
    } else if (o < 40) {  // append
      const auto batch = random_batch();
      const bool busy = acquired.count(layer) != 0 && std::any_of(batch.begin(), batch.end(), [&](SeqId id) {
        const auto& s = acquired[layer].sequences;
        return std::find(s.begin(), s.end(), id) != s.end();
      });
      std::vector<std::int32_t> rows;
      std::int64_t total = 0;
      bool fits = true;
      for (SeqId id : batch) {
        rows.push_back(std::uniform_int_distribution<std::int32_t>(0, o < 36 ? 2 : 40)(rng));
        total += rows.back();
        fits = fits && shadow.len[id][static_cast<std::size_t>(layer)] + rows.back() <= c.max_tokens_per_sequence;
      }
      auto k = test::random_rows<float>(rng, static_cast<std::size_t>(total * H * d));
      auto v = test::random_rows<float>(rng, static_cast<std::size_t>(total * H * d));
      if (busy || !fits) {
        CHECK_THROWS_AS(cache.append(batch, layer, rows, rows_view(k.data(), total), rows_view(v.data(), total)), Error);
      } else {
        cache.append(batch, layer, rows, rows_view(k.data(), total), rows_view(v.data(), total));
        std::int64_t off = 0;
        for (std::size_t i = 0; i < batch.size(); ++i) {
          shadow.append(batch[i], layer, k.data() + off * H * d, v.data() + off * H * d, rows[i]);
          off += rows[i];
        }
      }
    } else if (o < 65) {  // prefetch
      const auto batch = random_batch();
      const int R = std::uniform_int_distribution<int>(1, 2)(rng);
      auto q = test::random_rows<float>(rng, batch.size() * static_cast<std::size_t>(R * Hq * d), 2.0f);
      outstanding[layer].push_back(cache.prefetch(batch, layer, rows_view(q.data(), static_cast<std::int64_t>(R * batch.size()))));
    } else if (o < 85) {  // acquire: usually the newest ticket, sometimes an older one
      auto& list = outstanding[layer];
      if (!list.empty() && acquired.count(layer) == 0) {
        const bool oldest = std::bernoulli_distribution(0.3)(rng);
        const Ticket t = oldest ? list.front() : list.back();
        bool fresh = true;
        for (std::size_t i = 0; i < t.sequences.size(); ++i) {
          const int s = cache.block_table().find(t.sequences[i]);
          fresh = fresh && s >= 0 && cache.block_table().generation(s) == t.generations[i];
        }
        try {
          const auto view = cache.acquire(t);
          REQUIRE(fresh);
          check_view(view, shadow, L);
          acquired[layer] = t;
          views[layer] = view;
          ++acquires;
        } catch (const Error&) {
          stale_refused += !fresh;  // stale, or superseded by a newer ticket already served
        }
        // Older tickets than the one tried can no longer be served.
        list.erase(list.begin(), std::find_if(list.begin(), list.end(), [&](const Ticket& x) { return x.id == t.id; }) + 1);
      }
    } else {  // release
      if (acquired.count(layer)) {
        cache.release(acquired[layer]);
        acquired.erase(layer);
        views.erase(layer);
      }
    }
    check_host_equals_shadow(cache, shadow);
    // What attention may read right now still equals the host tier, whatever ran meanwhile.
    for (const auto& [l, view] : views) check_view(view, shadow, L);
  }
  for (auto& [l, t] : acquired) cache.release(t);
  CHECK(acquires > 500);
  CHECK(stale_refused > 0);
  CHECK(cache.statistics().total().blocks_fetched > 100);  // the run exercised copies
  CHECK(cache.statistics().total().admits_capped > 0);
}

TEST_CASE("a ticket made before its sequence was removed or reused is refused and stale copies never land") {
  OASISKV_SEEDED_RNG(rng);
  CacheConfig c = test::small_config(/*budget*/ 96, /*capacity*/ 512, /*sequences*/ 2);
  Cache<cpu, float> cache(c);
  const int H = c.shape.num_kv_heads, Hq = c.shape.num_q_heads, d = c.shape.head_dim;
  const std::vector<SeqId> batch{7};
  auto fill = [&](std::int64_t rows) {
    auto k = test::random_rows<float>(rng, static_cast<std::size_t>(rows * H * d));
    cache.append(batch, 0, std::vector<std::int32_t>{static_cast<std::int32_t>(rows)}, rows_view(k.data(), rows), rows_view(k.data(), rows));
    return k;
  };
  auto q = test::random_rows<float>(rng, static_cast<std::size_t>(Hq * d));
  cache.add_sequence(7);
  fill(300);
  const Ticket first = cache.prefetch(batch, 0, rows_view(q.data(), 1));   // copies run at once
  auto q2 = test::random_rows<float>(rng, static_cast<std::size_t>(Hq * d), 5.0f);
  const Ticket second = cache.prefetch(batch, 0, rows_view(q2.data(), 1)); // waits for `first` to retire

  cache.remove_sequence(7);
  CHECK_THROWS_WITH_AS(cache.acquire(first), doctest::Contains("sequence 7 was removed"), Error);
  cache.add_sequence(7);
  CHECK_THROWS_WITH_AS(cache.acquire(second), doctest::Contains("removed and added again"), Error);

  // The new sequence 7 gets its own rows; a fresh ticket serves exactly them.
  const auto rows = fill(300);
  const Ticket fresh = cache.prefetch(batch, 0, rows_view(q.data(), 1));
  const auto view = cache.acquire(fresh);
  for (int h = 0; h < H; ++h) {
    for (std::int32_t e = view.indptr[h]; e < view.indptr[h + 1]; ++e) {
      for (int r = 0; r < view.valid_tokens[e]; ++r) {
        const std::int64_t t = static_cast<std::int64_t>(view.block[e]) * 16 + r;
        REQUIRE(std::memcmp(view.keys(e) + r * d, rows.data() + (t * H + h) * d, sizeof(float) * static_cast<std::size_t>(d)) == 0);
      }
    }
  }
  cache.release(fresh);
  // Release/acquire ordering: a newer ticket's copies start only after the older one's release.
  CHECK_THROWS_WITH_AS(cache.acquire(first), doctest::Contains("stale"), Error);
}
}
