// The cache facade: dense equivalence with a full budget, and bad input.
#include <cmath>
#include <functional>

#include "support.hpp"

using namespace oasiskv;

namespace {

template <class T>
void run_dense_equivalence(std::mt19937_64& rng) {
  CacheConfig c = test::small_config(/*budget*/ 1024, /*capacity*/ 1024, /*sequences*/ 3);
  Cache<cpu, T> cache(c);
  const auto& s = c.shape;
  const int H = s.num_kv_heads, Hq = s.num_q_heads, d = s.head_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const std::vector<SeqId> batch{11, 22, 33};
  std::map<SeqId, std::vector<std::vector<T>>> keys, values;
  for (SeqId id : batch) {
    cache.add_sequence(id);
    keys[id].resize(static_cast<std::size_t>(s.num_layers));
    values[id].resize(static_cast<std::size_t>(s.num_layers));
  }
  std::vector<std::int32_t> prompt;
  for (std::size_t i = 0; i < batch.size(); ++i) prompt.push_back(std::uniform_int_distribution<std::int32_t>(1, 700)(rng));
  std::vector<Ticket> previous(static_cast<std::size_t>(s.num_layers));
  auto add_rows = [&](int layer, const std::vector<std::int32_t>& counts) {
    std::int64_t total = 0;
    for (auto n : counts) total += n;
    auto k = test::random_rows<T>(rng, static_cast<std::size_t>(total * H * d));
    auto v = test::random_rows<T>(rng, static_cast<std::size_t>(total * H * d));
    cache.append(batch, layer, counts, rows_view(k.data(), total), rows_view(v.data(), total));
    std::size_t off = 0;
    for (std::size_t i = 0; i < batch.size(); ++i) {
      const std::size_t n = static_cast<std::size_t>(counts[i]) * static_cast<std::size_t>(H * d);
      auto& kk = keys[batch[i]][static_cast<std::size_t>(layer)];
      auto& vv = values[batch[i]][static_cast<std::size_t>(layer)];
      kk.insert(kk.end(), k.begin() + static_cast<std::ptrdiff_t>(off), k.begin() + static_cast<std::ptrdiff_t>(off + n));
      vv.insert(vv.end(), v.begin() + static_cast<std::ptrdiff_t>(off), v.begin() + static_cast<std::ptrdiff_t>(off + n));
      off += n;
    }
  };
  for (int l = 0; l < s.num_layers; ++l) {
    add_rows(l, prompt);
    auto q = test::random_rows<float>(rng, batch.size() * static_cast<std::size_t>(Hq * d));
    previous[static_cast<std::size_t>(l)] = cache.prefetch(batch, l, rows_view(q.data(), static_cast<std::int64_t>(batch.size())));
  }
  double worst = 0.0;
  for (int step = 0; step < 24; ++step) {
    for (int l = 0; l < s.num_layers; ++l) {
      add_rows(l, std::vector<std::int32_t>(batch.size(), 1));
      auto q_next = test::random_rows<float>(rng, batch.size() * static_cast<std::size_t>(2 * Hq * d));
      const Ticket next = cache.prefetch(batch, l, rows_view(q_next.data(), static_cast<std::int64_t>(2 * batch.size())));
      auto q = test::random_rows<float>(rng, batch.size() * static_cast<std::size_t>(Hq * d));
      std::vector<float> sparse(q.size()), dense(q.size());
      cache.attend(previous[static_cast<std::size_t>(l)], [&](const LayerView<T>& view) {
        sparse_attention_reference(view, Hq, scale, q.data(), sparse.data());
      });
      previous[static_cast<std::size_t>(l)] = next;
      for (std::size_t i = 0; i < batch.size(); ++i) {
        const auto& kk = keys[batch[i]][static_cast<std::size_t>(l)];
        const auto& vv = values[batch[i]][static_cast<std::size_t>(l)];
        const auto len = static_cast<std::int64_t>(kk.size() / static_cast<std::size_t>(H * d));
        dense_attention_reference(kk.data(), vv.data(), len, Hq, H, d, scale, q.data() + i * static_cast<std::size_t>(Hq * d),
                                  dense.data() + i * static_cast<std::size_t>(Hq * d));
      }
      for (std::size_t j = 0; j < dense.size(); j += static_cast<std::size_t>(d)) {
        double num = 0, den = 0;
        for (int c2 = 0; c2 < d; ++c2) {
          num = std::max(num, std::fabs(static_cast<double>(sparse[j + static_cast<std::size_t>(c2)]) - dense[j + static_cast<std::size_t>(c2)]));
          den = std::max(den, std::fabs(static_cast<double>(dense[j + static_cast<std::size_t>(c2)])));
        }
        worst = std::max(worst, num / std::max(den, 1e-30));
      }
    }
  }
  CHECK(worst <= 1e-5);
  CHECK(cache.statistics().total().admits_capped == 0);
}

}  // namespace

TEST_CASE("with a budget of at least the context, attention through the cache equals dense") {
  OASISKV_SEEDED_RNG(rng);
  SUBCASE("float") { run_dense_equivalence<float>(rng); }
  SUBCASE("fp16") { run_dense_equivalence<fp16_t>(rng); }
  SUBCASE("bf16") { run_dense_equivalence<bf16_t>(rng); }
}

TEST_CASE("bad configurations are refused with the bad value named") {
  struct Case {
    const char* name;
    std::function<void(CacheConfig&)> edit;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"zero layers", [](CacheConfig& c) { c.shape.num_layers = 0; }, "num_layers must be positive, got 0"},
      {"negative q heads", [](CacheConfig& c) { c.shape.num_q_heads = -4; }, "got -4"},
      {"zero kv heads", [](CacheConfig& c) { c.shape.num_kv_heads = 0; }, "num_kv_heads must be positive, got 0"},
      {"heads do not divide", [](CacheConfig& c) { c.shape.num_q_heads = 9; c.shape.num_kv_heads = 2; }, "num_q_heads (9) is not a multiple of num_kv_heads (2)"},
      {"zero head dim", [](CacheConfig& c) { c.shape.head_dim = 0; }, "head_dim must be positive, got 0"},
      {"zero block", [](CacheConfig& c) { c.block_tokens = 0; }, "block_tokens must be positive, got 0"},
      {"budget not whole blocks", [](CacheConfig& c) { c.budget_tokens = 100; }, "budget_tokens (100)"},
      {"budget under the pinned blocks", [](CacheConfig& c) { c.budget_tokens = 48; }, "budget_tokens (48) is smaller than the pinned blocks"},
      {"sinks not whole blocks", [](CacheConfig& c) { c.sink_tokens = 8; }, "sink_tokens (8)"},
      {"negative recent", [](CacheConfig& c) { c.recent_tokens = -16; }, "recent_tokens (-16)"},
      {"zero fetch ratio", [](CacheConfig& c) { c.fetch_ratio = 0.0; }, "fetch_ratio must be in (0, 1], got 0"},
      {"fetch ratio above one", [](CacheConfig& c) { c.fetch_ratio = 1.5; }, "got 1.5"},
      {"zero sequences", [](CacheConfig& c) { c.max_sequences = 0; }, "max_sequences must be positive, got 0"},
      {"zero capacity", [](CacheConfig& c) { c.max_tokens_per_sequence = 0; }, "max_tokens_per_sequence must be positive, got 0"},
      {"negative softmax scale", [](CacheConfig& c) { c.softmax_scale = -1.0f; }, "softmax_scale"},
  };
  for (const auto& k : cases) {
    CAPTURE(k.name);
    CacheConfig c = test::small_config();
    k.edit(c);
    CHECK_THROWS_WITH_AS((Cache<cpu, float>(c)), doctest::Contains(k.message), Error);
  }
}

TEST_CASE("bad calls are refused with the bad value named, and the cache is unchanged") {
  OASISKV_SEEDED_RNG(rng);
  CacheConfig c = test::small_config(/*budget*/ 96, /*capacity*/ 256, /*sequences*/ 3);
  Cache<cpu, float> cache(c);
  const int H = c.shape.num_kv_heads, Hq = c.shape.num_q_heads, d = c.shape.head_dim;
  cache.add_sequence(1);
  cache.add_sequence(2);
  cache.add_sequence(3);
  cache.remove_sequence(3);
  const std::vector<SeqId> both{1, 2};
  for (int l = 0; l < c.shape.num_layers; ++l) {
    auto k = test::random_rows<float>(rng, static_cast<std::size_t>(80 * H * d));
    cache.append(both, l, std::vector<std::int32_t>{40, 40}, rows_view(k.data(), 80), rows_view(k.data(), 80));
  }
  auto q2 = test::random_rows<float>(rng, static_cast<std::size_t>(2 * Hq * d));
  const Ticket acquired = cache.prefetch(both, 0, rows_view(q2.data(), 2));
  const Ticket pending = cache.prefetch(both, 1, rows_view(q2.data(), 2));
  const Ticket released = cache.prefetch(std::vector<SeqId>{1}, 1, rows_view(q2.data(), 1));
  (void)cache.acquire(acquired);

  const auto one_row = test::random_rows<float>(rng, static_cast<std::size_t>(H * d));
  const auto two_rows = test::random_rows<float>(rng, static_cast<std::size_t>(2 * H * d));
  auto nan_rows = two_rows;
  nan_rows[5] = NAN;
  const auto q1 = test::random_rows<float>(rng, static_cast<std::size_t>(Hq * d));
  const auto big = test::random_rows<float>(rng, static_cast<std::size_t>(300 * H * d));
  const std::vector<fp16_t> half_rows(static_cast<std::size_t>(2 * H * d));
  const std::vector<SeqId> s1{1}, s2{2}, s99{99}, s3{3}, dup{1, 1}, none{};
  auto rv = [](const std::vector<float>& x, std::int64_t rows) { return rows_view(x.data(), rows); };

  struct Case {
    const char* name;
    std::function<void()> call;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"append to an unknown sequence", [&] { cache.append(s99, 1, rv(one_row, 1), rv(one_row, 1)); }, "sequence 99 is not in the cache"},
      {"append to a removed sequence", [&] { cache.append(s3, 1, rv(one_row, 1), rv(one_row, 1)); }, "sequence 3 is not in the cache"},
      {"append at a layer past the model", [&] { cache.append(s2, 5, rv(one_row, 1), rv(one_row, 1)); }, "layer 5 is out of range [0, 2)"},
      {"append at a negative layer", [&] { cache.append(s2, -1, rv(one_row, 1), rv(one_row, 1)); }, "layer -1"},
      {"append past capacity", [&] { cache.append(s2, 1, std::vector<std::int32_t>{300}, rv(big, 300), rv(big, 300)); }, "would hold 340 tokens, past its capacity of 256"},
      {"append a wrong row count", [&] { cache.append(both, 1, rv(one_row, 1), rv(one_row, 1)); }, "k has 1 rows, expected 2"},
      {"append a wrong element type", [&] { cache.append(both, 1, rows_view(half_rows.data(), 2), rv(two_rows, 2)); }, "element type f16, but this cache holds f32"},
      {"append a null pointer", [&] { cache.append(both, 1, rv(two_rows, 2), RowsView{nullptr, DType::f32, 2}); }, "v is a null pointer"},
      {"append a negative row count", [&] { cache.append(both, 1, std::vector<std::int32_t>{3, -1}, rv(two_rows, 2), rv(two_rows, 2)); }, "rows_per_seq[1] (sequence 2) is negative: -1"},
      {"append row counts for another batch", [&] { cache.append(both, 1, std::vector<std::int32_t>{2}, rv(two_rows, 2), rv(two_rows, 2)); }, "rows_per_seq has 1 entries for a batch of 2"},
      {"append a NaN key", [&] { cache.append(both, 1, rv(nan_rows, 2), rv(two_rows, 2)); }, "k holds a non-finite value (nan) at element 5"},
      {"append one sequence twice", [&] { cache.append(dup, 1, rv(two_rows, 2), rv(two_rows, 2)); }, "sequence 1 appears twice"},
      {"append an empty batch", [&] { cache.append(none, 1, rv(two_rows, 0), rv(two_rows, 0)); }, "the batch is empty"},
      {"append under attention", [&] { cache.append(s1, 0, rv(one_row, 1), rv(one_row, 1)); }, "sequence 1 at layer 0 is under attention"},
      {"prefetch q rows not a multiple of the batch", [&] { cache.prefetch(both, 1, rv(q2, 3)); }, "q has 3 rows, expected a positive multiple of the batch size 2"},
      {"prefetch a null q", [&] { cache.prefetch(s1, 1, RowsView{nullptr, DType::f32, 1}); }, "q is a null pointer"},
      {"prefetch q of the wrong element type", [&] { cache.prefetch(s1, 1, RowsView{q1.data(), DType::bf16, 1}); }, "element type bf16"},
      {"prefetch an unknown sequence", [&] { cache.prefetch(s99, 1, rv(q1, 1)); }, "sequence 99"},
      {"acquire before any prefetch", [&] { cache.acquire(Ticket{}); }, "empty ticket"},
      {"acquire while the layer holds another ticket", [&] { Ticket t = acquired; t.id += 100; cache.acquire(t); }, "layer 0 already has ticket"},
      {"acquire a ticket from another layer", [&] { Ticket t = pending; t.layer = 7; cache.acquire(t); }, "layer 7 is out of range"},
      {"release a ticket that is not acquired", [&] { cache.release(pending); }, "is not acquired at layer 1"},
      {"observe a ticket that is not acquired", [&] { cache.observe(pending, rv(q2, 2)); }, "is not acquired at layer 1"},
      {"add a sequence twice", [&] { cache.add_sequence(2); }, "sequence 2 is already in the cache"},
      {"remove an unknown sequence", [&] { cache.remove_sequence(42); }, "sequence 42 is not in the cache"},
      {"remove a sequence under attention", [&] { cache.remove_sequence(2); }, "sequence 2 is in ticket"},
      {"length of an unknown sequence", [&] { (void)cache.sequence_length(77, 0); }, "sequence 77"},
  };
  CHECK(cases.size() >= 20);
  for (const auto& k : cases) {
    CAPTURE(k.name);
    const std::uint64_t before = test::fingerprint(cache, {1, 2, 3});
    CHECK_THROWS_WITH_AS(k.call(), doctest::Contains(k.message), Error);
    CHECK(test::fingerprint(cache, {1, 2, 3}) == before);
  }
  // Too many sequences: the slots are full with one more.
  cache.add_sequence(4);
  const std::uint64_t before = test::fingerprint(cache, {1, 2, 4});
  CHECK_THROWS_WITH_AS(cache.add_sequence(5), doctest::Contains("all 3 sequence slots are in use"), Error);
  CHECK(test::fingerprint(cache, {1, 2, 4}) == before);
  // A released ticket cannot come back.
  cache.release(acquired);
  (void)cache.acquire(released);
  cache.release(released);
  CHECK_THROWS_WITH_AS(cache.acquire(released), doctest::Contains("was already acquired and released"), Error);
  // An older ticket is superseded once a newer plan of the same sequence was served.
  CHECK_THROWS_WITH_AS(cache.acquire(pending), doctest::Contains("superseded"), Error);
}

TEST_CASE("the first plan after prefill fills the working set and later plans respect the fetch cap") {
  OASISKV_SEEDED_RNG(rng);
  CacheConfig c = test::small_config(/*budget*/ 256, /*capacity*/ 2048, /*sequences*/ 1);
  c.fetch_ratio = 0.05;  // cap: 1 admit per (sequence, layer, kv head) and step
  Cache<cpu, float> cache(c);
  const auto& L = cache.layout();
  REQUIRE(L.fetch_cap == 1);
  const int H = c.shape.num_kv_heads, Hq = c.shape.num_q_heads, d = c.shape.head_dim;
  const std::vector<SeqId> batch{3};
  cache.add_sequence(3);
  const std::int64_t rows = 1000;
  auto k = test::random_rows<float>(rng, static_cast<std::size_t>(rows * H * d));
  cache.append(batch, 0, std::vector<std::int32_t>{static_cast<std::int32_t>(rows)}, rows_view(k.data(), rows), rows_view(k.data(), rows));
  auto q = test::random_rows<float>(rng, static_cast<std::size_t>(Hq * d));
  const Ticket first = cache.prefetch(batch, 0, rows_view(q.data(), 1));
  const LayerStatistics after_first = cache.statistics().total();
  CHECK(after_first.admits_capped == 0);
  CHECK(after_first.blocks_fetched == static_cast<std::uint64_t>(H * L.selectable_blocks));
  // A very different query: many new blocks wanted, one admitted per kv head.
  for (auto& x : q) x = -x;
  const Ticket second = cache.prefetch(batch, 0, rows_view(q.data(), 1));
  const LayerStatistics after_second = cache.statistics().total();
  CHECK(after_second.blocks_fetched - after_first.blocks_fetched == static_cast<std::uint64_t>(H));
  CHECK(after_second.admits_capped > 0);
  (void)cache.acquire(second);
  cache.release(second);
  (void)first;
}
