// Conformance cases (conformance.hpp registers them): the sequence lifecycle, and every bad call
// refused with an Error naming the bad value, the cache unchanged.
#pragma once

#include "rig.hpp"

namespace oasiskv::test::conformance {

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
