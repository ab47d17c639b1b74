// Cache<cuda, T> against Cache<cpu, T> (tests/cuda/cache_twin.hpp): the same calls on fresh seeded
// random inputs give identical views, slot contents byte-equal to the CPU host tier, identical
// statistics and attention within tolerance; in the protocol, under delayed streams without
// per-call synchronisation, at a large geometry, with softmax_sum and the ticket lifecycle; plus
// the CUDA-only refusals and the device the cache lives on.
#include <doctest/doctest.h>

#include <algorithm>

#include <cstdlib>
#include <functional>
#include <set>

#include "conformance/harness.hpp"
#include "cuda/cache_twin.hpp"

namespace oasiskv::gpu_test {
namespace {

CacheConfig twin_config(GroupReduction reduction, double fetch_ratio, BlockScore scorer = BlockScore::quest) {
  CacheConfig c;
  c.scorer = scorer;
  c.shape = ModelShape{2, 8, 2, 64};
  c.budget_tokens = 256;  // 1 sink + 3 ring + 12 selectable blocks
  c.sink_tokens = 16;
  c.recent_tokens = 32;
  c.fetch_ratio = fetch_ratio;
  c.max_sequences = 3;
  c.max_tokens_per_sequence = 2048;
  c.reduction = reduction;
  return c;
}

// The decode protocol for 8 steps, with a remove and re-add, a fork (its shared partial block
// copied on the next append) and a rollback in the middle; with `profile`, both caches have
// budgets by layer and kv head; `scorer` and `run_tokens` pick the block scorer.
template <KvElement T>
void run_twin(GroupReduction reduction, double fetch_ratio, const BudgetProfile* profile = nullptr,
              BlockScore scorer = BlockScore::quest, int run_tokens = 4) {
  OASISKV_SEEDED_RNG(rng);
  INFO("reduction " << reduction_name(reduction) << ", fetch_ratio " << fetch_ratio << ", profile "
                    << (profile != nullptr ? profile->text() : std::string("none")) << ", scorer "
                    << block_score_name(scorer) << ", run_tokens " << run_tokens);
  CacheConfig config = twin_config(reduction, fetch_ratio, scorer);
  config.run_tokens = run_tokens;
  auto twin = profile != nullptr ? std::make_unique<Twin<T>>(config, *profile) : std::make_unique<Twin<T>>(config);
  Twin<T>& tw = *twin;
  std::vector<SeqId> batch{10, 20};
  tw.add(10);
  tw.add(20);
  const int L = tw.config.shape.num_layers;
  std::uniform_int_distribution<std::int32_t> prompt(150, 900);
  std::vector<std::pair<Ticket, Ticket>> prev(static_cast<std::size_t>(L));
  // One prompt length per sequence, the same at every layer (a fork between steps needs layers
  // of equal length).
  const std::vector<std::int32_t> prompts{prompt(rng), prompt(rng)};
  for (int l = 0; l < L; ++l) {
    tw.append(rng, batch, l, prompts);
    prev[static_cast<std::size_t>(l)] = tw.prefetch(rng, batch, l, 1);
  }
  for (int step = 0; step < 8; ++step) {
    INFO("step " << step);
    if (step == 4) {
      tw.remove(20);
      for (int l = 0; l < L; ++l) {
        CHECK_THROWS_WITH_AS(tw.cpu_cache.acquire(prev[static_cast<std::size_t>(l)].first), doctest::Contains("stale"), Error);
        CHECK_THROWS_WITH_AS(tw.gpu_cache.acquire(prev[static_cast<std::size_t>(l)].second), doctest::Contains("stale"), Error);
      }
      tw.add(20);
      const std::int32_t again = prompt(rng);
      for (int l = 0; l < L; ++l) {
        tw.append(rng, {20}, l, {again});
        prev[static_cast<std::size_t>(l)] = tw.prefetch(rng, batch, l, 2);
      }
    }
    if (step == 5) {
      tw.cpu_cache.fork(10, 30);
      tw.gpu_cache.fork(10, 30);
      batch.push_back(30);
    }
    if (step == 6) {
      // Roll back drafts of sequence 10 (inside its tail block and across a block edge).
      const std::int64_t keep = tw.cpu_cache.sequence_length(10, 0) - (fetch_ratio < 0.1 ? 3 : 19);
      tw.cpu_cache.truncate(10, keep);
      tw.gpu_cache.truncate(10, keep);
      for (int l = 0; l < L; ++l) {
        CHECK_THROWS_WITH_AS(tw.gpu_cache.acquire(prev[static_cast<std::size_t>(l)].second), doctest::Contains("truncated"), Error);
        prev[static_cast<std::size_t>(l)] = tw.prefetch(rng, batch, l, 1);
      }
    }
    for (int l = 0; l < L; ++l) {
      INFO("layer " << l);
      tw.append(rng, batch, l, std::vector<std::int32_t>(batch.size(), 1));
      const auto next = tw.prefetch(rng, batch, l, 2);
      tw.attend(rng, prev[static_cast<std::size_t>(l)]);
      prev[static_cast<std::size_t>(l)] = next;
    }
  }
  // The device summaries equal the CPU's, bit for bit, for every block held.
  {
    const auto& Ly = tw.cpu_cache.layout();
    const auto dev = download(tw.gpu_cache.backend().summaries(), static_cast<std::size_t>(Ly.summary_floats), tw.s());
    for (SeqId id : batch) {
      const int slot = tw.cpu_cache.block_table().find(id);
      for (int l = 0; l < L; ++l) {
        for (int h = 0; h < Ly.num_kv_heads(); ++h) {
          for (std::int64_t b = 0; b < Ly.blocks_for(tw.cpu_cache.sequence_length(id, l)); ++b) {
            CHECK(std::memcmp(dev.data() + Ly.summary_offset(slot, l, h, b), tw.cpu_cache.backend().summaries().block(slot, l, h, b),
                              sizeof(float) * 2 * static_cast<std::size_t>(Ly.head_dim())) == 0);
          }
        }
      }
    }
  }
  // Under the runs scorer, the run key sums too: every run that holds a row.
  if (scorer == BlockScore::runs) {
    const auto& Ly = tw.cpu_cache.layout();
    REQUIRE(Ly.run_floats > 0);
    const auto dev = download(tw.gpu_cache.backend().run_sums(), static_cast<std::size_t>(Ly.run_floats), tw.s());
    const std::size_t run_bytes = sizeof(float) * static_cast<std::size_t>(Ly.head_dim());
    std::size_t compared = 0;
    for (SeqId id : batch) {
      const int slot = tw.cpu_cache.block_table().find(id);
      for (int l = 0; l < L; ++l) {
        const std::int64_t len = tw.cpu_cache.sequence_length(id, l);
        for (int h = 0; h < Ly.num_kv_heads(); ++h) {
          for (std::int64_t b = 0; b < Ly.blocks_for(len); ++b) {
            const std::int64_t rows = std::min<std::int64_t>(Ly.block_tokens(), len - b * Ly.block_tokens());
            for (std::int64_t r = 0; r * run_tokens < rows; ++r, ++compared) {
              INFO("sequence " << id << ", layer " << l << ", kv head " << h << ", block " << b << ", run " << r);
              CHECK(std::memcmp(dev.data() + Ly.run_offset(slot, l, h, b) + r * Ly.head_dim(),
                                tw.cpu_cache.backend().summaries().runs(slot, l, h, b) + r * Ly.head_dim(), run_bytes) == 0);
            }
          }
        }
      }
    }
    CHECK(compared > 0);
  }
  tw.with_queries(rng, 2, [&](RowsView hq, RowsView dq) {
    CHECK(tw.cpu_cache.select_blocks(10, 1, hq) == tw.gpu_cache.select_blocks(10, 1, dq));
    return 0;
  });
  check_same_statistics(tw.cpu_cache.statistics(), tw.gpu_cache.statistics());
  const auto total = tw.gpu_cache.statistics().total();
  CHECK(total.blocks_fetched > 0);
  if (fetch_ratio < 0.1) CHECK(total.admits_capped > 0);
  tw.gpu_cache.synchronize();
  REQUIRE(tw.cpu_cache.host_tier().bytes_reserved() == tw.gpu_cache.host_tier().bytes_reserved());
  CHECK(std::memcmp(tw.cpu_cache.host_tier().base(), tw.gpu_cache.host_tier().base(), tw.gpu_cache.host_tier().bytes_reserved()) == 0);
  // One pool, one map: the same blocks held, and the device mirror equal to the host map.
  const auto& cpool = tw.cpu_cache.host_tier().pool();
  const auto& gpool = tw.gpu_cache.host_tier().pool();
  CHECK(cpool.blocks_in_use() == gpool.blocks_in_use());
  CHECK(std::equal(cpool.map().begin(), cpool.map().end(), gpool.map().begin()));
  const auto dmap = download(tw.gpu_cache.backend().device_block_map(), gpool.map().size(), tw.s());
  for (SeqId id : batch) {
    const int slot = tw.gpu_cache.block_table().find(id);
    for (std::int64_t b = 0; b < gpool.mapped_blocks(slot); ++b) {
      CHECK(dmap[static_cast<std::size_t>(tw.gpu_cache.layout().block_map_index(slot, b))] == gpool.at(slot, b));
    }
  }
}

template <KvElement T>
void run_twins() {
  if (std::getenv("OASISKV_CUDA_TEST_QUICK") != nullptr) {  // scripts/gpu-check under compute-sanitizer
    run_twin<T>(GroupReduction::sum, 0.05);
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

// Budgets by layer and kv head: per-head slot runs, top-K and fetch caps (one head with no
// selectable slot at all, one with more than the uniform budget) give the same views, slot
// contents, statistics and selections as Cache<cpu> with the same profile.
OASISKV_CUDA_TEST_CASE("cuda Cache<cuda> with a budget profile equals Cache<cpu> with it") {
  const CacheConfig c = twin_config(GroupReduction::sum, 1.0);  // 16 blocks a head: 4 pinned, 12 selectable
  const BudgetProfile uneven(2, 2, 16, {24, 8, 12, 20});
  const BudgetProfile starved(2, 2, 16, {4, 28, 16, 16});
  const BudgetProfile dense_first = BudgetProfile::first_layers_dense(c, 1, 300);
  for (const BudgetProfile* p : {&uneven, &starved, &dense_first}) {
    REQUIRE_FALSE(p->uniform());
    run_twin<float>(GroupReduction::sum, 1.0, p);
    run_twin<fp16_t>(GroupReduction::max, 0.05, p);
  }
}

// The runs scorer (run key sums folded on append, refolded on truncate, copied on fork; its own
// scoring kernel): the same views, slot contents, statistics, selections and run sums as the CPU.
OASISKV_CUDA_TEST_CASE("cuda Cache<cuda> with scorer runs equals Cache<cpu> with it") {
  run_twin<float>(GroupReduction::max, 1.0, nullptr, BlockScore::runs);
  run_twin<fp16_t>(GroupReduction::sum, 0.05, nullptr, BlockScore::runs);
  run_twin<bf16_t>(GroupReduction::max, 1.0, nullptr, BlockScore::runs, 1);  // 16 runs a block
  run_twin<float>(GroupReduction::sum, 1.0, nullptr, BlockScore::runs, 16);  // one run: the mean key
}

// softmax_sum: CUDA's expf is not glibc's, so scores match to a few ulp and a near tie may pick
// another block. Every view must still hold exactly the host rows it names, and the selections
// agree on nearly every block.
// (Quest's summaries and the runs scorer's run sums.)
namespace {
void run_softmax_twin(BlockScore scorer) {
  OASISKV_SEEDED_RNG(rng);
  INFO("scorer " << block_score_name(scorer));
  Twin<float> tw(twin_config(GroupReduction::softmax_sum, 1.0, scorer));
  const std::vector<SeqId> batch{1, 2};
  tw.add(1);
  tw.add(2);
  std::size_t same = 0, all = 0;
  for (int l = 0; l < 2; ++l) tw.append(rng, batch, l, {700, 1200});
  for (int round = 0; round < 6; ++round) {
    for (int l = 0; l < 2; ++l) {
      const auto t = tw.prefetch(rng, batch, l, 3);
      const LayerView<float> cv = tw.cpu_cache.acquire(t.first);
      const LayerView<float> gv = tw.gpu_cache.acquire(t.second);
      const HostView want = host_view(cv), got = fetch_view(gv, tw.s());
      check_slot_contents(tw.cpu_cache, tw.gpu_cache, gv, got, tw.s());
      const std::set<std::int32_t> a(want.block.begin(), want.block.end());
      for (std::size_t p = 0; p + 1 < got.indptr.size(); ++p) {
        std::set<std::int32_t> x(want.block.begin() + want.indptr[p], want.block.begin() + want.indptr[p + 1]);
        for (std::int32_t e = got.indptr[p]; e < got.indptr[p + 1]; ++e) same += x.count(got.block[static_cast<std::size_t>(e)]);
        all += x.size();
      }
      tw.cpu_cache.release(t.first);
      tw.gpu_cache.release(t.second);
      tw.append(rng, batch, l, {1, 1});
    }
  }
  INFO(same << " of " << all << " blocks agree");
  CHECK(static_cast<double>(same) >= 0.98 * static_cast<double>(all));
}
}  // namespace

OASISKV_CUDA_TEST_CASE("cuda Cache<cuda> with softmax_sum: views hold the host rows and match the CPU selections") {
  run_softmax_twin(BlockScore::quest);
  run_softmax_twin(BlockScore::runs);
}

// The ticket lifecycle with 3 tickets per layer: supersede, dead tickets whose gathers still wait
// for their gate, remove and re-add while plans are in flight.
OASISKV_CUDA_TEST_CASE("cuda Cache<cuda> ticket lifecycle equals Cache<cpu>: supersede, dead tickets, remove in flight") {
  OASISKV_SEEDED_RNG(rng);
  Twin<fp16_t> tw(twin_config(GroupReduction::sum, 0.05), CudaOptions{.tickets_per_layer = 3});
  const std::vector<SeqId> batch{1, 2, 3};
  for (SeqId id : batch) tw.add(id);
  for (int l = 0; l < 2; ++l) tw.append(rng, batch, l, {500, 800, 300});
  for (int round = 0; round < 5; ++round) {
    INFO("round " << round);
    // Three outstanding tickets at layer 0; the newest is acquired, the older two die with their
    // gathers pending behind the first's gate.
    auto t1 = tw.prefetch(rng, batch, 0, 1);
    auto t2 = tw.prefetch(rng, {1, 2}, 0, 2);
    auto t3 = tw.prefetch(rng, batch, 0, 1);
    auto q = tw.template rows<float>(rng, 3, tw.q_width());
    CHECK_THROWS_WITH_AS(tw.gpu_cache.prefetch(batch, 0, q.device_view()), doctest::Contains("already has 3 outstanding tickets"),
                         Error);
    tw.attend(rng, t3);
    CHECK_THROWS_WITH_AS(tw.gpu_cache.acquire(t1.second), doctest::Contains("superseded"), Error);
    CHECK_THROWS_WITH_AS(tw.gpu_cache.acquire(t2.second), doctest::Contains("superseded"), Error);
    // Remove sequence 3 while a plan of it is in flight at layer 1, re-add it, and go on.
    auto t4 = tw.prefetch(rng, batch, 1, 1);
    tw.remove(3);
    CHECK_THROWS_WITH_AS(tw.gpu_cache.acquire(t4.second), doctest::Contains("sequence 3 was removed"), Error);
    tw.add(3);
    for (int l = 0; l < 2; ++l) tw.append(rng, {3}, l, {std::uniform_int_distribution<std::int32_t>(50, 600)(rng)});
    tw.attend(rng, tw.prefetch(rng, batch, 1, 2));
    for (int l = 0; l < 2; ++l) tw.append(rng, batch, l, {1, 1, 1});
  }
  check_same_statistics(tw.cpu_cache.statistics(), tw.gpu_cache.statistics());
}

// The decode protocol with no synchronisation between calls: every prefetch and release is
// preceded by a delay on the copy stream, every attention by one on the compute stream, and the
// engine overwrites its single k, v and lookahead-query buffers on the compute stream right after
// each call. Views and attention outputs are snapshotted on the device and read once at the end.
OASISKV_CUDA_TEST_CASE("cuda Cache<cuda> overlapped decode without per-call syncs equals Cache<cpu>") {
  OASISKV_SEEDED_RNG(rng);
  using T = fp16_t;
  CacheConfig c = twin_config(GroupReduction::sum, 0.05);
  Twin<T> tw(c);
  const std::vector<SeqId> batch{1, 2, 3};
  const int B = 3, L = c.shape.num_layers, R = 2, nq = c.shape.num_q_heads, d = c.shape.head_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (SeqId id : batch) tw.add(id);
  for (int l = 0; l < L; ++l) tw.append(rng, batch, l, {400, 700, 999});
  tw.gpu_cache.synchronize();
  const auto kv_elems = static_cast<std::size_t>(B * tw.row_width());
  const auto q_elems = static_cast<std::size_t>(B * R * tw.q_width());
  gpu::DeviceBuffer<T> k_buf(kv_elems), v_buf(kv_elems);
  gpu::DeviceBuffer<float> q_buf(q_elems), qa_buf(static_cast<std::size_t>(B * tw.q_width()));
  const cudaStream_t cs = tw.s(), xs = tw.gpu_cache.backend().copy_stream();
  // Sources of the engine's overwrites are pinned (a pageable source may make the copy wait for
  // the stream, which would hide the races this test looks for), each kept until the end.
  std::vector<void*> pinned;
  auto overwrite = [&](auto& buf, const auto& host) {
    void* p = nullptr;
    const std::size_t bytes = host.size() * sizeof(host[0]);
    OASISKV_CUDA_CHECK(cudaMallocHost(&p, bytes));
    pinned.push_back(p);
    std::memcpy(p, host.data(), bytes);
    OASISKV_CUDA_CHECK(cudaMemcpyAsync(buf.data(), p, bytes, cudaMemcpyHostToDevice, cs));
  };
  struct Snapshot {
    HostView cpu;
    std::vector<float> cpu_out;
    std::unique_ptr<gpu::DeviceBuffer<std::int32_t>> indptr, block, slot;
    std::unique_ptr<gpu::DeviceBuffer<float>> out;
    int pairs = 0;
  };
  std::vector<Snapshot> snaps;
  std::vector<std::pair<Ticket, Ticket>> prev(static_cast<std::size_t>(L));
  auto queries = [&](std::size_t n) { return test::random_rows<float>(rng, n, 2.0f); };
  for (int l = 0; l < L; ++l) {
    const auto q = queries(q_elems);
    overwrite(q_buf, q);
    delay_stream(xs);
    prev[static_cast<std::size_t>(l)] = {tw.cpu_cache.prefetch(batch, l, RowsView{q.data(), DType::f32, B * R}),
                                         tw.gpu_cache.prefetch(batch, l, RowsView{q_buf.data(), DType::f32, B * R})};
    overwrite(q_buf, queries(q_elems));  // garbage for the cache: it must have staged its copy
  }
  for (int step = 0; step < 6; ++step) {
    for (int l = 0; l < L; ++l) {
      const auto ul = static_cast<std::size_t>(l);
      const auto k = test::random_rows<T>(rng, kv_elems), v = test::random_rows<T>(rng, kv_elems);
      overwrite(k_buf, k);
      overwrite(v_buf, v);
      tw.cpu_cache.append(batch, l, RowsView{k.data(), dtype_of_v<T>, B}, RowsView{v.data(), dtype_of_v<T>, B});
      tw.gpu_cache.append(batch, l, RowsView{k_buf.data(), dtype_of_v<T>, B}, RowsView{v_buf.data(), dtype_of_v<T>, B});
      const auto q = queries(q_elems);
      overwrite(q_buf, q);
      delay_stream(xs);
      const std::pair<Ticket, Ticket> next{tw.cpu_cache.prefetch(batch, l, RowsView{q.data(), DType::f32, B * R}),
                                           tw.gpu_cache.prefetch(batch, l, RowsView{q_buf.data(), DType::f32, B * R})};
      overwrite(q_buf, queries(q_elems));
      overwrite(k_buf, test::random_rows<T>(rng, kv_elems));
      const auto qa = queries(static_cast<std::size_t>(B * tw.q_width()));
      overwrite(qa_buf, qa);
      Snapshot snap;
      const LayerView<T> cv = tw.cpu_cache.acquire(prev[ul].first);
      snap.cpu = host_view(cv);
      snap.cpu_out.resize(qa.size());
      sparse_attention_reference(cv, nq, scale, qa.data(), snap.cpu_out.data());
      tw.cpu_cache.release(prev[ul].first);
      const LayerView<T> gv = tw.gpu_cache.acquire(prev[ul].second);
      delay_stream(cs);
      snap.pairs = gv.num_pairs();
      const auto entries = static_cast<std::size_t>(gv.num_pairs()) * static_cast<std::size_t>(tw.gpu_cache.layout().budget_blocks);
      snap.indptr = std::make_unique<gpu::DeviceBuffer<std::int32_t>>(static_cast<std::size_t>(snap.pairs) + 1);
      snap.block = std::make_unique<gpu::DeviceBuffer<std::int32_t>>(entries);
      snap.slot = std::make_unique<gpu::DeviceBuffer<std::int32_t>>(entries);
      snap.out = std::make_unique<gpu::DeviceBuffer<float>>(qa.size());
      gpu::reference::sparse_attention<T>(gv, nq, scale, qa_buf.data(), snap.out->data(), cs);
      OASISKV_CUDA_CHECK(cudaMemcpyAsync(snap.indptr->data(), gv.indptr, snap.indptr->bytes(), cudaMemcpyDeviceToDevice, cs));
      OASISKV_CUDA_CHECK(cudaMemcpyAsync(snap.block->data(), gv.block, snap.block->bytes(), cudaMemcpyDeviceToDevice, cs));
      OASISKV_CUDA_CHECK(cudaMemcpyAsync(snap.slot->data(), gv.slot, snap.slot->bytes(), cudaMemcpyDeviceToDevice, cs));
      delay_stream(xs);
      tw.gpu_cache.release(prev[ul].second);
      prev[ul] = next;
      snaps.push_back(std::move(snap));
    }
  }
  tw.gpu_cache.synchronize();
  for (std::size_t i = 0; i < snaps.size(); ++i) {
    INFO("step " << i / static_cast<std::size_t>(L) << ", layer " << i % static_cast<std::size_t>(L));
    const Snapshot& sn = snaps[i];
    const auto indptr = download(*sn.indptr, cs);
    REQUIRE(indptr == sn.cpu.indptr);
    const auto n = static_cast<std::size_t>(indptr.back());
    CHECK(download(sn.block->data(), n, cs) == sn.cpu.block);
    CHECK(download(sn.slot->data(), n, cs) == sn.cpu.slot);
    check_close(download(*sn.out, cs), sn.cpu_out, attention_tolerance<T>());
  }
  check_same_statistics(tw.cpu_cache.statistics(), tw.gpu_cache.statistics());
  for (void* p : pinned) OASISKV_CUDA_CHECK(cudaFreeHost(p));
}

// A large geometry: budget 8,192 tokens, head_dim 256, GQA group 8, 4 query rows, 16K-token
// prompts, fetch ratio 0.05.
OASISKV_CUDA_TEST_CASE("cuda Cache<cuda> at a large geometry equals Cache<cpu>") {
  OASISKV_SEEDED_RNG(rng);
  CacheConfig c;
  c.shape = ModelShape{2, 16, 2, 256};
  c.budget_tokens = 8192;
  c.fetch_ratio = 0.05;
  c.max_sequences = 2;
  c.max_tokens_per_sequence = 16384 + 64;
  Twin<bf16_t> tw(c);
  const std::vector<SeqId> batch{1, 2};
  tw.add(1);
  tw.add(2);
  std::vector<std::pair<Ticket, Ticket>> prev(2);
  for (int l = 0; l < 2; ++l) {
    tw.append(rng, batch, l, {16384, 12000});
    prev[static_cast<std::size_t>(l)] = tw.prefetch(rng, batch, l, 4);
  }
  for (int step = 0; step < 3; ++step) {
    for (int l = 0; l < 2; ++l) {
      tw.append(rng, batch, l, {1, 1});
      const auto next = tw.prefetch(rng, batch, l, 4);
      tw.attend(rng, prev[static_cast<std::size_t>(l)]);
      prev[static_cast<std::size_t>(l)] = next;
    }
  }
  check_same_statistics(tw.cpu_cache.statistics(), tw.gpu_cache.statistics());
  CHECK(tw.gpu_cache.statistics().total().admits_capped > 0);
}

OASISKV_CUDA_TEST_CASE("cuda Cache<cuda> refuses what only the CUDA backend refuses, and is unchanged") {
  OASISKV_SEEDED_RNG(rng);
  CacheConfig c = test::small_config(/*budget*/ 96, /*capacity*/ 256, /*sequences*/ 3);
  gpu::Stream stream;
  Cache<cuda, float> cache(c, CudaOptions{.compute_stream = stream.get()});
  const int Hk = c.shape.num_kv_heads, Hq = c.shape.num_q_heads, d = c.shape.head_dim;
  cache.add_sequence(1);
  cache.add_sequence(2);
  const std::vector<SeqId> both{1, 2}, s1{1}, s2{2};
  auto k80 = make_rows<float>(rng, 80, Hk * d, stream.get());
  for (int l = 0; l < 2; ++l) cache.append(both, l, std::vector<std::int32_t>{40, 40}, k80.device_view(), k80.device_view());
  auto q2 = make_rows<float>(rng, 2, Hq * d, stream.get());
  auto q1 = make_rows<float>(rng, 1, Hq * d, stream.get());
  auto q10 = make_rows<float>(rng, 10, Hq * d, stream.get());
  auto two = make_rows<float>(rng, 2, Hk * d, stream.get());
  (void)cache.prefetch(both, 1, q2.device_view());
  (void)cache.prefetch(s1, 1, q1.device_view());
  std::vector<float> pageable(static_cast<std::size_t>(2 * Hk * d), 1.0f);
  struct Case {
    const char* name;
    std::function<void()> call;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"append pageable host memory", [&] { cache.append(both, 1, RowsView{pageable.data(), DType::f32, 2}, two.device_view()); }, "is pageable host memory"},
      {"prefetch more rows than max_query_rows", [&] { cache.prefetch(both, 0, q10.device_view()); }, "more than this backend's max_query_rows = 4"},
      {"prefetch a third outstanding ticket", [&] { cache.prefetch(s2, 1, q1.device_view()); }, "already has 2 outstanding tickets"},
  };
  for (const auto& k : cases) {
    CAPTURE(k.name);
    const std::uint64_t before = test::cache_fingerprint(cache, {1, 2});
    CHECK_THROWS_WITH_AS(k.call(), doctest::Contains(k.message), Error);
    CHECK(test::cache_fingerprint(cache, {1, 2}) == before);
  }
  CHECK_THROWS_WITH_AS((Cache<cuda, float>(c, CudaOptions{.max_query_rows = 0})), doctest::Contains("max_query_rows must be positive, got 0"), Error);
  CHECK_THROWS_WITH_AS((Cache<cuda, float>(c, CudaOptions{.tickets_per_layer = -1})), doctest::Contains("tickets_per_layer must be positive, got -1"), Error);
  // Budgets by layer and kv head: a uniform profile is the plain cache; a non-uniform one packs
  // the heads' slots (the twin test above runs it).
  CHECK(Cache<cuda, float>(c, BudgetProfile(2, 2, 16, {8, 4, 6, 6})).layout().profiled());
  CHECK_FALSE(Cache<cuda, float>(c, BudgetProfile::uniform(c)).layout().profiled());
  // Host-side calls are refused during stream capture; decode calls are not.
  cache.join();
  cudaGraph_t g = nullptr;
  OASISKV_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal));
  CHECK_THROWS_WITH_AS(cache.add_sequence(3), doctest::Contains("not allowed while the compute stream is being captured"), Error);
  CHECK_THROWS_WITH_AS((void)cache.statistics(), doctest::Contains("not allowed while"), Error);
  CHECK_THROWS_WITH_AS(cache.synchronize(), doctest::Contains("not allowed while"), Error);
  CHECK_THROWS_WITH_AS((void)cache.select_blocks(1, 0, q1.device_view()), doctest::Contains("not allowed while"), Error);
  cache.append(s1, 0, RowsView{two.device->data(), DType::f32, 1}, RowsView{two.device->data(), DType::f32, 1});
  cache.join();
  OASISKV_CUDA_CHECK(cudaStreamEndCapture(stream.get(), &g));
  OASISKV_CUDA_CHECK(cudaGraphDestroy(g));
  cache.abandon_capture();  // the captured append never ran
  CHECK(cache.sequence_length(1, 0) == 40);
}

// The cache records its device and sets it in every call: calls made while another device is
// current still work on the cache's device, and inputs on another device are refused.
OASISKV_CUDA_TEST_CASE("cuda Cache<cuda> works on its own device whatever device is current") {
  if (gpu::device_count() < 2) {
    MESSAGE("one CUDA device: the cross-device half of this test needs two");
  }
  OASISKV_SEEDED_RNG(rng);
  OASISKV_CUDA_CHECK(cudaSetDevice(0));
  Twin<float> tw(twin_config(GroupReduction::sum, 1.0));
  CHECK(tw.gpu_cache.backend().device() == 0);
  const std::vector<SeqId> batch{1};
  tw.add(1);
  tw.append(rng, batch, 0, {500});
  const auto t = tw.prefetch(rng, batch, 0, 1);
  if (gpu::device_count() >= 2) {
    OASISKV_CUDA_CHECK(cudaSetDevice(1));
    tw.attend(rng, t);  // inputs were allocated on device 0; the cache switches for each call
    int current = -1;
    OASISKV_CUDA_CHECK(cudaGetDevice(&current));
    CHECK(current == 1);  // and restores the caller's device
    gpu::DeviceBuffer<float> other(static_cast<std::size_t>(tw.row_width()));
    CHECK_THROWS_WITH_AS(tw.gpu_cache.append(batch, 0, RowsView{other.data(), DType::f32, 1}, RowsView{other.data(), DType::f32, 1}),
                         doctest::Contains("is memory of device 1, but this cache lives on device 0"), Error);
    OASISKV_CUDA_CHECK(cudaSetDevice(0));
  } else {
    tw.attend(rng, t);
  }
}

}  // namespace oasiskv::gpu_test
