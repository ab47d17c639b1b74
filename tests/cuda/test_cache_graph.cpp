// Cache<cuda, T> decode steps captured into CUDA graphs: a captured and launched step equals the
// same step run eagerly on a twin cache (also at a large geometry), and an abandoned capture
// leaves the cache as if the step had never been made.
#include <doctest/doctest.h>

#include "cuda/cache_twin.hpp"

namespace oasiskv::gpu_test {
namespace {

template <KvElement T>
struct GraphRig {
  GraphRig(const CacheConfig& c, std::vector<SeqId> ids)
      : config(c),
        batch(std::move(ids)),
        eager(c, CudaOptions{.compute_stream = se.get(), .max_query_rows = 4}),
        graph(c, CudaOptions{.compute_stream = sg.get(), .max_query_rows = 4}) {}
  CacheConfig config;
  std::vector<SeqId> batch;
  gpu::Stream se, sg;
  Cache<cuda, T> eager, graph;
  std::vector<Ticket> pe, pg;

  int B() const { return static_cast<int>(batch.size()); }
  int width() const { return config.shape.num_kv_heads * config.shape.head_dim; }
  int q_width() const { return config.shape.num_q_heads * config.shape.head_dim; }

  // One step's inputs, uploaded before any capture (no allocation during capture).
  struct StepInputs {
    std::vector<Rows<T>> k, v;
    std::vector<Rows<float>> q_la, q;
    std::vector<std::unique_ptr<gpu::DeviceBuffer<float>>> out_eager, out_graph;
  };
  StepInputs inputs(std::mt19937_64& rng, int rows) {
    StepInputs in;
    for (int l = 0; l < config.shape.num_layers; ++l) {
      in.k.push_back(make_rows<T>(rng, B(), width(), se.get()));
      in.v.push_back(make_rows<T>(rng, B(), width(), se.get()));
      in.q_la.push_back(make_rows<float>(rng, rows * B(), q_width(), se.get(), 2.0f));
      in.q.push_back(make_rows<float>(rng, B(), q_width(), se.get()));
      in.out_eager.push_back(std::make_unique<gpu::DeviceBuffer<float>>(static_cast<std::size_t>(B() * q_width())));
      in.out_graph.push_back(std::make_unique<gpu::DeviceBuffer<float>>(static_cast<std::size_t>(B() * q_width())));
    }
    OASISKV_CUDA_CHECK(cudaStreamSynchronize(se.get()));  // both caches read these
    return in;
  }
  void step(Cache<cuda, T>& cache, std::vector<Ticket>& prev, StepInputs& in, bool into_graph, std::vector<HostView>* views) {
    const float scale = 1.0f / std::sqrt(static_cast<float>(config.shape.head_dim));
    const cudaStream_t s = cache.backend().compute_stream();
    std::vector<LayerView<T>> acquired;
    for (int l = 0; l < config.shape.num_layers; ++l) {
      const auto ul = static_cast<std::size_t>(l);
      cache.append(batch, l, in.k[ul].device_view(), in.v[ul].device_view());
      const Ticket next = cache.prefetch(batch, l, in.q_la[ul].device_view());
      const LayerView<T> view = cache.acquire(prev[ul]);
      gpu::reference::sparse_attention<T>(view, config.shape.num_q_heads, scale, in.q[ul].device->data(),
                                          (into_graph ? in.out_graph[ul] : in.out_eager[ul])->data(), s);
      cache.release(prev[ul]);
      prev[ul] = next;
      acquired.push_back(view);
    }
    if (views != nullptr) {
      for (const auto& v : acquired) views->push_back(fetch_view(v, s));  // valid: pinned per layer until reacquired
    }
  }
  void prefill(std::mt19937_64& rng, const std::vector<std::int32_t>& rows, int query_rows) {
    pe.resize(static_cast<std::size_t>(config.shape.num_layers));
    pg.resize(pe.size());
    for (SeqId id : batch) {
      eager.add_sequence(id);
      graph.add_sequence(id);
    }
    std::int64_t total = 0;
    for (auto r : rows) total += r;
    for (int l = 0; l < config.shape.num_layers; ++l) {
      auto k = make_rows<T>(rng, total, width(), se.get()), v = make_rows<T>(rng, total, width(), se.get());
      auto q = make_rows<float>(rng, query_rows * B(), q_width(), se.get());
      OASISKV_CUDA_CHECK(cudaStreamSynchronize(se.get()));
      eager.append(batch, l, rows, k.device_view(), v.device_view());
      graph.append(batch, l, rows, k.device_view(), v.device_view());
      pe[static_cast<std::size_t>(l)] = eager.prefetch(batch, l, q.device_view());
      pg[static_cast<std::size_t>(l)] = graph.prefetch(batch, l, q.device_view());
      eager.synchronize();
      graph.synchronize();
    }
  }
  // Captures one step of `graph` (launched unless `discard`); eager runs the same step.
  void captured_step(std::mt19937_64& rng, int rows, bool discard) {
    StepInputs in = inputs(rng, rows);
    std::vector<HostView> ve;
    if (!discard) step(eager, pe, in, false, &ve);
    graph.join();
    cudaGraph_t g = nullptr;
    OASISKV_CUDA_CHECK(cudaStreamBeginCapture(sg.get(), cudaStreamCaptureModeGlobal));
    try {
      step(graph, pg, in, true, nullptr);
      graph.join();
    } catch (...) {
      cudaGraph_t broken = nullptr;
      (void)cudaStreamEndCapture(sg.get(), &broken);
      if (broken != nullptr) (void)cudaGraphDestroy(broken);
      throw;
    }
    OASISKV_CUDA_CHECK(cudaStreamEndCapture(sg.get(), &g));
    if (discard) {
      OASISKV_CUDA_CHECK(cudaGraphDestroy(g));
      graph.abandon_capture();
      return;
    }
    cudaGraphExec_t exec = nullptr;
    OASISKV_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
    OASISKV_CUDA_CHECK(cudaGraphLaunch(exec, sg.get()));
    graph.synchronize();
    eager.synchronize();
    for (int l = 0; l < config.shape.num_layers; ++l) {
      const auto ul = static_cast<std::size_t>(l);
      const auto a = download(*in.out_eager[ul], se.get());
      const auto b = download(*in.out_graph[ul], sg.get());
      CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);  // same kernels, same data
    }
    CHECK(std::memcmp(eager.host_tier().base(), graph.host_tier().base(), eager.host_tier().bytes_reserved()) == 0);
    OASISKV_CUDA_CHECK(cudaGraphExecDestroy(exec));
    OASISKV_CUDA_CHECK(cudaGraphDestroy(g));
  }
  void eager_step_both(std::mt19937_64& rng, int rows) {
    StepInputs in = inputs(rng, rows);
    std::vector<HostView> ve, vg;
    step(eager, pe, in, false, &ve);
    step(graph, pg, in, false, &vg);
    REQUIRE(ve.size() == vg.size());
    for (std::size_t l = 0; l < ve.size(); ++l) check_same_view(ve[l], vg[l]);
  }
};

template <KvElement T>
void run_graph(const CacheConfig& c, const std::vector<std::int32_t>& prompt, int rows) {
  OASISKV_SEEDED_RNG(rng);
  std::vector<SeqId> ids;
  for (std::size_t i = 0; i < prompt.size(); ++i) ids.push_back(5 + i);
  GraphRig<T> rig(c, ids);
  rig.prefill(rng, prompt, rows);
  for (int round = 0; round < 2; ++round) {
    INFO("round " << round);
    rig.eager_step_both(rng, rows);
    rig.captured_step(rng, rows, /*discard*/ false);
  }
  rig.eager_step_both(rng, rows);
  check_same_statistics(rig.eager.statistics(), rig.graph.statistics());
  CHECK(rig.graph.statistics().total().blocks_fetched > 0);
}

}  // namespace

OASISKV_CUDA_TEST_CASE("cuda Cache<cuda> decode step captured in a CUDA graph equals the eager step") {
  CacheConfig c;
  c.shape = ModelShape{2, 4, 2, 64};
  c.budget_tokens = 192;
  c.max_sequences = 3;
  c.max_tokens_per_sequence = 1024;
  c.fetch_ratio = 0.25;
  run_graph<fp16_t>(c, {300, 420, 517}, 2);
}

OASISKV_CUDA_TEST_CASE("cuda Cache<cuda> captured decode step at a large geometry equals the eager step") {
  CacheConfig c;
  c.shape = ModelShape{2, 16, 2, 256};  // GQA group 8, head_dim 256
  c.budget_tokens = 8192;
  c.fetch_ratio = 0.05;
  c.max_sequences = 2;
  c.max_tokens_per_sequence = 16384 + 64;
  run_graph<bf16_t>(c, {16384, 9000}, 4);
}

// An abandoned capture: lengths, tickets and resident sets as if the step had not been made; the
// next eager steps then agree with a cache that never saw it, once its plans are refilled.
OASISKV_CUDA_TEST_CASE("cuda Cache<cuda> abandon_capture after a discarded graph leaves a consistent cache") {
  OASISKV_SEEDED_RNG(rng);
  CacheConfig c;
  c.shape = ModelShape{2, 4, 2, 64};
  c.budget_tokens = 192;
  c.max_sequences = 2;
  c.max_tokens_per_sequence = 1024;
  c.fetch_ratio = 0.25;
  GraphRig<float> rig(c, {1, 2});
  rig.prefill(rng, {300, 500}, 1);
  const std::int64_t before = rig.graph.sequence_length(1, 0);
  const std::vector<Ticket> outstanding = rig.pg;
  rig.captured_step(rng, 1, /*discard*/ true);
  CHECK(rig.graph.sequence_length(1, 0) == before);
  CHECK(rig.graph.sequence_length(2, 1) == rig.eager.sequence_length(2, 1));
  for (const Ticket& t : outstanding) CHECK_THROWS_AS(rig.graph.acquire(t), Error);
  // Both caches restart their plans (eager's by recovery too), then run the same steps.
  for (int l = 0; l < c.shape.num_layers; ++l) rig.eager.recover_layer(l);
  auto q = make_rows<float>(rng, 2, rig.q_width(), rig.se.get());
  OASISKV_CUDA_CHECK(cudaStreamSynchronize(rig.se.get()));
  for (int l = 0; l < c.shape.num_layers; ++l) {
    rig.pe[static_cast<std::size_t>(l)] = rig.eager.prefetch(rig.batch, l, q.device_view());
    rig.pg[static_cast<std::size_t>(l)] = rig.graph.prefetch(rig.batch, l, q.device_view());
  }
  for (int i = 0; i < 3; ++i) rig.eager_step_both(rng, 1);
  rig.eager.synchronize();
  rig.graph.synchronize();
  CHECK(std::memcmp(rig.eager.host_tier().base(), rig.graph.host_tier().base(), rig.eager.host_tier().bytes_reserved()) == 0);
}

}  // namespace oasiskv::gpu_test
