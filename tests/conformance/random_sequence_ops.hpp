// The conformance suite's sequence-operations test (conformance.hpp registers it): random append,
// truncate, fork, remove, add and prefetch / acquire / release over 8 sequences and a small host
// pool, against a plain reference model: per sequence and layer the rows appended (forks copy
// them), block summaries folded from those rows, and the pool as abstract block identities with
// reference counts. After every operation every host row and every block summary equals the
// reference bit for bit and the pool holds exactly the reference's distinct blocks; bad calls
// (and appends the pool cannot hold) throw and change nothing.
#pragma once

#include <cstring>
#include <limits>

#include "rig.hpp"

namespace oasiskv::test::conformance {

// Host pool blocks as identities: a sequence's block list, and how many sequences hold each.
struct ReferencePool {
  std::map<SeqId, std::vector<int>> blocks;
  std::map<int, int> refs;
  int next = 0;
  std::int64_t capacity = 0;

  std::int64_t in_use() const { return static_cast<std::int64_t>(refs.size()); }
  void drop(int b) {
    if (--refs[b] == 0) refs.erase(b);
  }
  // Fresh blocks an append of rows[i] rows to batch[i] at lengths[i] takes, in batch order: a
  // shared block is copied while another holder remains, so of a block shared by a sequence and
  // its fork, both written by one append, only the first writer takes a copy.
  std::int64_t needed(const std::vector<SeqId>& batch, const std::vector<std::int64_t>& lengths,
                      const std::vector<std::int32_t>& rows, int bt) const {
    ReferencePool trial = *this;
    for (std::size_t i = 0; i < batch.size(); ++i) trial.write(batch[i], lengths[i], rows[i], bt);
    return trial.next - next;
  }
  void write(SeqId id, std::int64_t length, std::int64_t rows, int bt) {
    if (rows <= 0) return;
    auto& list = blocks.at(id);
    for (std::int64_t b = length / bt; b <= (length + rows - 1) / bt; ++b) {
      if (b >= static_cast<std::int64_t>(list.size())) {
        list.push_back(next);
        refs[next++] = 1;
      } else if (refs[list[static_cast<std::size_t>(b)]] > 1) {
        drop(list[static_cast<std::size_t>(b)]);
        list[static_cast<std::size_t>(b)] = next;
        refs[next++] = 1;
      }
    }
  }
  void keep(SeqId id, std::int64_t nblocks) {
    auto& list = blocks.at(id);
    while (static_cast<std::int64_t>(list.size()) > nblocks) {
      drop(list.back());
      list.pop_back();
    }
  }
  void fork(SeqId src, SeqId dst, std::int64_t nblocks) {
    const auto& from = blocks.at(src);
    auto& to = blocks[dst];
    to.assign(from.begin(), from.begin() + nblocks);
    for (int b : to) ++refs[b];
  }
  void remove(SeqId id) {
    keep(id, 0);
    blocks.erase(id);
  }
};

// Summary of one block of the reference rows ([token][kv head][d] at one layer), folded as
// SummaryStore::add_key folds: the first row resets, later rows take std::max / std::min.
template <class T>
void reference_summary(const std::vector<T>& rows, std::int64_t length, int kv_heads, int d, int h, std::int64_t b,
                       int bt, std::vector<float>& out) {
  out.assign(static_cast<std::size_t>(2 * d), 0.0f);
  const std::int64_t end = std::min<std::int64_t>(length, (b + 1) * bt);
  for (std::int64_t t = b * bt; t < end; ++t) {
    const T* key = rows.data() + (t * kv_heads + h) * d;
    for (int c = 0; c < d; ++c) {
      const float x = to_float(key[c]);
      auto& mx = out[static_cast<std::size_t>(c)];
      auto& mn = out[static_cast<std::size_t>(d + c)];
      if (t == b * bt) {
        mx = mn = x;
      } else {
        mx = std::max(mx, x);
        mn = std::min(mn, x);
      }
    }
  }
}

template <class H>
void random_sequence_ops() {
  OASISKV_SEEDED_RNG(rng);
  MESSAGE("random sequence operations: seed " << rng_seed << " (set OASISKV_TEST_SEED to rerun it)");
  CacheConfig c;
  c.shape = ModelShape{2, 2, 1, 4};
  c.block_tokens = 4;
  c.sink_tokens = 4;
  c.recent_tokens = 8;
  c.budget_tokens = 32;  // 1 sink + 3 ring + 4 selectable blocks
  c.max_sequences = 8;
  c.max_tokens_per_sequence = 48;  // 12 blocks
  c.host_pool_blocks = 40;         // under the 96 that 8 full sequences would take: appends run out
  c.fetch_ratio = 0.25;
  Rig<H, float> rig(c);
  auto& cache = *rig.cache;
  const auto& L = rig.layout;
  const int Hk = L.num_kv_heads(), Hq = L.num_q_heads(), d = L.head_dim(), width = Hk * d, bt = L.block_tokens();
  Shadow<float> shadow;
  shadow.layers = L.num_layers();
  ReferencePool pool;
  pool.capacity = c.host_pool_blocks;
  std::vector<SeqId> live;
  SeqId next_id = 1;
  std::map<int, std::vector<Ticket>> outstanding;
  std::map<int, Ticket> acquired;
  std::map<std::string, int> done;  // operations that took effect, by kind
  std::vector<float> expect;

  auto length_of = [&](SeqId id, int l) { return shadow.length(id, l, width); };
  auto longest = [&](SeqId id) {
    std::int64_t n = 0;
    for (int l = 0; l < L.num_layers(); ++l) n = std::max(n, length_of(id, l));
    return n;
  };
  auto shortest = [&](SeqId id) {
    std::int64_t n = std::numeric_limits<std::int64_t>::max();
    for (int l = 0; l < L.num_layers(); ++l) n = std::min(n, length_of(id, l));
    return n;
  };
  auto in_acquired = [&](SeqId id) {
    for (auto& [l, t] : acquired) {
      if (std::find(t.sequences.begin(), t.sequences.end(), id) != t.sequences.end()) return true;
    }
    return false;
  };
  auto pick = [&]() { return live[std::uniform_int_distribution<std::size_t>(0, live.size() - 1)(rng)]; };
  auto check_all = [&]() {
    cache.synchronize();
    rig.harness.keep.clear();  // every input was consumed
    const std::vector<float> summaries = rig.harness.summaries(cache);
    REQUIRE(cache.host_tier().pool().blocks_in_use() == pool.in_use());
    REQUIRE(cache.host_tier().pool().free_blocks() == pool.capacity - pool.in_use());
    for (const auto& [id, layers] : shadow.k) {
      const int slot = cache.block_table().find(id);
      REQUIRE(slot >= 0);
      REQUIRE(cache.host_tier().pool().mapped_blocks(slot) == static_cast<std::int64_t>(pool.blocks.at(id).size()));
      for (int l = 0; l < L.num_layers(); ++l) {
        const std::int64_t len = length_of(id, l);
        REQUIRE(cache.sequence_length(id, l) == len);
        const auto& ks = layers[static_cast<std::size_t>(l)];
        const auto& vs = shadow.v.at(id)[static_cast<std::size_t>(l)];
        for (int h = 0; h < Hk; ++h) {
          for (std::int64_t t = 0; t < len; ++t) {
            const auto src = static_cast<std::size_t>((t * Hk + h) * d);
            REQUIRE(std::memcmp(cache.host_tier().key(slot, l, h, t), ks.data() + src, sizeof(float) * static_cast<std::size_t>(d)) == 0);
            REQUIRE(std::memcmp(cache.host_tier().value(slot, l, h, t), vs.data() + src, sizeof(float) * static_cast<std::size_t>(d)) == 0);
          }
          for (std::int64_t b = 0; b < L.blocks_for(len); ++b) {
            reference_summary(ks, len, Hk, d, h, b, bt, expect);
            REQUIRE(std::memcmp(summaries.data() + L.summary_offset(slot, l, h, b), expect.data(), expect.size() * sizeof(float)) == 0);
          }
        }
      }
    }
  };

  std::uniform_int_distribution<int> op(0, 99);
  for (int step = 0; step < H::sequence_ops; ++step) {
    CAPTURE(step);
    const int o = op(rng);
    const int layer = std::uniform_int_distribution<int>(0, L.num_layers() - 1)(rng);
    if (o < 4 || live.empty()) {  // add
      if (live.size() < static_cast<std::size_t>(c.max_sequences)) {
        cache.add_sequence(next_id);
        shadow.add(next_id);
        pool.blocks[next_id];
        live.push_back(next_id++);
        ++done["add"];
      }
    } else if (o < 8) {  // remove
      const SeqId id = pick();
      if (in_acquired(id)) {
        CHECK_THROWS_AS(cache.remove_sequence(id), Error);
      } else {
        cache.remove_sequence(id);
        shadow.remove(id);
        pool.remove(id);
        live.erase(std::find(live.begin(), live.end(), id));
        ++done["remove"];
      }
    } else if (o < 16) {  // fork, sometimes with a bad argument
      const SeqId src = pick();
      const int bad = std::uniform_int_distribution<int>(0, 9)(rng);
      const std::int64_t most = shortest(src);
      if (bad == 0) {
        CHECK_THROWS_WITH_AS(cache.fork(next_id + 1000, next_id), doctest::Contains("is not in the cache"), Error);
      } else if (bad == 1) {
        CHECK_THROWS_WITH_AS(cache.fork(src, pick()), doctest::Contains("is already in the cache"), Error);
      } else if (bad == 2 && live.size() < static_cast<std::size_t>(c.max_sequences)) {
        CHECK_THROWS_WITH_AS(cache.fork(src, next_id, most + 1), doctest::Contains(("is outside [0, " + std::to_string(most) + "]").c_str()), Error);
      } else if (live.size() == static_cast<std::size_t>(c.max_sequences)) {
        CHECK_THROWS_WITH_AS(cache.fork(src, next_id), doctest::Contains("sequence slots are in use"), Error);
      } else {
        const bool whole = bad < 6;
        const std::int64_t length = whole ? longest(src) : std::uniform_int_distribution<std::int64_t>(0, most)(rng);
        if (whole && most != longest(src)) {
          CHECK_THROWS_WITH_AS(cache.fork(src, next_id), doctest::Contains("layers of different lengths"), Error);
        } else {
          if (whole) {
            cache.fork(src, next_id);
          } else {
            cache.fork(src, next_id, length);
          }
          shadow.add(next_id);
          for (int l = 0; l < L.num_layers(); ++l) {
            const auto n = static_cast<std::ptrdiff_t>(length * width);
            const auto& ks = shadow.k.at(src)[static_cast<std::size_t>(l)];
            const auto& vs = shadow.v.at(src)[static_cast<std::size_t>(l)];
            shadow.k[next_id][static_cast<std::size_t>(l)].assign(ks.begin(), ks.begin() + n);
            shadow.v[next_id][static_cast<std::size_t>(l)].assign(vs.begin(), vs.begin() + n);
          }
          pool.fork(src, next_id, L.blocks_for(length));
          live.push_back(next_id++);
          ++done["fork"];
        }
      }
    } else if (o < 24) {  // truncate, sometimes with a bad argument
      const SeqId id = pick();
      const std::int64_t most = longest(id);
      const int bad = std::uniform_int_distribution<int>(0, 9)(rng);
      if (bad == 0) {
        CHECK_THROWS_WITH_AS(cache.truncate(id, most + 1), doctest::Contains(("outside [0, " + std::to_string(most) + "]").c_str()), Error);
      } else if (bad == 1) {
        CHECK_THROWS_WITH_AS(cache.truncate(id, -1), doctest::Contains("length -1"), Error);
      } else if (bad == 2) {
        CHECK_THROWS_WITH_AS(cache.truncate(next_id + 1000, 0), doctest::Contains("is not in the cache"), Error);
      } else {
        const std::int64_t length = std::uniform_int_distribution<std::int64_t>(std::max<std::int64_t>(0, most - 10), most)(rng);
        if (in_acquired(id)) {
          CHECK_THROWS_WITH_AS(cache.truncate(id, length), doctest::Contains("release it first"), Error);
        } else {
          cache.truncate(id, length);
          std::int64_t kept = 0;
          for (int l = 0; l < L.num_layers(); ++l) {
            const auto keep = static_cast<std::size_t>(std::min(length, length_of(id, l)) * width);
            shadow.k[id][static_cast<std::size_t>(l)].resize(keep);
            shadow.v[id][static_cast<std::size_t>(l)].resize(keep);
            kept = std::max(kept, length_of(id, l));
          }
          pool.keep(id, L.blocks_for(kept));
          ++done["truncate"];
        }
      }
    } else if (o < 60) {  // append 1..k rows to a batch
      std::vector<SeqId> batch = live;
      std::shuffle(batch.begin(), batch.end(), rng);
      batch.resize(std::uniform_int_distribution<std::size_t>(1, std::min<std::size_t>(3, batch.size()))(rng));
      std::vector<std::int32_t> rows;
      std::vector<std::int64_t> lengths;
      bool fits = true, busy = false;
      for (SeqId id : batch) {
        rows.push_back(std::uniform_int_distribution<std::int32_t>(1, o < 56 ? 3 : 9)(rng));
        lengths.push_back(length_of(id, layer));
        fits = fits && length_of(id, layer) + rows.back() <= c.max_tokens_per_sequence;
        busy = busy || (acquired.count(layer) != 0 &&
                        std::count(acquired[layer].sequences.begin(), acquired[layer].sequences.end(), id) != 0);
      }
      const std::int64_t total = std::accumulate(rows.begin(), rows.end(), std::int64_t{0});
      const std::int64_t need = pool.needed(batch, lengths, rows, bt);
      if (!fits || busy) {
        auto k = random_rows<float>(rng, static_cast<std::size_t>(total * width));
        CHECK_THROWS_AS(cache.append(batch, layer, rows, rig.rows(k, total), rig.rows(k, total)), Error);
      } else if (need > pool.capacity - pool.in_use()) {
        auto k = random_rows<float>(rng, static_cast<std::size_t>(total * width));
        CHECK_THROWS_WITH_AS(cache.append(batch, layer, rows, rig.rows(k, total), rig.rows(k, total)),
                             doctest::Contains(("the host pool is exhausted: this append at layer " + std::to_string(layer) +
                                                " needs " + std::to_string(need) + " more blocks")
                                                   .c_str()),
                             Error);
        ++done["append refused: pool exhausted"];
      } else {
        for (std::size_t i = 0; i < batch.size(); ++i) pool.write(batch[i], length_of(batch[i], layer), rows[i], bt);
        append_random(rig, shadow, rng, batch, layer, rows);
        ++done["append"];
      }
    } else if (o < 75) {  // prefetch
      prune_dead_tickets(cache, layer, outstanding[layer]);
      if (outstanding[layer].size() >= 2) continue;  // the protocol: at most two live per layer
      std::vector<SeqId> batch = live;
      std::shuffle(batch.begin(), batch.end(), rng);
      batch.resize(std::uniform_int_distribution<std::size_t>(1, batch.size())(rng));
      auto q = random_rows<float>(rng, batch.size() * static_cast<std::size_t>(Hq * d), 2.0f);
      if (auto t = prefetch_unless_records_full(cache, batch, layer, rig.rows(q, static_cast<std::int64_t>(batch.size())))) {
        outstanding[layer].push_back(*t);
      } else {
        ++done["prefetch refused: ticket records full"];
      }
    } else if (o < 90) {  // acquire the newest ticket: its view holds the reference rows
      auto& list = outstanding[layer];
      prune_dead_tickets(cache, layer, list);
      if (!list.empty() && acquired.count(layer) == 0) {
        const Ticket t = list.back();
        list.pop_back();  // older tickets of other sequences stay live (prune_dead_tickets)
        bool fresh = true;
        for (std::size_t i = 0; i < t.sequences.size(); ++i) {
          const int s = cache.block_table().find(t.sequences[i]);
          fresh = fresh && s >= 0 && cache.block_table().version(s) == t.generations[i];
        }
        if (fresh) {
          check_view_rows(rig.read(cache.acquire(t)), shadow, L);
          acquired[layer] = t;
          ++done["acquire"];
        } else {
          CHECK_THROWS_AS(cache.acquire(t), Error);
        }
      }
    } else if (acquired.count(layer) != 0) {
      cache.release(acquired[layer]);
      acquired.erase(layer);
    }
    check_all();
  }
  for (auto& [l, t] : acquired) cache.release(t);
  for (SeqId id : live) cache.remove_sequence(id);
  cache.synchronize();
  CHECK(cache.host_tier().pool().blocks_in_use() == 0);
  CHECK(cache.host_tier().pool().free_blocks() == c.host_pool_blocks);
  CHECK(cache.statistics().host_blocks_in_use == 0);
  for (const auto& [kind, n] : done) MESSAGE(kind << ": " << n);
  for (const char* kind : {"add", "remove", "fork", "truncate", "append", "acquire", "append refused: pool exhausted"}) {
    CAPTURE(kind);
    CHECK(done[kind] > H::sequence_ops / 500);
  }
}

}  // namespace oasiskv::test::conformance
