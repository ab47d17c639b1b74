// Conformance cases (conformance.hpp registers them): truncate keeps exactly the rows below the
// length, a fork shares full blocks and copies the partial one on first write, and a sequence
// and its fork appended in one batch take one copy of their shared block.
#pragma once

#include "rig.hpp"

namespace oasiskv::test::conformance {

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
