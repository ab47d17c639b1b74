// Cache<cuda, T> against Cache<cpu, T>: the same calls on fresh seeded random inputs (the seed is
// printed on failure; OASISKV_TEST_SEED=N reproduces a run) give identical views (same blocks per
// pair, slot contents byte-equal to the CPU host tier for the valid rows), identical statistics,
// and attention within tolerance. Plus bad input, and a decode step captured in a CUDA graph.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "cuda/cuda_support.hpp"
#include "oasiskv/oasiskv.hpp"
#include "oasiskv/cuda/cache.cuh"
#include "oasiskv/cuda/ops.cuh"
#include "support.hpp"

namespace oasiskv::gpu_test {
namespace {

// A device view's arrays, on the host.
struct HostView {
  int batch = 0, heads = 0;
  std::vector<SeqId> ids;
  std::vector<std::int64_t> len;
  std::vector<std::int32_t> indptr, slot, block, valid;
};

template <class T>
HostView fetch_view(const LayerView<T>& v) {
  HostView h;
  h.batch = v.batch_size;
  h.heads = v.num_kv_heads;
  const auto B = static_cast<std::size_t>(v.batch_size);
  const auto pairs = static_cast<std::size_t>(v.num_pairs());
  h.ids = download(v.seq_ids, B);
  h.len = download(v.seq_len, B);
  h.indptr = download(v.indptr, pairs + 1);
  const auto n = static_cast<std::size_t>(h.indptr.back());
  h.slot = download(v.slot, n);
  h.block = download(v.block, n);
  h.valid = download(v.valid_tokens, n);
  return h;
}

template <class T>
HostView host_view(const LayerView<T>& v) {
  HostView h;
  h.batch = v.batch_size;
  h.heads = v.num_kv_heads;
  const auto B = static_cast<std::size_t>(v.batch_size);
  const auto pairs = static_cast<std::size_t>(v.num_pairs());
  h.ids.assign(v.seq_ids, v.seq_ids + B);
  h.len.assign(v.seq_len, v.seq_len + B);
  h.indptr.assign(v.indptr, v.indptr + pairs + 1);
  const auto n = static_cast<std::size_t>(h.indptr.back());
  h.slot.assign(v.slot, v.slot + n);
  h.block.assign(v.block, v.block + n);
  h.valid.assign(v.valid_tokens, v.valid_tokens + n);
  return h;
}

void check_same_view(const HostView& a, const HostView& b) {
  REQUIRE(a.batch == b.batch);
  CHECK(a.ids == b.ids);
  CHECK(a.len == b.len);
  REQUIRE(a.indptr == b.indptr);
  CHECK(a.block == b.block);
  CHECK(a.slot == b.slot);
  CHECK(a.valid == b.valid);
}

// Every entry of the device view holds, in its valid rows, the CPU host tier's block.
template <KvElement T>
void check_slot_contents(const Cache<cpu, T>& cpu_cache, const Cache<cuda, T>& gpu_cache, const LayerView<T>& gv,
                         const HostView& hv) {
  const auto& L = cpu_cache.layout();
  const int d = L.config.shape.head_dim, bt = L.config.block_tokens;
  const auto pool = download(gv.pool, static_cast<std::size_t>(gpu_cache.device_tier().slots_per_layer() * L.block_elems));
  int mismatches = 0;
  for (int i = 0; i < hv.batch; ++i) {
    const int s = cpu_cache.block_table().find(hv.ids[static_cast<std::size_t>(i)]);
    REQUIRE(s >= 0);
    for (int h = 0; h < hv.heads; ++h) {
      const int p = i * hv.heads + h;
      for (std::int32_t e = hv.indptr[static_cast<std::size_t>(p)]; e < hv.indptr[static_cast<std::size_t>(p) + 1]; ++e) {
        const auto ue = static_cast<std::size_t>(e);
        const T* ref = cpu_cache.host_tier().block(s, gv.layer, h, hv.block[ue]);
        const T* got = pool.data() + static_cast<std::int64_t>(hv.slot[ue]) * L.block_elems;
        const std::size_t rows = static_cast<std::size_t>(hv.valid[ue]) * static_cast<std::size_t>(d) * sizeof(T);
        const bool ok = std::memcmp(got, ref, rows) == 0 &&
                        std::memcmp(got + static_cast<std::int64_t>(bt) * d, ref + static_cast<std::int64_t>(bt) * d, rows) == 0;
        if (!ok && ++mismatches <= 5) {
          INFO("layer " << gv.layer << ", sequence " << hv.ids[static_cast<std::size_t>(i)] << ", kv head " << h
                        << ", block " << hv.block[ue] << ", slot " << hv.slot[ue]);
          CHECK(ok);
        }
      }
    }
  }
  CHECK(mismatches == 0);
}

template <class T>
float attention_tolerance() {
  return std::is_same_v<T, float> ? 2e-5f : 1e-3f;
}

void check_close(const std::vector<float>& got, const std::vector<float>& expected, float tol) {
  REQUIRE(got.size() == expected.size());
  float worst = 0.0f;
  for (std::size_t j = 0; j < got.size(); ++j) {
    worst = std::max(worst, std::fabs(got[j] - expected[j]) / std::max(1.0f, std::fabs(expected[j])));
  }
  INFO("worst relative difference " << worst);
  CHECK(worst <= tol);
}

void check_same_statistics(const Statistics& a, const Statistics& b) {
  REQUIRE(a.layers.size() == b.layers.size());
  for (std::size_t l = 0; l < a.layers.size(); ++l) {
    INFO("layer " << l);
    const auto& x = a.layers[l];
    const auto& y = b.layers[l];
    CHECK(x.plans == y.plans);
    CHECK(x.blocks_selected == y.blocks_selected);
    CHECK(x.blocks_fetched == y.blocks_fetched);
    CHECK(x.bytes_fetched == y.bytes_fetched);
    CHECK(x.admits_capped == y.admits_capped);
    CHECK(x.acquires == y.acquires);
    CHECK(x.observed_true_blocks == y.observed_true_blocks);
    CHECK(x.observed_hits == y.observed_hits);
  }
}

// Random rows on the host and their device copy.
template <class V>
struct Rows {
  std::vector<V> host;
  gpu::DeviceBuffer<V> device;
  std::int64_t rows = 0;
  RowsView host_view() const { return RowsView{host.data(), dtype_of_v<V>, rows}; }
  RowsView device_view() const { return RowsView{device.data(), dtype_of_v<V>, rows}; }
};
template <class V>
Rows<V> make_rows(std::mt19937_64& rng, std::int64_t rows, int width, float scale = 1.0f) {
  Rows<V> r;
  r.rows = rows;
  r.host = test::random_rows<V>(rng, static_cast<std::size_t>(rows * width), scale);
  r.device = upload(r.host);
  return r;
}

// The CPU cache and the CUDA cache, driven by the same calls.
template <KvElement T>
struct Pair {
  explicit Pair(const CacheConfig& c) : config(c), cpu_cache(c), gpu_cache(c, stream.get()) {}
  CacheConfig config;
  gpu::Stream stream;
  Cache<cpu, T> cpu_cache;
  Cache<cuda, T> gpu_cache;
  bool float_queries = false;

  int row_width() const { return config.shape.num_kv_heads * config.shape.head_dim; }
  int q_width() const { return config.shape.num_q_heads * config.shape.head_dim; }

  void add(SeqId id) {
    cpu_cache.add_sequence(id);
    gpu_cache.add_sequence(id);
  }
  void remove(SeqId id) {
    cpu_cache.remove_sequence(id);
    gpu_cache.remove_sequence(id);
  }
  void append(std::mt19937_64& rng, const std::vector<SeqId>& batch, int layer, const std::vector<std::int32_t>& rows) {
    std::int64_t total = 0;
    for (auto n : rows) total += n;
    auto k = make_rows<T>(rng, total, row_width());
    auto v = make_rows<T>(rng, total, row_width());
    cpu_cache.append(batch, layer, rows, k.host_view(), v.host_view());
    gpu_cache.append(batch, layer, rows, k.device_view(), v.device_view());
    OASISKV_CUDA_CHECK(cudaStreamSynchronize(stream.get()));  // before the inputs are freed
  }
  // Queries: float or T (alternating).
  template <class F>
  auto with_queries(std::mt19937_64& rng, std::int64_t rows, F&& f) {
    float_queries = !float_queries;
    if (float_queries) {
      auto q = make_rows<float>(rng, rows, q_width(), 2.0f);
      return f(q.host_view(), q.device_view());
    }
    auto q = make_rows<T>(rng, rows, q_width(), 2.0f);
    return f(q.host_view(), q.device_view());
  }
  std::pair<Ticket, Ticket> prefetch(std::mt19937_64& rng, const std::vector<SeqId>& batch, int layer, int R) {
    return with_queries(rng, R * static_cast<std::int64_t>(batch.size()), [&](RowsView hq, RowsView dq) {
      const Ticket a = cpu_cache.prefetch(batch, layer, hq);
      const Ticket b = gpu_cache.prefetch(batch, layer, dq);
      OASISKV_CUDA_CHECK(cudaStreamSynchronize(gpu_cache.copy_stream()));  // before q is freed
      CHECK(a.id == b.id);
      CHECK(a.sequences == b.sequences);
      CHECK(a.generations == b.generations);
      return std::pair{a, b};
    });
  }

  // acquire both, compare views, slot contents and attention; observe; release both.
  void attend(std::mt19937_64& rng, const std::pair<Ticket, Ticket>& t) {
    const auto& s = config.shape;
    const float scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
    const LayerView<T> cv = cpu_cache.acquire(t.first);
    const LayerView<T> gv = gpu_cache.acquire(t.second);
    auto q = make_rows<float>(rng, cv.batch_size, q_width());
    gpu::DeviceBuffer<float> dout(q.host.size());
    gpu::sparse_attention<T>(gv, s.num_q_heads, scale, q.device.data(), dout.data(), stream.get());
    OASISKV_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
    const HostView want = host_view(cv);
    const HostView got = fetch_view(gv);
    check_same_view(want, got);
    check_slot_contents(cpu_cache, gpu_cache, gv, got);
    std::vector<float> expected(q.host.size());
    sparse_attention_reference(cv, s.num_q_heads, scale, q.host.data(), expected.data());
    check_close(download(dout, dout.size()), expected, attention_tolerance<T>());
    with_queries(rng, cv.batch_size, [&](RowsView hq, RowsView dq) {
      cpu_cache.observe(t.first, hq);
      gpu_cache.observe(t.second, dq);
      OASISKV_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
      return 0;
    });
    cpu_cache.release(t.first);
    gpu_cache.release(t.second);
  }
};

template <KvElement T>
void run_twin(GroupReduction reduction, double fetch_ratio) {
  OASISKV_SEEDED_RNG(rng);
  CacheConfig c;
  c.shape = ModelShape{2, 8, 2, 64};
  c.block_tokens = 16;
  c.budget_tokens = 256;  // 1 sink + 3 ring + 12 selectable blocks
  c.sink_tokens = 16;
  c.recent_tokens = 32;
  c.fetch_ratio = fetch_ratio;
  c.max_sequences = 3;
  c.max_tokens_per_sequence = 2048;
  c.reduction = reduction;
  INFO("reduction " << reduction_name(reduction) << ", fetch_ratio " << fetch_ratio);
  Pair<T> tw(c);
  const std::vector<SeqId> batch{10, 20};
  tw.add(10);
  tw.add(20);
  const int L = c.shape.num_layers;
  std::uniform_int_distribution<std::int32_t> prompt(150, 900);
  std::vector<std::pair<Ticket, Ticket>> prev(static_cast<std::size_t>(L));
  for (int l = 0; l < L; ++l) {
    tw.append(rng, batch, l, {prompt(rng), prompt(rng)});
    prev[static_cast<std::size_t>(l)] = tw.prefetch(rng, batch, l, 1);
  }
  for (int step = 0; step < 8; ++step) {
    INFO("step " << step);
    if (step == 4) {
      // Remove and re-add sequence 20: the outstanding tickets are stale on both backends.
      tw.remove(20);
      for (int l = 0; l < L; ++l) {
        CHECK_THROWS_WITH_AS(tw.cpu_cache.acquire(prev[static_cast<std::size_t>(l)].first), doctest::Contains("stale"), Error);
        CHECK_THROWS_WITH_AS(tw.gpu_cache.acquire(prev[static_cast<std::size_t>(l)].second), doctest::Contains("stale"), Error);
      }
      tw.add(20);
      for (int l = 0; l < L; ++l) {
        tw.append(rng, {20}, l, {prompt(rng)});
        prev[static_cast<std::size_t>(l)] = tw.prefetch(rng, batch, l, 2);
      }
    }
    for (int l = 0; l < L; ++l) {
      INFO("layer " << l);
      tw.append(rng, batch, l, {1, 1});
      const auto next = tw.prefetch(rng, batch, l, 2);
      tw.attend(rng, prev[static_cast<std::size_t>(l)]);
      prev[static_cast<std::size_t>(l)] = next;
    }
  }
  // select_blocks (synchronous on the CUDA backend) agrees too.
  tw.with_queries(rng, 2, [&](RowsView hq, RowsView dq) {
    CHECK(tw.cpu_cache.select_blocks(10, 1, hq) == tw.gpu_cache.select_blocks(10, 1, dq));
    return 0;
  });
  check_same_statistics(tw.cpu_cache.statistics(), tw.gpu_cache.statistics());
  const auto total = tw.gpu_cache.statistics().total();
  CHECK(total.blocks_fetched > 0);
  if (fetch_ratio < 0.1) CHECK(total.admits_capped > 0);
  // The host tiers hold the same rows.
  tw.gpu_cache.synchronize();
  REQUIRE(tw.cpu_cache.host_tier().bytes_reserved() == tw.gpu_cache.host_tier().bytes_reserved());
  CHECK(std::memcmp(tw.cpu_cache.host_tier().block(0, 0, 0, 0), tw.gpu_cache.host_tier().base(),
                    tw.gpu_cache.host_tier().bytes_reserved()) == 0);
}

// OASISKV_CUDA_TEST_QUICK=1 (scripts/gpu-check under compute-sanitizer): one configuration.
template <KvElement T>
void run_twins() {
  if (std::getenv("OASISKV_CUDA_TEST_QUICK") != nullptr) {
    run_twin<T>(GroupReduction::max, 0.05);
    return;
  }
  for (GroupReduction r : {GroupReduction::max, GroupReduction::sum}) {
    for (double ratio : {1.0, 0.05}) run_twin<T>(r, ratio);
  }
}

}  // namespace

OASISKV_CUDA_TEST_CASE("cuda Cache<cuda> equals Cache<cpu>: views, slot contents, attention, statistics (float)") {
  run_twins<float>();
}
OASISKV_CUDA_TEST_CASE("cuda Cache<cuda> equals Cache<cpu>: views, slot contents, attention, statistics (fp16)") {
  run_twins<fp16_t>();
}
OASISKV_CUDA_TEST_CASE("cuda Cache<cuda> equals Cache<cpu>: views, slot contents, attention, statistics (bf16)") {
  run_twins<bf16_t>();
}

namespace {

// Sequences, lengths, plan numbers, host rows and statistics of a CUDA cache (synchronises).
template <class T>
std::uint64_t fingerprint(const Cache<cuda, T>& cache, const std::vector<SeqId>& ids) {
  cache.synchronize();
  test::Fingerprint f;
  const auto& s = cache.layout().config.shape;
  f.add_value(cache.num_sequences());
  for (SeqId id : ids) {
    f.add_value(cache.has_sequence(id));
    if (!cache.has_sequence(id)) continue;
    const int slot = cache.block_table().find(id);
    f.add_value(cache.block_table().generation(slot));
    for (int l = 0; l < s.num_layers; ++l) {
      const std::int64_t len = cache.sequence_length(id, l);
      f.add_value(len);
      f.add_value(cache.block_table().next_plan(slot, l));
      for (int h = 0; h < s.num_kv_heads; ++h) {
        const std::int64_t blocks = (len + cache.layout().config.block_tokens - 1) / cache.layout().config.block_tokens;
        f.add(cache.host_tier().block(slot, l, h, 0), static_cast<std::size_t>(blocks * cache.layout().block_elems) * sizeof(T));
      }
    }
  }
  for (const auto& ls : cache.statistics().layers) {
    f.add_value(ls.plans);
    f.add_value(ls.blocks_fetched);
    f.add_value(ls.admits_capped);
    f.add_value(ls.acquires);
    f.add_value(ls.observed_true_blocks);
    f.add_value(ls.observed_hits);
  }
  return f.h;
}

}  // namespace

OASISKV_CUDA_TEST_CASE("cuda Cache<cuda> refuses bad calls with the bad value named, and is unchanged") {
  OASISKV_SEEDED_RNG(rng);
  CacheConfig c = test::small_config(/*budget*/ 96, /*capacity*/ 256, /*sequences*/ 3);
  gpu::Stream stream;
  Cache<cuda, float> cache(c, stream.get());
  const int H = c.shape.num_kv_heads, Hq = c.shape.num_q_heads, d = c.shape.head_dim;
  cache.add_sequence(1);
  cache.add_sequence(2);
  const std::vector<SeqId> both{1, 2}, s1{1}, s2{2}, s99{99}, dup{1, 1};
  auto k80 = make_rows<float>(rng, 80, H * d);
  for (int l = 0; l < c.shape.num_layers; ++l) {
    cache.append(both, l, std::vector<std::int32_t>{40, 40}, k80.device_view(), k80.device_view());
  }
  auto q2 = make_rows<float>(rng, 2, Hq * d);
  auto q1 = make_rows<float>(rng, 1, Hq * d);
  auto q10 = make_rows<float>(rng, 10, Hq * d);
  const Ticket acquired = cache.prefetch(both, 0, q2.device_view());
  const Ticket pending = cache.prefetch(both, 1, q2.device_view());
  const Ticket pending2 = cache.prefetch(s1, 1, q1.device_view());
  (void)cache.acquire(acquired);
  auto one = make_rows<float>(rng, 1, H * d);
  auto two = make_rows<float>(rng, 2, H * d);
  std::vector<float> pageable(static_cast<std::size_t>(2 * H * d), 1.0f);
  auto h16 = make_rows<fp16_t>(rng, 2, H * d);

  struct Case {
    const char* name;
    std::function<void()> call;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"append to an unknown sequence", [&] { cache.append(s99, 1, one.device_view(), one.device_view()); }, "sequence 99 is not in the cache"},
      {"append at a layer past the model", [&] { cache.append(s2, 5, one.device_view(), one.device_view()); }, "layer 5 is out of range [0, 2)"},
      {"append a wrong row count", [&] { cache.append(both, 1, one.device_view(), one.device_view()); }, "k has 1 rows, expected 2"},
      {"append a wrong element type", [&] { cache.append(both, 1, h16.device_view(), two.device_view()); }, "element type f16, but this cache holds f32"},
      {"append a null pointer", [&] { cache.append(both, 1, two.device_view(), RowsView{nullptr, DType::f32, 2}); }, "v is a null pointer"},
      {"append pageable host memory", [&] { cache.append(both, 1, RowsView{pageable.data(), DType::f32, 2}, two.device_view()); }, "k ("},
      {"append past capacity", [&] { cache.append(s2, 1, std::vector<std::int32_t>{300}, RowsView{two.device.data(), DType::f32, 300}, RowsView{two.device.data(), DType::f32, 300}); }, "past its capacity of 256"},
      {"append one sequence twice", [&] { cache.append(dup, 1, two.device_view(), two.device_view()); }, "sequence 1 appears twice"},
      {"append under attention", [&] { cache.append(s1, 0, one.device_view(), one.device_view()); }, "sequence 1 at layer 0 is under attention"},
      {"prefetch q rows not a multiple of the batch", [&] { cache.prefetch(both, 0, RowsView{q2.device.data(), DType::f32, 3}); }, "q has 3 rows, expected a positive multiple of the batch size 2"},
      {"prefetch more rows than max_query_rows", [&] { cache.prefetch(both, 0, q10.device_view()); }, "more than options.max_query_rows = 4"},
      {"prefetch a third outstanding ticket", [&] { cache.prefetch(s2, 1, q1.device_view()); }, "already has 2 outstanding tickets"},
      {"acquire before any prefetch", [&] { cache.acquire(Ticket{}); }, "empty ticket"},
      {"acquire while the layer holds another ticket", [&] { cache.acquire(Ticket{acquired.id + 100, 0, both, acquired.generations}); }, "layer 0 already has ticket"},
      {"release a ticket that is not acquired", [&] { cache.release(pending); }, "is not acquired at layer 1"},
      {"observe a ticket that is not acquired", [&] { cache.observe(pending, q2.device_view()); }, "is not acquired at layer 1"},
      {"remove a sequence under attention", [&] { cache.remove_sequence(2); }, "sequence 2 is in ticket"},
      {"add a sequence twice", [&] { cache.add_sequence(2); }, "sequence 2 is already in the cache"},
  };
  for (const auto& k : cases) {
    CAPTURE(k.name);
    const std::uint64_t before = fingerprint(cache, {1, 2});
    CHECK_THROWS_WITH_AS(k.call(), doctest::Contains(k.message), Error);
    CHECK(fingerprint(cache, {1, 2}) == before);
  }
  cache.release(acquired);
  (void)cache.acquire(pending2);
  cache.release(pending2);
  CHECK_THROWS_WITH_AS(cache.acquire(pending2), doctest::Contains("unknown, already released"), Error);
  CHECK_THROWS_WITH_AS(cache.acquire(pending), doctest::Contains("superseded"), Error);
  // A ticket of a removed sequence is stale.
  const Ticket t = cache.prefetch(s2, 0, q1.device_view());
  cache.remove_sequence(2);
  CHECK_THROWS_WITH_AS(cache.acquire(t), doctest::Contains("sequence 2 was removed"), Error);
}

// One decode step (append, prefetch, acquire, attention, release at every layer) captured into a
// CUDA graph and launched, against the same step run eagerly on a twin cache; then eager steps
// and a second captured step, and the statistics.
OASISKV_CUDA_TEST_CASE("cuda Cache<cuda> decode step captured in a CUDA graph equals the eager step") {
  OASISKV_SEEDED_RNG(rng);
  CacheConfig c;
  c.shape = ModelShape{2, 4, 2, 64};
  c.budget_tokens = 192;
  c.max_sequences = 3;
  c.max_tokens_per_sequence = 1024;
  c.fetch_ratio = 0.25;
  using T = fp16_t;
  gpu::Stream se, sg;
  Cache<cuda, T> eager(c, se.get()), graph(c, sg.get());
  const std::vector<SeqId> batch{5, 6, 7};
  const int B = 3, L = c.shape.num_layers, H = c.shape.num_kv_heads, nq = c.shape.num_q_heads, d = c.shape.head_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (auto* cache : {&eager, &graph}) {
    for (SeqId id : batch) cache->add_sequence(id);
  }
  std::vector<Ticket> pe(static_cast<std::size_t>(L)), pg(static_cast<std::size_t>(L));
  for (int l = 0; l < L; ++l) {
    const std::vector<std::int32_t> rows{300, 420, 517};
    auto k = make_rows<T>(rng, 1237, H * d), v = make_rows<T>(rng, 1237, H * d);
    auto q = make_rows<float>(rng, B, nq * d);
    eager.append(batch, l, rows, k.device_view(), v.device_view());
    graph.append(batch, l, rows, k.device_view(), v.device_view());
    pe[static_cast<std::size_t>(l)] = eager.prefetch(batch, l, q.device_view());
    pg[static_cast<std::size_t>(l)] = graph.prefetch(batch, l, q.device_view());
    eager.synchronize();
    graph.synchronize();
  }
  // One step's inputs, uploaded before any capture (no allocation during capture).
  struct StepInputs {
    std::vector<Rows<T>> k, v;
    std::vector<Rows<float>> q_la, q;
    std::vector<gpu::DeviceBuffer<float>> out_eager, out_graph;
  };
  auto inputs = [&]() {
    StepInputs in;
    for (int l = 0; l < L; ++l) {
      in.k.push_back(make_rows<T>(rng, B, H * d));
      in.v.push_back(make_rows<T>(rng, B, H * d));
      in.q_la.push_back(make_rows<float>(rng, 2 * B, nq * d, 2.0f));
      in.q.push_back(make_rows<float>(rng, B, nq * d));
      in.out_eager.emplace_back(static_cast<std::size_t>(B * nq * d));
      in.out_graph.emplace_back(static_cast<std::size_t>(B * nq * d));
    }
    return in;
  };
  auto step = [&](Cache<cuda, T>& cache, std::vector<Ticket>& prev, StepInputs& in, bool into_graph,
                  std::vector<HostView>* views) {
    std::vector<LayerView<T>> acquired;
    for (int l = 0; l < L; ++l) {
      const auto ul = static_cast<std::size_t>(l);
      cache.append(batch, l, in.k[ul].device_view(), in.v[ul].device_view());
      const Ticket next = cache.prefetch(batch, l, in.q_la[ul].device_view());
      const LayerView<T> view = cache.acquire(prev[ul]);
      gpu::sparse_attention<T>(view, nq, scale, in.q[ul].device.data(),
                               (into_graph ? in.out_graph[ul] : in.out_eager[ul]).data(), cache.compute_stream());
      cache.release(prev[ul]);
      prev[ul] = next;
      acquired.push_back(view);
    }
    if (views != nullptr) {
      cache.synchronize();
      for (const auto& v : acquired) views->push_back(fetch_view(v));
    }
  };
  for (int round = 0; round < 2; ++round) {
    INFO("round " << round);
    // An eager step on both.
    {
      StepInputs in = inputs();
      std::vector<HostView> ve, vg;
      step(eager, pe, in, false, &ve);
      step(graph, pg, in, false, &vg);
      for (std::size_t l = 0; l < ve.size(); ++l) check_same_view(ve[l], vg[l]);
    }
    // The same step eager on one, captured then launched on the other.
    StepInputs in = inputs();
    std::vector<HostView> ve, vg;
    step(eager, pe, in, false, &ve);
    graph.join();
    cudaGraph_t g = nullptr;
    cudaGraphExec_t exec = nullptr;
    OASISKV_CUDA_CHECK(cudaStreamBeginCapture(sg.get(), cudaStreamCaptureModeGlobal));
    try {
      std::vector<HostView>* none = nullptr;
      step(graph, pg, in, true, none);
      graph.join();
    } catch (...) {
      cudaGraph_t broken = nullptr;
      (void)cudaStreamEndCapture(sg.get(), &broken);
      if (broken != nullptr) (void)cudaGraphDestroy(broken);
      throw;
    }
    OASISKV_CUDA_CHECK(cudaStreamEndCapture(sg.get(), &g));
    OASISKV_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
    OASISKV_CUDA_CHECK(cudaGraphLaunch(exec, sg.get()));
    graph.synchronize();
    eager.synchronize();
    for (int l = 0; l < L; ++l) {
      const auto ul = static_cast<std::size_t>(l);
      const auto a = download(in.out_eager[ul], in.out_eager[ul].size());
      const auto b = download(in.out_graph[ul], in.out_graph[ul].size());
      CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);  // same kernels, same data
    }
    CHECK(std::memcmp(eager.host_tier().base(), graph.host_tier().base(), eager.host_tier().bytes_reserved()) == 0);
    OASISKV_CUDA_CHECK(cudaGraphExecDestroy(exec));
    OASISKV_CUDA_CHECK(cudaGraphDestroy(g));
  }
  // An eager step after the graphs: the same views.
  StepInputs in = inputs();
  std::vector<HostView> ve, vg;
  step(eager, pe, in, false, &ve);
  step(graph, pg, in, false, &vg);
  for (std::size_t l = 0; l < ve.size(); ++l) check_same_view(ve[l], vg[l]);
  check_same_statistics(eager.statistics(), graph.statistics());
  CHECK(graph.statistics().total().blocks_fetched > 0);
}

}  // namespace oasiskv::gpu_test
