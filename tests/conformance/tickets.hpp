// Conformance cases (conformance.hpp registers them): the ticket rules (supersede, release,
// stale, another cache's) and recover_layer.
#pragma once

#include "rig.hpp"

namespace oasiskv::test::conformance {

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

}  // namespace oasiskv::test::conformance
