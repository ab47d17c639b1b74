// Every kernel of the CUDA backend against the CPU backend, on fresh seeded random inputs (the seed
// is printed on failure; OASISKV_TEST_SEED=N reproduces a run).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "cuda/fixture.hpp"
#include "support.hpp"

namespace oasiskv::gpu_test {
namespace {

constexpr GroupReduction kReductions[] = {GroupReduction::max, GroupReduction::sum, GroupReduction::softmax_sum};

// Lookahead queries of kv head h's group for batch entry i, as Cache<cpu>::gather_queries.
std::vector<float> group_queries(const CacheLayout& L, const std::vector<float>& q, int i, int rows, int h) {
  const int G = L.group_size, d = L.config.shape.head_dim, nq = L.config.shape.num_q_heads;
  std::vector<float> out;
  for (int r = 0; r < rows; ++r) {
    const std::int64_t row = static_cast<std::int64_t>(i) * rows + r;
    for (int g = 0; g < G; ++g) {
      const std::int64_t base = (row * nq + h * G + g) * d;
      out.insert(out.end(), q.begin() + base, q.begin() + base + d);
    }
  }
  return out;
}

struct Selection {
  std::vector<std::int32_t> selected, count;
};

// Runs scoring, top-K and planning for every sequence of a Twin at `layer`, on both backends, and
// checks that scores, selections, plans, residency and copied slots agree.
template <KvElement T>
void check_prefetch_step(Twin<T>& tw, std::mt19937_64& rng, int layer, std::int64_t step,
                         std::vector<std::int32_t>& res_block, std::vector<std::int64_t>& res_last,
                         gpu::DeviceBuffer<std::int32_t>& gres_block, gpu::DeviceBuffer<std::int64_t>& gres_last,
                         cudaStream_t stream) {
  const CacheLayout& L = tw.L;
  const int B = L.config.max_sequences, H = L.config.shape.num_kv_heads, d = L.config.shape.head_dim;
  const int nq = L.config.shape.num_q_heads, K = L.selectable_blocks, S = K;
  const int rows = 1 + static_cast<int>(rng() % 2);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> q(static_cast<std::size_t>(B * rows * nq * d));
  for (auto& x : q) x = dist(rng);

  std::vector<std::int32_t> slots(static_cast<std::size_t>(B));
  std::iota(slots.begin(), slots.end(), 0);
  std::vector<std::int64_t> lens, steps(static_cast<std::size_t>(B), step);
  for (int s = 0; s < B; ++s) lens.push_back(tw.length(s, layer));
  auto dslot = upload(slots);
  auto dlen = upload(lens);
  auto dsteps = upload(steps);
  auto dq = upload(q);
  const gpu::DeviceBatch batch{B, dslot.data(), dlen.data()};
  const int pairs = B * H;
  const int stride = static_cast<int>(L.max_blocks);
  const int Q = rows * L.group_size;
  gpu::DeviceBuffer<float> scores(static_cast<std::size_t>(pairs) * stride);
  gpu::DeviceBuffer<float> bounds(static_cast<std::size_t>(pairs) * Q * stride);
  gpu::DeviceBuffer<std::int32_t> count(static_cast<std::size_t>(pairs)), first(static_cast<std::size_t>(pairs));
  gpu::score_blocks<float>(tw.g, layer, batch, dq.data(), rows, tw.gsumm.data(),
                           gpu::ScoreBuffers{scores.data(), count.data(), first.data(), bounds.data(), stride}, stream);
  gpu::DeviceBuffer<std::int32_t> sel(static_cast<std::size_t>(pairs * K)), sel_count(static_cast<std::size_t>(pairs));
  gpu::segmented_top_k(scores.data(), stride, count.data(), first.data(), pairs, K, sel.data(), sel_count.data(), stream);
  OASISKV_CUDA_CHECK(cudaStreamSynchronize(stream));

  const auto g_scores = download(scores, scores.size());
  const auto g_count = download(count, count.size());
  const auto g_first = download(first, first.size());
  auto g_sel = download(sel, sel.size());
  auto g_sel_count = download(sel_count, sel_count.size());

  // CPU scores, then GPU top-K of the CPU scores: the selection must be identical whatever the
  // reduction ("given the same scores, the same blocks").
  std::vector<float> cpu_scores_flat(static_cast<std::size_t>(pairs) * stride, 0.0f);
  LookaheadSelector selector(L);
  std::vector<std::vector<std::int32_t>> cpu_sel(static_cast<std::size_t>(pairs));
  for (int i = 0; i < B; ++i) {
    const std::int64_t len = lens[static_cast<std::size_t>(i)];
    const std::int64_t firstb = L.sink_blocks;
    const std::int64_t last = std::min(L.blocks_for(len), L.ring_start(len + 1));
    for (int h = 0; h < H; ++h) {
      const int p = i * H + h;
      const auto qs = group_queries(L, q, i, rows, h);
      std::vector<float> sc;
      selector.score(tw.summ, i, layer, h, firstb, std::max(firstb, last), qs.data(), Q, sc);
      REQUIRE(g_count[static_cast<std::size_t>(p)] == static_cast<std::int32_t>(sc.size()));
      REQUIRE(g_first[static_cast<std::size_t>(p)] == firstb);
      for (std::size_t j = 0; j < sc.size(); ++j) {
        const float gs = g_scores[static_cast<std::size_t>(p) * stride + j];
        if (L.config.reduction == GroupReduction::softmax_sum) {
          CHECK(std::fabs(gs - sc[j]) <= 1e-5f * std::max(1.0f, std::fabs(sc[j])));
        } else {
          CHECK(gs == sc[j]);  // bit-identical arithmetic
        }
        cpu_scores_flat[static_cast<std::size_t>(p) * stride + j] = sc[j];
      }
      LookaheadSelector::top_k(sc, firstb, K, cpu_sel[static_cast<std::size_t>(p)]);
      if (L.config.reduction != GroupReduction::softmax_sum) {
        const auto& cs = cpu_sel[static_cast<std::size_t>(p)];
        REQUIRE(g_sel_count[static_cast<std::size_t>(p)] == static_cast<std::int32_t>(cs.size()));
        CHECK(std::equal(cs.begin(), cs.end(), g_sel.begin() + static_cast<std::ptrdiff_t>(p) * K));
      }
    }
  }
  auto dcpu_scores = upload(cpu_scores_flat);
  gpu::segmented_top_k(dcpu_scores.data(), stride, count.data(), first.data(), pairs, K, sel.data(), sel_count.data(),
                       stream);
  OASISKV_CUDA_CHECK(cudaStreamSynchronize(stream));
  g_sel = download(sel, sel.size());
  g_sel_count = download(sel_count, sel_count.size());
  for (int p = 0; p < pairs; ++p) {
    const auto& cs = cpu_sel[static_cast<std::size_t>(p)];
    REQUIRE(g_sel_count[static_cast<std::size_t>(p)] == static_cast<std::int32_t>(cs.size()));
    CHECK(std::equal(cs.begin(), cs.end(), g_sel.begin() + static_cast<std::ptrdiff_t>(p) * K));
  }

  // Plans from the (identical) selections, then the gather of the admitted blocks.
  const int cap = tw.g.admit_stride;
  gpu::DeviceBuffer<gpu::DeviceAdmit> admits(static_cast<std::size_t>(pairs * cap));
  gpu::DeviceBuffer<std::int32_t> admit_count(static_cast<std::size_t>(pairs)), kept(static_cast<std::size_t>(pairs * K)),
      kept_count(static_cast<std::size_t>(pairs)), capped(static_cast<std::size_t>(pairs));
  gpu::plan_transfers(tw.g, layer, batch, dsteps.data(), sel.data(), sel_count.data(), K, gres_block.data(),
                      gres_last.data(),
                      gpu::PlanBuffers{admits.data(), admit_count.data(), kept.data(), kept_count.data(), capped.data()},
                      stream);
  gpu::gather_admits<T>(tw.g, layer, batch, admits.data(), admit_count.data(), tw.ghost.device_base(),
                        tw.gdev.layer_pool(layer), stream);
  OASISKV_CUDA_CHECK(cudaStreamSynchronize(stream));
  const auto g_admits = download(admits, admits.size());
  const auto g_admit_count = download(admit_count, admit_count.size());
  const auto g_kept = download(kept, kept.size());
  const auto g_kept_count = download(kept_count, kept_count.size());
  const auto g_capped = download(capped, capped.size());

  TransferPlanner planner;
  TransferPlan plan;
  for (int i = 0; i < B; ++i) {
    for (int h = 0; h < H; ++h) {
      const int p = i * H + h;
      const std::size_t off = static_cast<std::size_t>(tw.g.head_index(i, layer, h) * S);
      const SlotResidency res{std::span(res_block).subspan(off, static_cast<std::size_t>(S)),
                              std::span(res_last).subspan(off, static_cast<std::size_t>(S))};
      planner.plan(cpu_sel[static_cast<std::size_t>(p)], res, L.admit_cap(step), step, plan);
      apply(plan, res);
      REQUIRE(g_admit_count[static_cast<std::size_t>(p)] == static_cast<std::int32_t>(plan.admits.size()));
      for (std::size_t a = 0; a < plan.admits.size(); ++a) {
        const auto& ga = g_admits[static_cast<std::size_t>(p * cap) + a];
        CHECK(ga.block == plan.admits[a].block);
        CHECK(ga.slot == plan.admits[a].slot);
        CHECK(ga.evicted == plan.admits[a].evicted);
        // The CPU copy engine's copy (Cache<cpu>::prefetch).
        std::memcpy(tw.dev.slot(layer, tw.dev.slot_id(i, h, L.sink_blocks + L.ring_blocks + plan.admits[a].slot)),
                    tw.host.block(i, layer, h, plan.admits[a].block),
                    static_cast<std::size_t>(L.block_elems) * sizeof(T));
      }
      REQUIRE(g_kept_count[static_cast<std::size_t>(p)] == static_cast<std::int32_t>(plan.kept_slots.size()));
      CHECK(std::equal(plan.kept_slots.begin(), plan.kept_slots.end(), g_kept.begin() + static_cast<std::ptrdiff_t>(p) * K));
      CHECK(g_capped[static_cast<std::size_t>(p)] == plan.capped);
    }
  }
  CHECK(download(gres_block, gres_block.size()) == res_block);
  CHECK(download(gres_last, gres_last.size()) == res_last);
  tw.check_equal_state();  // copied slots included
}

template <KvElement T>
void run_pipeline_test() {
  OASISKV_SEEDED_RNG(rng);
  for (GroupReduction reduction : kReductions) {
    INFO("reduction = " << reduction_name(reduction));
    const CacheConfig config = test_config(rng, reduction);
    INFO("kv heads " << config.shape.num_kv_heads << ", q heads " << config.shape.num_q_heads << ", head_dim "
                     << config.shape.head_dim << ", budget " << config.budget_tokens << ", fetch_ratio "
                     << config.fetch_ratio);
    Twin<T> tw(config);
    gpu::Stream stream;
    const int B = config.max_sequences, S = tw.L.selectable_blocks;
    const std::size_t res_n = static_cast<std::size_t>(B * config.shape.num_layers * config.shape.num_kv_heads * S);
    std::vector<std::int32_t> res_block(res_n, kNoBlock);
    std::vector<std::int64_t> res_last(res_n, -1);
    auto gres_block = upload(res_block);
    auto gres_last = upload(res_last);
    // Prefill of different lengths, then decode steps with a plan each.
    for (int layer = 0; layer < config.shape.num_layers; ++layer) {
      std::vector<int> rows;
      for (int s = 0; s < B; ++s) rows.push_back(static_cast<int>(rng() % 600));
      tw.append(rng, {0, 1, 2}, layer, rows, stream);
    }
    tw.check_equal_state();
    for (int step = 0; step < 4; ++step) {
      for (int layer = 0; layer < config.shape.num_layers; ++layer) {
        tw.append(rng, {0, 1, 2}, layer, {1, 1 + static_cast<int>(rng() % 3), 1}, stream);
        check_prefetch_step(tw, rng, layer, step, res_block, res_last, gres_block, gres_last, stream);
      }
    }
  }
}

}  // namespace

OASISKV_CUDA_TEST_CASE("cuda append summaries scoring top-K planning and gather match the CPU backend (float)") {
  run_pipeline_test<float>();
}
OASISKV_CUDA_TEST_CASE("cuda append summaries scoring top-K planning and gather match the CPU backend (fp16)") {
  run_pipeline_test<fp16_t>();
}
OASISKV_CUDA_TEST_CASE("cuda append summaries scoring top-K planning and gather match the CPU backend (bf16)") {
  run_pipeline_test<bf16_t>();
}

OASISKV_CUDA_TEST_CASE("cuda segmented top-K matches LookaheadSelector::top_k with ties and signed zeros") {
  OASISKV_SEEDED_RNG(rng);
  gpu::Stream stream;
  for (int round = 0; round < 6; ++round) {
    const int segments = 1 + static_cast<int>(rng() % 40);
    const int stride = round == 0 ? 8192 : 1 + static_cast<int>(rng() % 3000);
    const int k = 1 + static_cast<int>(rng() % std::min(stride + 10, 600));
    std::vector<float> scores(static_cast<std::size_t>(segments) * stride);
    std::vector<std::int32_t> count, first;
    std::uniform_int_distribution<int> level(-8, 8);
    std::normal_distribution<float> dist(0.0f, 10.0f);
    for (int s = 0; s < segments; ++s) {
      count.push_back(static_cast<std::int32_t>(rng() % static_cast<unsigned>(stride + 1)));
      first.push_back(static_cast<std::int32_t>(rng() % 5));
      const bool ties = rng() % 2 == 0;
      for (int j = 0; j < stride; ++j) {
        float x = ties ? static_cast<float>(level(rng)) * 0.5f : dist(rng);
        if (ties && x == 0.0f && rng() % 2) x = -0.0f;
        scores[static_cast<std::size_t>(s) * stride + j] = x;
      }
    }
    auto dscores = upload(scores);
    auto dcount = upload(count);
    auto dfirst = upload(first);
    gpu::DeviceBuffer<std::int32_t> sel(static_cast<std::size_t>(segments * k)), sel_count(static_cast<std::size_t>(segments));
    gpu::segmented_top_k(dscores.data(), stride, dcount.data(), dfirst.data(), segments, k, sel.data(), sel_count.data(),
                         stream);
    OASISKV_CUDA_CHECK(cudaStreamSynchronize(stream));
    const auto g = download(sel, sel.size());
    const auto gc = download(sel_count, sel_count.size());
    for (int s = 0; s < segments; ++s) {
      std::vector<std::int32_t> expected;
      LookaheadSelector::top_k(std::span(scores).subspan(static_cast<std::size_t>(s) * stride,
                                                         static_cast<std::size_t>(count[static_cast<std::size_t>(s)])),
                               first[static_cast<std::size_t>(s)], k, expected);
      INFO("segment " << s << " of " << count[static_cast<std::size_t>(s)] << " blocks, k " << k);
      REQUIRE(gc[static_cast<std::size_t>(s)] == static_cast<std::int32_t>(expected.size()));
      CHECK(std::equal(expected.begin(), expected.end(), g.begin() + static_cast<std::ptrdiff_t>(s) * k));
    }
  }
}

OASISKV_CUDA_TEST_CASE("cuda transfer planning matches TransferPlanner on random residency") {
  OASISKV_SEEDED_RNG(rng);
  gpu::Stream stream;
  CacheConfig c = test_config(rng, GroupReduction::max);
  c.fetch_ratio = 0.1 + 0.9 * static_cast<double>(rng() % 100) / 100.0;
  const CacheLayout L = CacheLayout::from(c);
  const gpu::Geometry g = gpu::Geometry::from(L);
  const int B = c.max_sequences, H = c.shape.num_kv_heads, S = L.selectable_blocks, K = S;
  const int layer = static_cast<int>(rng() % 2);
  const std::size_t res_n = static_cast<std::size_t>(B * c.shape.num_layers * H * S);
  std::vector<std::int32_t> res_block(res_n, kNoBlock);
  std::vector<std::int64_t> res_last(res_n, -1);
  std::vector<std::int32_t> sel(static_cast<std::size_t>(B * H * K)), sel_count(static_cast<std::size_t>(B * H));
  for (int p = 0; p < B * H; ++p) {
    const std::size_t off = static_cast<std::size_t>(g.head_index(p / H, layer, p % H) * S);
    std::vector<std::int32_t> pool(200);
    std::iota(pool.begin(), pool.end(), 1);
    std::shuffle(pool.begin(), pool.end(), rng);
    for (int j = 0; j < S; ++j) {
      if (rng() % 4 != 0) {
        res_block[off + static_cast<std::size_t>(j)] = pool[static_cast<std::size_t>(j)];
        res_last[off + static_cast<std::size_t>(j)] = static_cast<std::int64_t>(rng() % 4);
      }
    }
    // Selections mixing resident and new blocks.
    std::shuffle(pool.begin(), pool.begin() + S + 20, rng);
    const int n = static_cast<int>(rng() % static_cast<unsigned>(K + 1));
    sel_count[static_cast<std::size_t>(p)] = n;
    for (int a = 0; a < n; ++a) sel[static_cast<std::size_t>(p * K + a)] = pool[static_cast<std::size_t>(a)];
  }
  std::vector<std::int32_t> slots{0, 1, 2};
  std::vector<std::int64_t> lens(3, 0), steps(3, 7);
  auto dslots = upload(slots);
  auto dlens = upload(lens);
  auto dsteps = upload(steps);
  auto dsel = upload(sel);
  auto dsel_count = upload(sel_count);
  auto gres_block = upload(res_block);
  auto gres_last = upload(res_last);
  const int cap = g.admit_stride;
  gpu::DeviceBuffer<gpu::DeviceAdmit> admits(static_cast<std::size_t>(B * H * cap));
  gpu::DeviceBuffer<std::int32_t> admit_count(static_cast<std::size_t>(B * H)), kept(static_cast<std::size_t>(B * H * K)),
      kept_count(static_cast<std::size_t>(B * H)), capped(static_cast<std::size_t>(B * H));
  gpu::plan_transfers(g, layer, gpu::DeviceBatch{B, dslots.data(), dlens.data()}, dsteps.data(), dsel.data(),
                      dsel_count.data(), K, gres_block.data(), gres_last.data(),
                      gpu::PlanBuffers{admits.data(), admit_count.data(), kept.data(), kept_count.data(), capped.data()},
                      stream);
  OASISKV_CUDA_CHECK(cudaStreamSynchronize(stream));
  const auto ga = download(admits, admits.size());
  const auto gac = download(admit_count, admit_count.size());
  const auto gk = download(kept, kept.size());
  const auto gkc = download(kept_count, kept_count.size());
  const auto gcap = download(capped, capped.size());
  TransferPlanner planner;
  TransferPlan plan;
  for (int p = 0; p < B * H; ++p) {
    const std::size_t off = static_cast<std::size_t>(g.head_index(p / H, layer, p % H) * S);
    const SlotResidency res{std::span(res_block).subspan(off, static_cast<std::size_t>(S)),
                            std::span(res_last).subspan(off, static_cast<std::size_t>(S))};
    planner.plan(std::span(sel).subspan(static_cast<std::size_t>(p * K), static_cast<std::size_t>(sel_count[static_cast<std::size_t>(p)])),
                 res, L.admit_cap(7), 7, plan);
    apply(plan, res);
    REQUIRE(gac[static_cast<std::size_t>(p)] == static_cast<std::int32_t>(plan.admits.size()));
    for (std::size_t a = 0; a < plan.admits.size(); ++a) {
      const auto& x = ga[static_cast<std::size_t>(p * cap) + a];
      CHECK(x.block == plan.admits[a].block);
      CHECK(x.slot == plan.admits[a].slot);
      CHECK(x.evicted == plan.admits[a].evicted);
    }
    REQUIRE(gkc[static_cast<std::size_t>(p)] == static_cast<std::int32_t>(plan.kept_slots.size()));
    CHECK(std::equal(plan.kept_slots.begin(), plan.kept_slots.end(), gk.begin() + static_cast<std::ptrdiff_t>(p) * K));
    CHECK(gcap[static_cast<std::size_t>(p)] == plan.capped);
  }
  CHECK(download(gres_block, gres_block.size()) == res_block);
  CHECK(download(gres_last, gres_last.size()) == res_last);
}

OASISKV_CUDA_TEST_CASE("cuda block gather: zero-copy kernel and DMA batch copy the same bytes, nothing else") {
  OASISKV_SEEDED_RNG(rng);
  gpu::Stream stream;
  constexpr std::size_t kBlock = 8192;
  const std::size_t src_blocks = 300, dst_blocks = 256;
  gpu::PinnedRegion host(src_blocks * kBlock, kBlock);
  REQUIRE(host.pinned());
  for (std::size_t i = 0; i < host.bytes(); ++i) host.data()[i] = static_cast<std::byte>(rng());
  for (gpu::GatherMethod method : {gpu::GatherMethod::zero_copy_kernel, gpu::GatherMethod::dma_batch}) {
    INFO("method " << static_cast<int>(method));
    std::vector<unsigned char> before(dst_blocks * kBlock);
    for (auto& b : before) b = static_cast<unsigned char>(rng());
    auto dst = upload(before);
    std::vector<std::size_t> targets(dst_blocks);
    std::iota(targets.begin(), targets.end(), 0);
    std::shuffle(targets.begin(), targets.end(), rng);
    const std::size_t n = 1 + rng() % 200;
    std::vector<BlockCopy> copies;
    std::vector<unsigned char> expected = before;
    for (std::size_t c = 0; c < n; ++c) {
      const std::size_t src = rng() % src_blocks;
      copies.push_back(BlockCopy{host.device_data() + src * kBlock, dst.data() + targets[c] * kBlock, kBlock});
      std::memcpy(expected.data() + targets[c] * kBlock, host.data() + src * kBlock, kBlock);
    }
    gpu::BlockGather gather(256, method);
    gather.run(copies, stream);
    OASISKV_CUDA_CHECK(cudaStreamSynchronize(stream));
    CHECK(download(dst, dst.size()) == expected);
  }
}

template <KvElement T>
void run_attention_test() {
  OASISKV_SEEDED_RNG(rng);
  gpu::Stream stream;
  const int dims[] = {16, 64, 128};
  const int d = dims[rng() % 3], bt = 16, H = 1 + static_cast<int>(rng() % 3), G = 1 + static_cast<int>(rng() % 4);
  const int nq = H * G, B = 1 + static_cast<int>(rng() % 4), slots = 64;
  INFO("head_dim " << d << ", kv heads " << H << ", group " << G << ", batch " << B);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  const std::int64_t stride = 2LL * bt * d;
  std::vector<T> pool(static_cast<std::size_t>(slots * stride));
  for (auto& x : pool) x = from_float<T>(dist(rng));
  std::vector<std::int32_t> indptr{0}, slot, block, valid;
  std::vector<SeqId> ids;
  std::vector<std::int64_t> lens;
  for (int i = 0; i < B; ++i) {
    ids.push_back(static_cast<SeqId>(i + 100));
    lens.push_back(0);
    for (int h = 0; h < H; ++h) {
      const int n = static_cast<int>(rng() % 12);
      for (int e = 0; e < n; ++e) {
        slot.push_back(static_cast<std::int32_t>(rng() % slots));
        block.push_back(e);
        valid.push_back(1 + static_cast<std::int32_t>(rng() % bt));
      }
      indptr.push_back(static_cast<std::int32_t>(slot.size()));
    }
  }
  std::vector<float> q(static_cast<std::size_t>(B * nq * d));
  for (auto& x : q) x = dist(rng);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  LayerView<T> view;
  view.batch_size = B;
  view.num_kv_heads = H;
  view.head_dim = d;
  view.block_tokens = bt;
  view.seq_ids = ids.data();
  view.seq_len = lens.data();
  view.indptr = indptr.data();
  view.slot = slot.data();
  view.block = block.data();
  view.valid_tokens = valid.data();
  view.pool = pool.data();
  view.slot_stride = stride;
  std::vector<float> expected(q.size());
  sparse_attention_reference(view, nq, scale, q.data(), expected.data());

  auto dids = upload(ids);
  auto dlens = upload(lens);
  auto dindptr = upload(indptr);
  auto dslot = upload(slot);
  auto dblock = upload(block);
  auto dvalid = upload(valid);
  auto dpool = upload(pool);
  auto dq = upload(q);
  gpu::DeviceBuffer<float> dout(q.size());
  LayerView<T> dv = view;
  dv.seq_ids = dids.data();
  dv.seq_len = dlens.data();
  dv.indptr = dindptr.data();
  dv.slot = dslot.data();
  dv.block = dblock.data();
  dv.valid_tokens = dvalid.data();
  dv.pool = dpool.data();
  gpu::sparse_attention<T>(dv, nq, scale, dq.data(), dout.data(), stream);
  OASISKV_CUDA_CHECK(cudaStreamSynchronize(stream));
  const auto got = download(dout, dout.size());
  for (std::size_t j = 0; j < got.size(); ++j) {
    CHECK(std::fabs(got[j] - expected[j]) <= 1e-3f * std::max(1.0f, std::fabs(expected[j])));
  }
}

OASISKV_CUDA_TEST_CASE("cuda sparse attention matches the CPU reference (float)") { run_attention_test<float>(); }
OASISKV_CUDA_TEST_CASE("cuda sparse attention matches the CPU reference (fp16)") { run_attention_test<fp16_t>(); }
OASISKV_CUDA_TEST_CASE("cuda sparse attention matches the CPU reference (bf16)") { run_attention_test<bf16_t>(); }

OASISKV_CUDA_TEST_CASE("cuda errors become oasiskv::Error carrying the CUDA error name") {
  void* p = nullptr;
  try {
    OASISKV_CUDA_CHECK(cudaMalloc(&p, std::size_t{1} << 62));
    FAIL("cudaMalloc of 4 EiB succeeded");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("cudaErrorMemoryAllocation") != std::string::npos);
  }
  // The error was cleared: the next call works.
  gpu::DeviceBuffer<int> ok(16);
  CHECK(ok.data() != nullptr);
  CHECK_THROWS_AS(gpu::segmented_top_k(nullptr, 1, nullptr, nullptr, 1, 0, nullptr, nullptr, nullptr), Error);
}

}  // namespace oasiskv::gpu_test
