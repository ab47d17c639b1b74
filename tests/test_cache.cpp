// Cache tests beyond the conformance suite: refused configs and sizes, the failure rules (with a
// fault-injecting engine), abandon_capture, and truncate's exact summaries.
#include <cmath>
#include <atomic>
#include <functional>
#include <thread>
#include <utility>

#include "support.hpp"

using namespace oasiskv;

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


TEST_CASE("sizes that overflow are refused instead of wrapping") {
  struct Case {
    const char* name;
    std::function<void(CacheConfig&)> edit;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"no-limit capacity", [](CacheConfig& c) { c.max_tokens_per_sequence = INT64_MAX; }, "more than the 2147483647 block ids"},
      {"slot ids past int32", [](CacheConfig& c) { c.max_sequences = 1 << 28; }, "slot ids (int32)"},
      {"default pool past int32 block ids",
       [](CacheConfig& c) {
         c.max_sequences = 1 << 20;
         c.max_tokens_per_sequence = std::int64_t{1} << 34;
       },
       "more than the 2147483647 host block ids"},
      {"host pool past 64 bits",
       [](CacheConfig& c) {
         c.host_pool_blocks = std::int64_t{1} << 30;
         c.shape.num_layers = 1 << 20;
         c.shape.head_dim = 1 << 16;
       },
       "host pool elements"},
      {"negative pool", [](CacheConfig& c) { c.host_pool_blocks = -1; }, "host_pool_blocks must be >= 0"},
      {"huge head_dim", [](CacheConfig& c) { c.shape.head_dim = INT32_MAX; c.max_sequences = 1 << 24; }, "does not fit in 64 bits"},
  };
  for (const auto& k : cases) {
    CAPTURE(k.name);
    CacheConfig c = test::small_config();
    k.edit(c);
    CHECK_THROWS_WITH_AS((Cache<cpu, float>(c)), doctest::Contains(k.message), Error);
  }
}

// A backend whose device work fails on request: the Cache's failure rules, on any backend.
namespace {
struct faulty {};
template <class T>
struct FaultyEngine : CpuEngine<T> {
  using CpuEngine<T>::CpuEngine;
  bool fail_next_plan = false;
  std::uint64_t fake_capture = 0;
  typename CpuEngine<T>::Plan plan(int layer, std::span<const PlanEntry> e, RowsView q, std::int64_t rows, std::uint64_t t) {
    auto p = CpuEngine<T>::plan(layer, e, q, rows, t);  // the residency has changed, as on a device
    if (fail_next_plan) {
      fail_next_plan = false;
      throw std::runtime_error("injected device fault");
    }
    return p;
  }
  std::uint64_t capture_id() const noexcept { return fake_capture; }
};
}  // namespace
template <class T>
struct oasiskv::backend_engine<faulty, T> {
  using type = FaultyEngine<T>;
};

TEST_CASE("a backend failure marks its layer failed until recover_layer, other layers go on") {
  OASISKV_SEEDED_RNG(rng);
  CacheConfig c = test::small_config(256, 2048, 2);
  c.fetch_ratio = 0.05;
  Cache<faulty, float> cache(c);
  const auto& L = cache.layout();
  const int Hk = L.num_kv_heads(), Hq = L.num_q_heads(), d = L.head_dim();
  const std::vector<SeqId> batch{4};
  cache.add_sequence(4);
  auto k = test::random_rows<float>(rng, static_cast<std::size_t>(600 * Hk * d));
  for (int l = 0; l < 2; ++l) cache.append(batch, l, std::vector<std::int32_t>{600}, rows_view(k.data(), 600), rows_view(k.data(), 600));
  auto q = test::random_rows<float>(rng, static_cast<std::size_t>(Hq * d));
  const Ticket before = cache.prefetch(batch, 0, rows_view(q.data(), 1));
  cache.backend().fail_next_plan = true;
  CHECK_THROWS_WITH_AS(cache.prefetch(batch, 0, rows_view(q.data(), 1)), doctest::Contains("injected device fault"), std::runtime_error);
  CHECK(cache.layer_failure(0).find("prefetch failed: injected device fault") != std::string::npos);
  CHECK_THROWS_WITH_AS(cache.prefetch(batch, 0, rows_view(q.data(), 1)), doctest::Contains("layer 0 is failed since prefetch failed"), Error);
  CHECK_THROWS_WITH_AS(cache.acquire(before), doctest::Contains("call recover_layer(0)"), Error);
  CHECK_THROWS_AS(cache.append(batch, 0, rows_view(k.data(), 1), rows_view(k.data(), 1)), Error);
  // Layer 1 is unaffected.
  const Ticket other = cache.prefetch(batch, 1, rows_view(q.data(), 1));
  cache.attend(other, [](const LayerView<float>&) {});
  // Recovery: the old ticket is gone, the next plan refills the working set, rows are intact.
  cache.recover_layer(0);
  CHECK(cache.layer_failure(0).empty());
  CHECK_THROWS_AS(cache.acquire(before), Error);
  cache.reset_statistics();
  const Ticket fresh = cache.prefetch(batch, 0, rows_view(q.data(), 1));
  CHECK(cache.statistics().total().blocks_fetched == static_cast<std::uint64_t>(Hk * L.selectable_blocks));
  cache.attend(fresh, [&](const LayerView<float>& v) {
    for (std::int32_t e = 0; e < v.indptr[v.num_pairs()]; ++e) {
      const int h = e < v.indptr[1] ? 0 : 1;
      for (int r = 0; r < v.valid_tokens[e]; ++r) {
        const std::int64_t t = static_cast<std::int64_t>(v.block[e]) * 16 + r;
        REQUIRE(std::memcmp(v.keys(e) + r * d, k.data() + (t * Hk + h) * d, sizeof(float) * static_cast<std::size_t>(d)) == 0);
      }
    }
  });
}

TEST_CASE("abandon_capture rolls back what a captured step did to the host bookkeeping") {
  OASISKV_SEEDED_RNG(rng);
  CacheConfig c = test::small_config(256, 2048, 3);
  c.fetch_ratio = 0.05;
  Cache<faulty, float> cache(c);
  const auto& L = cache.layout();
  const auto& pool = cache.host_tier().pool();
  const int Hk = L.num_kv_heads(), Hq = L.num_q_heads(), d = L.head_dim();
  const std::vector<SeqId> batch{1, 2};
  cache.add_sequence(1);
  cache.add_sequence(2);
  auto k = test::random_rows<float>(rng, static_cast<std::size_t>(1000 * Hk * d));
  cache.append(batch, 0, std::vector<std::int32_t>{500, 400}, rows_view(k.data(), 900), rows_view(k.data(), 900));
  cache.append(batch, 1, std::vector<std::int32_t>{500, 400}, rows_view(k.data(), 900), rows_view(k.data(), 900));
  cache.truncate(1, 450);
  cache.truncate(2, 400);
  cache.fork(1, 3);  // 3 shares 1's partial block 28 (rows 448, 449)
  const std::int64_t held = pool.blocks_in_use();
  CHECK(held == 29 + 25);
  const int s1 = cache.block_table().find(1), s3 = cache.block_table().find(3);
  auto q = test::random_rows<float>(rng, static_cast<std::size_t>(2 * Hq * d));
  const Ticket eager = cache.prefetch(batch, 0, rows_view(q.data(), 2));
  // A "captured" step at layer 0: append (1 copies its shared block on write, 2 takes a new
  // block), prefetch, acquire of the eager ticket; never launched.
  cache.backend().fake_capture = 7;
  cache.append(batch, 0, rows_view(k.data(), 2), rows_view(k.data(), 2));
  CHECK(pool.blocks_in_use() == held + 2);
  CHECK(pool.at(s1, 28) != pool.at(s3, 28));
  const Ticket captured = cache.prefetch(batch, 0, rows_view(q.data(), 2));
  (void)cache.acquire(eager);
  cache.backend().fake_capture = 0;
  cache.abandon_capture();
  CHECK(cache.sequence_length(1, 0) == 450);
  CHECK(cache.sequence_length(2, 0) == 400);
  CHECK(cache.sequence_length(1, 1) == 450);  // layer 1 was not touched
  // The host pool is as before the capture: 1 and 3 share block 28 again.
  CHECK(pool.blocks_in_use() == held);
  CHECK(pool.at(s1, 28) == pool.at(s3, 28));
  CHECK(pool.refcount(pool.at(s1, 28)) == 2);
  CHECK(pool.mapped_blocks(cache.block_table().find(2)) == 25);
  CHECK_THROWS_AS(cache.acquire(captured), Error);
  CHECK_THROWS_AS(cache.acquire(eager), Error);
  CHECK_THROWS_WITH_AS(cache.abandon_capture(), doctest::Contains("no graph capture"), Error);
  // The layer is usable again, and its next plan is uncapped.
  cache.reset_statistics();
  cache.append(batch, 0, rows_view(k.data(), 2), rows_view(k.data(), 2));
  const Ticket next = cache.prefetch(batch, 0, rows_view(q.data(), 2));
  CHECK(cache.statistics().total().blocks_fetched == static_cast<std::uint64_t>(2 * Hk * L.selectable_blocks));
  cache.attend(next, [](const LayerView<float>& v) { CHECK(v.seq_len[0] == 451); });
}

TEST_CASE("truncate leaves every summary bit-equal to a sequence that never had the dropped rows") {
  OASISKV_SEEDED_RNG(rng);
  for (int trial = 0; trial < 40; ++trial) {
    CacheConfig c = test::small_config(160, 1024, 1);
    Cache<cpu, fp16_t> cut(c), never(c);
    const auto& L = cut.layout();
    const int w = L.num_kv_heads() * L.head_dim();
    const std::vector<SeqId> batch{1};
    cut.add_sequence(1);
    never.add_sequence(1);
    std::vector<fp16_t> kept_k, kept_v;
    std::int64_t len = 0;
    for (int round = 0; round < 6; ++round) {
      const auto n = std::uniform_int_distribution<std::int32_t>(1, 90)(rng);
      // Signed zeros and repeated values make the fold order visible in the bits.
      auto k = test::random_rows<fp16_t>(rng, static_cast<std::size_t>(n * w));
      for (std::size_t i = 0; i < k.size(); i += 7) k[i] = from_float<fp16_t>(i % 2 == 0 ? 0.0f : -0.0f);
      const auto v = test::random_rows<fp16_t>(rng, static_cast<std::size_t>(n * w));
      for (int l = 0; l < 2; ++l) cut.append(batch, l, std::vector<std::int32_t>{n}, rows_view(k.data(), n), rows_view(v.data(), n));
      kept_k.insert(kept_k.end(), k.begin(), k.end());
      kept_v.insert(kept_v.end(), v.begin(), v.end());
      len += n;
      const std::int64_t keep = std::uniform_int_distribution<std::int64_t>(std::max<std::int64_t>(0, len - 50), len)(rng);
      cut.truncate(1, keep);
      kept_k.resize(static_cast<std::size_t>(keep * w));
      kept_v.resize(static_cast<std::size_t>(keep * w));
      len = keep;
    }
    const auto n = static_cast<std::int32_t>(len);
    for (int l = 0; l < 2; ++l) never.append(batch, l, std::vector<std::int32_t>{n}, rows_view(kept_k.data(), n), rows_view(kept_v.data(), n));
    for (int l = 0; l < 2; ++l) {
      REQUIRE(cut.sequence_length(1, l) == len);
      for (int h = 0; h < L.num_kv_heads(); ++h) {
        for (std::int64_t b = 0; b < L.blocks_for(len); ++b) {
          CAPTURE(b);
          CHECK(std::memcmp(cut.backend().summaries().block(0, l, h, b), never.backend().summaries().block(0, l, h, b),
                            sizeof(float) * 2 * static_cast<std::size_t>(L.head_dim())) == 0);
        }
      }
    }
  }
}

namespace {
// Rows followed by NaN: a read past the rows a call was told poisons its result, or trips the
// finiteness check of the inputs (the CPU backend's check_input reads exactly the rows told).
template <class T>
struct Fenced {
  std::vector<T> buf;
  explicit Fenced(std::vector<T> v) : buf(std::move(v)) { buf.resize(buf.size() + 4096, from_float<T>(std::nanf(""))); }
  RowsView rows(std::int64_t n) const { return RowsView{buf.data(), dtype_of_v<T>, n}; }
};
}  // namespace

TEST_CASE("append, prefetch, select_blocks, observe and remainder read their inputs within the rows they were told") {
  OASISKV_SEEDED_RNG(rng);
  for (const int d : {4, 12, 32, 100}) {
    for (const RemainderEstimate r : {RemainderEstimate::none, RemainderEstimate::clusters, RemainderEstimate::quantized}) {
      if (r == RemainderEstimate::quantized && d % 32 != 0) continue;  // its value scales are per 32 channels
      for (const int R : {1, 3}) {
        CAPTURE(d);
        CAPTURE(remainder_name(r));
        CAPTURE(R);
        CacheConfig c;
        c.shape = ModelShape{1, 4, 2, d};
        c.budget_tokens = 128;
        c.recent_tokens = 32;
        c.max_tokens_per_sequence = 2048;
        c.max_sequences = 2;
        c.remainder = r;
        c.remainder_cluster_rows = 64;
        Cache<cpu, float> cache(c);
        const std::vector<SeqId> batch{1, 2};
        cache.add_sequence(1);
        cache.add_sequence(2);
        const std::int64_t len = 1100;  // past one clustered segment
        const std::size_t width = 2 * static_cast<std::size_t>(d), qwidth = 4 * static_cast<std::size_t>(d);
        const Fenced<float> k(test::random_rows<float>(rng, 2 * len * width)), v(test::random_rows<float>(rng, 2 * len * width));
        cache.append(batch, 0, std::vector<std::int32_t>{1100, 1100}, k.rows(2 * len), v.rows(2 * len));
        const Fenced<float> q(test::random_rows<float>(rng, 2 * static_cast<std::size_t>(R) * qwidth));
        const Ticket t = cache.prefetch(batch, 0, q.rows(2 * R), 3);
        const Fenced<float> q1(test::random_rows<float>(rng, static_cast<std::size_t>(R) * qwidth));
        CHECK(cache.select_blocks(1, 0, q1.rows(R)).size() == 2);
        (void)cache.acquire(t);
        cache.observe(t, q.rows(2 * R));
        if (r != RemainderEstimate::none) {
          const std::size_t states = 2 * static_cast<std::size_t>(R) * 4;
          std::vector<float> out(states * static_cast<std::size_t>(d) + 64, 7.0f), lse(states + 64, 7.0f);
          cache.remainder(t, q.rows(2 * R), std::span(out).first(states * static_cast<std::size_t>(d)),
                          std::span(lse).first(states));
          for (std::size_t i = 0; i < out.size(); ++i) REQUIRE((i < states * static_cast<std::size_t>(d) ? std::isfinite(out[i]) : out[i] == 7.0f));
          for (std::size_t i = 0; i < lse.size(); ++i) REQUIRE((i < states ? std::isfinite(lse[i]) : lse[i] == 7.0f));
        }
        cache.release(t);
      }
    }
  }
}

TEST_CASE("CpuOptions::copy_thread = false: a plan's copies are done when the call that opens its gate returns") {
  OASISKV_SEEDED_RNG(rng);
  for (const bool thread : {true, false}) {
    CAPTURE(thread);
    Cache<cpu, float> cache(test::small_config(128, 1024, 1), CpuOptions{.copy_thread = thread});
    const std::vector<SeqId> batch{1};
    cache.add_sequence(1);
    const auto& L = cache.layout();
    const auto k = test::random_rows<float>(rng, static_cast<std::size_t>(800 * L.row_elems));
    cache.append(batch, 0, std::vector<std::int32_t>{800}, rows_view(k.data(), 800), rows_view(k.data(), 800));
    const auto q = test::random_rows<float>(rng, static_cast<std::size_t>(L.q_row_elems), 2.0f);
    const Ticket first = cache.prefetch(batch, 0, rows_view(q.data(), 1));  // no older plan: its copies start now
    if (!thread) CHECK(cache.backend().copies_in_flight() == 0);
    cache.attend(first, [](const LayerView<float>&) {});
    const LayerStatistics s = cache.statistics().layers[0];
    CHECK(s.blocks_fetched > 0);
    CHECK(s.copy_ns > 0);  // the copies' own time, wherever they ran
    cache.reset_statistics();
    CHECK(cache.statistics().layers[0].copy_ns == 0);
  }
}

namespace {
// A ParallelFor that counts its calls and their tasks, and runs the tasks in reverse order on the
// calling thread and one helper thread (so that order or threads cannot matter unnoticed).
struct CountingPool {
  std::atomic<int> calls{0}, tasks{0};
  ParallelFor lend() {
    ParallelFor p;
    p.context = this;
    p.threads = 2;
    p.run = [](void* self, int n, ParallelFor::Task task, void* arg) {
      auto* pool = static_cast<CountingPool*>(self);
      pool->calls += 1;
      pool->tasks += n;
      std::atomic<int> next{n - 1};
      auto take = [&] {
        for (int t = next--; t >= 0; t = next--) task(arg, t);
      };
      std::thread helper(take);
      take();
      helper.join();
    };
    return p;
  }
};
}  // namespace

TEST_CASE("CpuOptions::parallel_for: plans and in-caller copies split over a pool give the same blocks and rows") {
  OASISKV_SEEDED_RNG(rng);
  // Two sequences x 2 kv heads (4 planning tasks a layer); a budget of 512 tokens against a
  // 2,048-token context so that a plan copies well over 16 blocks (copies split too).
  CacheConfig config = test::small_config(512, 2304, 2);
  CountingPool pool;
  CpuOptions lent{.copy_thread = false};
  lent.parallel_for = pool.lend();
  Cache<cpu, float> alone(config, CpuOptions{.copy_thread = false}), shared(config, lent);
  const std::vector<SeqId> batch{1, 2};
  const auto& L = alone.layout();
  for (auto* c : {&alone, &shared}) {
    c->add_sequence(1);
    c->add_sequence(2);
  }
  const auto k = test::random_rows<float>(rng, static_cast<std::size_t>(2 * 2048 * L.row_elems));
  const auto v = test::random_rows<float>(rng, k.size());
  for (int layer = 0; layer < L.num_layers(); ++layer) {
    for (auto* c : {&alone, &shared}) {
      c->append(batch, layer, std::vector<std::int32_t>{2048, 2048}, rows_view(k.data(), 4096), rows_view(v.data(), 4096));
    }
  }
  std::vector<Ticket> ta(static_cast<std::size_t>(L.num_layers())), ts(ta.size());
  for (int step = 0; step < 6; ++step) {
    CAPTURE(step);
    const auto q = test::random_rows<float>(rng, static_cast<std::size_t>(2 * L.q_row_elems), 2.0f);
    for (int layer = 0; layer < L.num_layers(); ++layer) {
      Ticket na = alone.prefetch(batch, layer, rows_view(q.data(), 2));
      Ticket ns = shared.prefetch(batch, layer, rows_view(q.data(), 2));
      for (int s = 0; s < 2; ++s) {
        for (int h = 0; h < L.num_kv_heads(); ++h) {
          const auto a = alone.backend().planned_blocks(s, layer, h), b = shared.backend().planned_blocks(s, layer, h);
          CHECK(std::vector<std::int32_t>(a.begin(), a.end()) == std::vector<std::int32_t>(b.begin(), b.end()));
        }
      }
      if (step > 0) {
        // Each view entry's block and its slot's rows, in view order.
        auto contents = [&](const LayerView<float>& view) {
          std::pair<std::vector<std::int32_t>, std::vector<float>> out;
          for (std::int32_t e = 0; e < view.indptr[view.num_pairs()]; ++e) {
            out.first.push_back(view.block[e]);
            out.second.insert(out.second.end(), view.keys(e), view.keys(e) + L.block_elems);
          }
          return out;
        };
        std::pair<std::vector<std::int32_t>, std::vector<float>> va, vs;
        alone.attend(ta[static_cast<std::size_t>(layer)], [&](const LayerView<float>& view) { va = contents(view); });
        shared.attend(ts[static_cast<std::size_t>(layer)], [&](const LayerView<float>& view) { vs = contents(view); });
        CHECK(!va.first.empty());
        CHECK(va.first == vs.first);
        CHECK(va.second == vs.second);
      }
      ta[static_cast<std::size_t>(layer)] = std::move(na);
      ts[static_cast<std::size_t>(layer)] = std::move(ns);
    }
  }
  CHECK(alone.statistics().total().blocks_fetched == shared.statistics().total().blocks_fetched);
  // The pool did the work: a planning call per prefetch, and copy calls besides.
  CHECK(pool.calls.load() > 6 * L.num_layers());
  CHECK(pool.tasks.load() > 4 * 6 * L.num_layers());
}

TEST_CASE("ParallelFor: every task once, an exception from a task rethrown after all have ended") {
  CountingPool pool;
  const ParallelFor p = pool.lend();
  std::vector<std::atomic<int>> hits(37);
  p(37, [&](int t) { hits[static_cast<std::size_t>(t)] += 1; });
  for (auto& h : hits) CHECK(h.load() == 1);
  std::atomic<int> ran{0};
  CHECK_THROWS_WITH_AS(p(8,
                         [&](int t) {
                           ran += 1;
                           if (t == 3) throw Error("task 3 failed");
                         }),
                       "task 3 failed", Error);
  CHECK(ran.load() == 8);
  int inline_calls = 0;
  ParallelFor{}(5, [&](int) { ++inline_calls; });  // no pool: in order on this thread
  CHECK(inline_calls == 5);
}
