// The CUDA backend's kernels against the CPU backend, on fresh seeded random inputs (the seed is
// printed on failure; OASISKV_TEST_SEED=N reproduces a run): append, scoring, top-K (ties, signed
// zeros, NaN), planning (per-entry admit caps), residency reset, gather, and grids of more than
// 65,535 (sequence, kv head) pairs. Every transfer is stream-ordered (cuda_support.hpp).
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "cuda/fixture.hpp"
#include "oasiskv/cpu/detail/lookahead_selector.hpp"
#include "oasiskv/kit/transfer_plan.hpp"
#include "support.hpp"

namespace oasiskv::gpu_test {
namespace {

constexpr GroupReduction kReductions[] = {GroupReduction::max, GroupReduction::sum, GroupReduction::softmax_sum};

// Lookahead queries of kv head h's group for batch entry i, as the CPU engine gathers them.
std::vector<float> group_queries(const CacheLayout& L, const std::vector<float>& q, int i, int rows, int h) {
  const int G = L.group_size, d = L.head_dim(), nq = L.num_q_heads();
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

// The ranking rule, written out: higher score first; a NaN (any sign or payload) below every
// number, -inf included; -0.0 == +0.0; ties (equal numbers, or two NaNs) to the lower index.
bool ranks_before(float x, std::int32_t a, float y, std::int32_t b) {
  const bool nx = std::isnan(x), ny = std::isnan(y);
  if (nx != ny) return ny;
  if (!nx && x != y) return x > y;
  return a < b;
}

// The k best of scores[0, n) by brute force (a full sort by the rule), as first + index.
std::vector<std::int32_t> brute_top_k(const float* scores, int n, std::int32_t first, int k) {
  std::vector<std::int32_t> idx(static_cast<std::size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  std::sort(idx.begin(), idx.end(), [&](std::int32_t a, std::int32_t b) { return ranks_before(scores[a], a, scores[b], b); });
  idx.resize(static_cast<std::size_t>(std::min(n, k)));
  for (auto& b : idx) b += first;
  return idx;
}

std::span<std::int32_t> row_of(std::vector<std::int32_t>& v, std::int64_t off, int n) {
  return std::span(v).subspan(static_cast<std::size_t>(off), static_cast<std::size_t>(n));
}
std::span<std::int64_t> row_of(std::vector<std::int64_t>& v, std::int64_t off, int n) {
  return std::span(v).subspan(static_cast<std::size_t>(off), static_cast<std::size_t>(n));
}

// Scoring, top-K, planning and gather for every sequence of a Twin at `layer`, on both backends:
// scores, selections, plans, residency and copied slots must agree.
template <KvElement T>
void check_prefetch_step(Twin<T>& tw, std::mt19937_64& rng, int layer, std::int64_t step,
                         std::vector<std::int32_t>& res_block, std::vector<std::int64_t>& res_last,
                         gpu::DeviceBuffer<std::int32_t>& gres_block, gpu::DeviceBuffer<std::int64_t>& gres_last) {
  const CacheLayout& L = tw.L;
  const cudaStream_t st = tw.stream;
  const int B = L.config.max_sequences, H = L.num_kv_heads(), d = L.head_dim();
  const int nq = L.num_q_heads(), K = L.selectable_blocks, S = K;
  const int rows = 1 + static_cast<int>(rng() % 2);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> q(static_cast<std::size_t>(B * rows * nq * d));
  for (auto& x : q) x = dist(rng);

  std::vector<std::int32_t> slots(static_cast<std::size_t>(B));
  std::iota(slots.begin(), slots.end(), 0);
  std::vector<std::int64_t> lens, steps(static_cast<std::size_t>(B), step);
  const std::vector<std::int32_t> caps(static_cast<std::size_t>(B * H), L.admit_cap(step));  // per pair
  for (int s = 0; s < B; ++s) lens.push_back(tw.length(s, layer));
  auto dslot = upload(slots, st);
  auto dlen = upload(lens, st);
  auto dsteps = upload(steps, st);
  auto dcaps = upload(caps, st);
  auto dq = upload(q, st);
  const gpu::DeviceBatch batch{B, dslot.data(), dlen.data()};
  const int pairs = B * H;
  const int stride = static_cast<int>(L.max_blocks);
  const int Q = rows * L.group_size;
  gpu::DeviceBuffer<float> scores(static_cast<std::size_t>(pairs) * stride);
  gpu::DeviceBuffer<float> bounds(static_cast<std::size_t>(pairs) * Q * stride);
  gpu::DeviceBuffer<std::int32_t> count(static_cast<std::size_t>(pairs)), first(static_cast<std::size_t>(pairs));
  gpu::score_blocks<float>(L, layer, batch, dq.data(), rows, tw.gsumm.data(),
                           gpu::ScoreBuffers{scores.data(), count.data(), first.data(), bounds.data(), stride}, st);
  gpu::DeviceBuffer<std::int32_t> sel(static_cast<std::size_t>(pairs * K)), sel_count(static_cast<std::size_t>(pairs));
  gpu::segmented_top_k(scores.data(), stride, count.data(), first.data(), pairs, K, sel.data(), sel_count.data(), st);
  const auto g_scores = download(scores, st);
  const auto g_count = download(count, st);
  const auto g_first = download(first, st);
  auto g_sel = download(sel, st);
  auto g_sel_count = download(sel_count, st);

  // CPU scores, then GPU top-K of the CPU scores: the selection must be identical whatever the
  // reduction ("given the same scores, the same blocks").
  std::vector<float> cpu_scores_flat(static_cast<std::size_t>(pairs) * stride, 0.0f);
  LookaheadSelector selector(L);
  std::vector<std::vector<std::int32_t>> cpu_sel(static_cast<std::size_t>(pairs));
  for (int i = 0; i < B; ++i) {
    const std::int64_t len = lens[static_cast<std::size_t>(i)];
    const std::int64_t firstb = L.sink_blocks;
    const std::int64_t last = L.next_step_candidates_end(len);
    for (int h = 0; h < H; ++h) {
      const int p = i * H + h;
      const auto qs = group_queries(L, q, i, rows, h);
      std::vector<float> sc;
      selector.score(tw.summ, i, layer, h, firstb, last, qs.data(), Q, sc);
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
  auto dcpu_scores = upload(cpu_scores_flat, st);
  gpu::segmented_top_k(dcpu_scores.data(), stride, count.data(), first.data(), pairs, K, sel.data(), sel_count.data(),
                       st);
  g_sel = download(sel, st);
  g_sel_count = download(sel_count, st);
  for (int p = 0; p < pairs; ++p) {
    const auto& cs = cpu_sel[static_cast<std::size_t>(p)];
    REQUIRE(g_sel_count[static_cast<std::size_t>(p)] == static_cast<std::int32_t>(cs.size()));
    CHECK(std::equal(cs.begin(), cs.end(), g_sel.begin() + static_cast<std::ptrdiff_t>(p) * K));
  }

  // Plans from the (identical) selections, then the gather of the admitted blocks.
  gpu::DeviceBuffer<gpu::DeviceAdmit> admits(static_cast<std::size_t>(pairs * S));
  gpu::DeviceBuffer<std::int32_t> admit_count(static_cast<std::size_t>(pairs)), kept(static_cast<std::size_t>(pairs * K)),
      kept_count(static_cast<std::size_t>(pairs)), capped(static_cast<std::size_t>(pairs));
  gpu::plan_transfers(L, layer, batch, dsteps.data(), dcaps.data(), sel.data(), sel_count.data(), K, gres_block.data(),
                      gres_last.data(),
                      gpu::PlanBuffers{admits.data(), admit_count.data(), kept.data(), kept_count.data(), capped.data()},
                      st);
  gpu::gather_admits<T>(L, layer, batch, admits.data(), admit_count.data(), tw.ghost_device(), tw.gpool_layer(layer),
                        st);
  const auto g_admits = download(admits, st);
  const auto g_admit_count = download(admit_count, st);
  const auto g_kept = download(kept, st);
  const auto g_kept_count = download(kept_count, st);
  const auto g_capped = download(capped, st);

  TransferPlanner planner;
  TransferPlan plan;
  for (int i = 0; i < B; ++i) {
    for (int h = 0; h < H; ++h) {
      const int p = i * H + h;
      const std::int64_t off = L.residency_offset(i, layer, h);
      const SlotResidency res{row_of(res_block, off, S), row_of(res_last, off, S)};
      planner.plan(cpu_sel[static_cast<std::size_t>(p)], res, L.admit_cap(step), step, plan);
      apply(plan, res);
      REQUIRE(g_admit_count[static_cast<std::size_t>(p)] == static_cast<std::int32_t>(plan.admits.size()));
      for (std::size_t a = 0; a < plan.admits.size(); ++a) {
        const auto& ga = g_admits[static_cast<std::size_t>(p * S) + a];
        CHECK(ga.block == plan.admits[a].block);
        CHECK(ga.slot == plan.admits[a].slot);
        CHECK(ga.evicted == plan.admits[a].evicted);
        // The CPU engine's copy.
        std::memcpy(tw.pool_slot(layer, L.slot_id(i, h, L.selectable_slot(plan.admits[a].slot))),
                    tw.host_block(i, layer, h, plan.admits[a].block), static_cast<std::size_t>(L.block_elems) * sizeof(T));
      }
      REQUIRE(g_kept_count[static_cast<std::size_t>(p)] == static_cast<std::int32_t>(plan.kept_slots.size()));
      CHECK(std::equal(plan.kept_slots.begin(), plan.kept_slots.end(), g_kept.begin() + static_cast<std::ptrdiff_t>(p) * K));
      CHECK(g_capped[static_cast<std::size_t>(p)] == plan.capped);
    }
  }
  CHECK(download(gres_block, st) == res_block);
  CHECK(download(gres_last, st) == res_last);
  tw.check_equal_state();  // copied slots included
}

// scorer: CacheConfig::scorer, with a random alpha (block_scorer.hpp): the CUDA scoring
// kernel of each scorer against the CPU's LookaheadSelector, bit for bit for max and sum.
template <KvElement T>
void run_pipeline_test(BlockScore scorer = BlockScore::quest) {
  OASISKV_SEEDED_RNG(rng);
  for (GroupReduction reduction : kReductions) {
    INFO("reduction = " << reduction_name(reduction));
    CacheConfig config = test_config(rng, reduction);
    config.scorer = scorer;
    config.spread_alpha = std::uniform_real_distribution<float>(0.0f, 1.0f)(rng);
    INFO("scorer " << block_score_name(scorer) << ", alpha " << config.spread_alpha);
    INFO("kv heads " << config.shape.num_kv_heads << ", q heads " << config.shape.num_q_heads << ", head_dim "
                     << config.shape.head_dim << ", budget " << config.budget_tokens << ", fetch_ratio "
                     << config.fetch_ratio);
    gpu::Stream stream;
    Twin<T> tw(config, stream);
    const int B = config.max_sequences;
    const auto res_n = static_cast<std::size_t>(tw.L.residency_entries);
    std::vector<std::int32_t> res_block(res_n, kNoBlock);
    std::vector<std::int64_t> res_last(res_n, -1);
    auto gres_block = filled<std::int32_t>(res_n, 0xff, stream);  // kNoBlock
    auto gres_last = filled<std::int64_t>(res_n, 0xff, stream);   // -1
    // Prefill of different lengths, then decode steps with a plan each.
    for (int layer = 0; layer < config.shape.num_layers; ++layer) {
      std::vector<int> rows;
      for (int s = 0; s < B; ++s) rows.push_back(static_cast<int>(rng() % 600));
      tw.append(rng, {0, 1, 2}, layer, rows);
    }
    tw.check_equal_state();
    for (int step = 0; step < 4; ++step) {
      for (int layer = 0; layer < config.shape.num_layers; ++layer) {
        tw.append(rng, {0, 1, 2}, layer, {1, 1 + static_cast<int>(rng() % 3), 1});
        check_prefetch_step(tw, rng, layer, step, res_block, res_last, gres_block, gres_last);
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
OASISKV_CUDA_TEST_CASE("cuda spread scorer: scoring top-K planning and gather match the CPU backend (float, fp16)") {
  run_pipeline_test<float>(BlockScore::spread);
  run_pipeline_test<fp16_t>(BlockScore::spread);
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
    auto dscores = upload(scores, stream);
    auto dcount = upload(count, stream);
    auto dfirst = upload(first, stream);
    gpu::DeviceBuffer<std::int32_t> sel(static_cast<std::size_t>(segments * k)), sel_count(static_cast<std::size_t>(segments));
    gpu::segmented_top_k(dscores.data(), stride, dcount.data(), dfirst.data(), segments, k, sel.data(), sel_count.data(),
                         stream);
    const auto g = download(sel, stream);
    const auto gc = download(sel_count, stream);
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

// Review fix: order_key mapped a positive NaN above +inf (a NaN block always won).
OASISKV_CUDA_TEST_CASE("cuda segmented top-K ranks every NaN below -inf, NaNs by index, and -0 equal to +0") {
  OASISKV_SEEDED_RNG(rng);
  gpu::Stream stream;
  const float inf = std::numeric_limits<float>::infinity();
  const float qnan = std::numeric_limits<float>::quiet_NaN();
  const float palette[] = {qnan,
                           -qnan,
                           std::bit_cast<float>(0x7f800001u),  // signalling payload
                           std::bit_cast<float>(0xffffffffu),  // negative NaN, every payload bit
                           std::bit_cast<float>(0x7fffffffu),
                           inf,
                           -inf,
                           0.0f,
                           -0.0f,
                           1.0f,
                           -1.0f,
                           std::numeric_limits<float>::max(),
                           -std::numeric_limits<float>::max(),
                           std::numeric_limits<float>::denorm_min()};
  // A fixed case first: NaN, -inf, +inf, -0, +0, NaN, 1 -> +inf, 1, -0, +0, -inf, NaN, NaN.
  std::vector<std::vector<float>> cases{{qnan, -inf, inf, -0.0f, 0.0f, -qnan, 1.0f}};
  std::vector<int> ks{7};
  for (int round = 0; round < 40; ++round) {
    const int n = static_cast<int>(rng() % 700);  // past one 256-thread chunk
    std::vector<float> s(static_cast<std::size_t>(n));
    const bool mostly_nan = round % 4 == 0;
    for (auto& x : s) {
      const auto pick = rng() % (mostly_nan ? 5 : std::size(palette) + 4);
      x = pick < std::size(palette) ? palette[pick] : static_cast<float>(static_cast<int>(rng() % 7) - 3);
    }
    cases.push_back(std::move(s));
    ks.push_back(1 + static_cast<int>(rng() % static_cast<unsigned>(n + 10)));
  }
  const std::vector<std::int32_t> expected_fixed{2, 6, 3, 4, 1, 0, 5};
  for (std::size_t c = 0; c < cases.size(); ++c) {
    const auto& s = cases[c];
    const int n = static_cast<int>(s.size()), k = ks[c];
    const std::int32_t first0 = static_cast<std::int32_t>(c % 3);
    INFO("case " << c << ": " << n << " scores, k " << k);
    auto dscores = upload(s, stream);
    auto dcount = upload(std::vector<std::int32_t>{n}, stream);
    auto dfirst = upload(std::vector<std::int32_t>{first0}, stream);
    gpu::DeviceBuffer<std::int32_t> sel(static_cast<std::size_t>(k)), sel_count(1);
    gpu::segmented_top_k(dscores.data(), std::max(n, 1), dcount.data(), dfirst.data(), 1, k, sel.data(),
                         sel_count.data(), stream);
    const auto gc = download(sel_count, stream);
    const auto g = download(sel, stream);
    const auto expected = brute_top_k(s.data(), n, first0, k);
    if (c == 0) CHECK(expected == expected_fixed);
    REQUIRE(gc[0] == static_cast<std::int32_t>(expected.size()));
    CHECK(std::equal(expected.begin(), expected.end(), g.begin()));
    std::vector<std::int32_t> cpu;  // the CPU's ScoreOrder follows the same rule
    LookaheadSelector::top_k(s, first0, k, cpu);
    CHECK(cpu == expected);
  }
}

OASISKV_CUDA_TEST_CASE("cuda transfer planning matches TransferPlanner with per-entry steps and admit caps") {
  OASISKV_SEEDED_RNG(rng);
  gpu::Stream stream;
  for (int round = 0; round < 4; ++round) {
    CacheConfig c = test_config(rng, GroupReduction::max);
    c.fetch_ratio = 0.1 + 0.9 * static_cast<double>(rng() % 100) / 100.0;
    const CacheLayout L = CacheLayout::from(c);
    const int B = c.max_sequences, H = c.shape.num_kv_heads, S = L.selectable_blocks, K = S;
    const int layer = static_cast<int>(rng() % 2);
    const auto res_n = static_cast<std::size_t>(L.residency_entries);
    std::vector<std::int32_t> res_block(res_n, kNoBlock);
    std::vector<std::int64_t> res_last(res_n, -1);
    // Entry i is sequence slot slots[i], with its own plan step; pair p its own cap (0, 1, the
    // fetch cap, uncapped, or negative = 0). A cap of S at a step > 0 is the first plan after the
    // residency was emptied (admit_cap(0)).
    const std::vector<std::int32_t> slots{2, 0, 1};
    std::vector<std::int64_t> lens(3, 0), steps;
    std::vector<std::int32_t> caps;
    const std::int32_t choices[] = {0, 1, L.fetch_cap, S, -3};
    for (int i = 0; i < B; ++i) steps.push_back(5 + static_cast<std::int64_t>(rng() % 5));
    for (int p = 0; p < B * H; ++p) caps.push_back(choices[rng() % 5]);
    // Pair p = (entry p / H, kv head p % H): random residency in its row, and a selection mixing
    // resident and new blocks.
    std::vector<std::int32_t> sel(static_cast<std::size_t>(B * H * K)), sel_count(static_cast<std::size_t>(B * H));
    for (int p = 0; p < B * H; ++p) {
      const auto off = static_cast<std::size_t>(L.residency_offset(slots[static_cast<std::size_t>(p / H)], layer, p % H));
      std::vector<std::int32_t> pool(200);
      std::iota(pool.begin(), pool.end(), 1);
      std::shuffle(pool.begin(), pool.end(), rng);
      for (int j = 0; j < S; ++j) {
        if (rng() % 4 != 0) {
          res_block[off + static_cast<std::size_t>(j)] = pool[static_cast<std::size_t>(j)];
          res_last[off + static_cast<std::size_t>(j)] = static_cast<std::int64_t>(rng() % 4);
        }
      }
      std::shuffle(pool.begin(), pool.begin() + S + 20, rng);
      const int n = static_cast<int>(rng() % static_cast<unsigned>(K + 1));
      sel_count[static_cast<std::size_t>(p)] = n;
      for (int a = 0; a < n; ++a) sel[static_cast<std::size_t>(p * K + a)] = pool[static_cast<std::size_t>(a)];
    }
    auto dslots = upload(slots, stream);
    auto dlens = upload(lens, stream);
    auto dsteps = upload(steps, stream);
    auto dcaps = upload(caps, stream);
    auto dsel = upload(sel, stream);
    auto dsel_count = upload(sel_count, stream);
    auto gres_block = upload(res_block, stream);
    auto gres_last = upload(res_last, stream);
    gpu::DeviceBuffer<gpu::DeviceAdmit> admits(static_cast<std::size_t>(B * H * S));
    gpu::DeviceBuffer<std::int32_t> admit_count(static_cast<std::size_t>(B * H)), kept(static_cast<std::size_t>(B * H * K)),
        kept_count(static_cast<std::size_t>(B * H)), capped(static_cast<std::size_t>(B * H));
    gpu::plan_transfers(L, layer, gpu::DeviceBatch{B, dslots.data(), dlens.data()}, dsteps.data(), dcaps.data(),
                        dsel.data(), dsel_count.data(), K, gres_block.data(), gres_last.data(),
                        gpu::PlanBuffers{admits.data(), admit_count.data(), kept.data(), kept_count.data(), capped.data()},
                        stream);
    const auto ga = download(admits, stream);
    const auto gac = download(admit_count, stream);
    const auto gk = download(kept, stream);
    const auto gkc = download(kept_count, stream);
    const auto gcap = download(capped, stream);
    TransferPlanner planner;
    TransferPlan plan;
    for (int p = 0; p < B * H; ++p) {
      const auto i = static_cast<std::size_t>(p / H);
      const std::int64_t off = L.residency_offset(slots[i], layer, p % H);
      const SlotResidency res{row_of(res_block, off, S), row_of(res_last, off, S)};
      planner.plan(std::span(sel).subspan(static_cast<std::size_t>(p * K), static_cast<std::size_t>(sel_count[static_cast<std::size_t>(p)])),
                   res, caps[static_cast<std::size_t>(p)], steps[i], plan);
      apply(plan, res);
      INFO("pair " << p << ", cap " << caps[static_cast<std::size_t>(p)] << ", step " << steps[i]);
      REQUIRE(gac[static_cast<std::size_t>(p)] == static_cast<std::int32_t>(plan.admits.size()));
      for (std::size_t a = 0; a < plan.admits.size(); ++a) {
        const auto& x = ga[static_cast<std::size_t>(p * S) + a];
        CHECK(x.block == plan.admits[a].block);
        CHECK(x.slot == plan.admits[a].slot);
        CHECK(x.evicted == plan.admits[a].evicted);
      }
      REQUIRE(gkc[static_cast<std::size_t>(p)] == static_cast<std::int32_t>(plan.kept_slots.size()));
      CHECK(std::equal(plan.kept_slots.begin(), plan.kept_slots.end(), gk.begin() + static_cast<std::ptrdiff_t>(p) * K));
      CHECK(gcap[static_cast<std::size_t>(p)] == plan.capped);
    }
    CHECK(download(gres_block, stream) == res_block);
    CHECK(download(gres_last, stream) == res_last);
  }
}

OASISKV_CUDA_TEST_CASE("cuda clear_residency empties one (sequence, layer), a sequence, a layer, or everything") {
  OASISKV_SEEDED_RNG(rng);
  gpu::Stream stream;
  const CacheLayout L = CacheLayout::from(test_config(rng, GroupReduction::sum));
  const int seqs = L.config.max_sequences, layers = L.num_layers(), H = L.num_kv_heads(), S = L.selectable_blocks;
  const auto n = static_cast<std::size_t>(L.residency_entries);
  std::vector<std::int32_t> block(n);
  std::vector<std::int64_t> last(n);
  for (auto& b : block) b = static_cast<std::int32_t>(rng() % 1000);
  for (auto& t : last) t = static_cast<std::int64_t>(rng() % 1000);
  auto gblock = upload(block, stream);
  auto glast = upload(last, stream);
  const std::pair<int, int> calls[] = {{1, 0}, {-1, 1}, {2, -1}, {0, 1}, {-1, -1}};
  for (const auto& [s, l] : calls) {
    INFO("seq_slot " << s << ", layer " << l);
    gpu::clear_residency(L, s, l, gblock.data(), glast.data(), stream);
    for (int si = 0; si < seqs; ++si) {
      for (int li = 0; li < layers; ++li) {
        if ((s >= 0 && si != s) || (l >= 0 && li != l)) continue;
        const auto off = static_cast<std::size_t>(L.residency_offset(si, li, 0));
        std::fill_n(block.begin() + static_cast<std::ptrdiff_t>(off), H * S, kNoBlock);
        std::fill_n(last.begin() + static_cast<std::ptrdiff_t>(off), H * S, std::int64_t{-1});
      }
    }
    CHECK(download(gblock, stream) == block);
    CHECK(download(glast, stream) == last);
    // Between calls, new values again, so the next call's range is visible.
    for (std::size_t e = 0; e < n; e += 3) block[e] = static_cast<std::int32_t>(e % 977);
    upload_to(gblock.data(), block, stream);
  }
  CHECK_THROWS_AS(gpu::clear_residency(L, seqs, 0, gblock.data(), glast.data(), stream), Error);
  CHECK_THROWS_AS(gpu::clear_residency(L, 0, -2, gblock.data(), glast.data(), stream), Error);
}

// Review fix: the pairs (or batch entries) were on gridDim.y, which stops at 65,535: append,
// score_blocks and gather_admits failed to launch for batch x kv_heads above it.
OASISKV_CUDA_TEST_CASE("cuda 66,000 (sequence, kv head) pairs: append scoring top-K planning and gather agree with the CPU") {
  OASISKV_SEEDED_RNG(rng);
  gpu::Stream stream;
  CacheConfig c;
  c.shape = ModelShape{1, 2, 1, 8};  // one kv head: 66,000 batch entries = 66,000 pairs
  c.block_tokens = 4;
  c.budget_tokens = 24;  // 1 sink + 2 ring + 3 selectable blocks
  c.sink_tokens = 4;
  c.recent_tokens = 4;
  c.max_sequences = 66000;
  c.max_tokens_per_sequence = 40;
  c.reduction = GroupReduction::sum;
  Twin<fp16_t> tw(c, stream);
  const CacheLayout& L = tw.L;
  const int B = c.max_sequences, pairs = B, S = L.selectable_blocks, rows = 2, Q = rows * L.group_size;
  std::vector<int> slots(static_cast<std::size_t>(B)), nrows;
  std::iota(slots.begin(), slots.end(), 0);
  for (int i = 0; i < B; ++i) nrows.push_back(1 + static_cast<int>(rng() % 40));
  tw.append(rng, slots, 0, nrows);  // batch of 66,000 entries
  tw.check_equal_state();

  std::vector<std::int32_t> seq_slot(slots.begin(), slots.end());
  std::vector<std::int64_t> lens;
  for (int i = 0; i < B; ++i) lens.push_back(tw.length(i, 0));
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> q(static_cast<std::size_t>(B) * rows * L.num_q_heads() * L.head_dim());
  for (auto& x : q) x = dist(rng);
  auto dslot = upload(seq_slot, stream);
  auto dlen = upload(lens, stream);
  auto dq = upload(q, stream);
  const gpu::DeviceBatch batch{B, dslot.data(), dlen.data()};
  const int stride = static_cast<int>(L.max_blocks);
  gpu::DeviceBuffer<float> scores(static_cast<std::size_t>(pairs) * stride);
  gpu::DeviceBuffer<std::int32_t> count(static_cast<std::size_t>(pairs)), first(static_cast<std::size_t>(pairs));
  gpu::score_blocks<float>(L, 0, batch, dq.data(), rows, tw.gsumm.data(),
                           gpu::ScoreBuffers{scores.data(), count.data(), first.data(), nullptr, stride}, stream);
  gpu::DeviceBuffer<std::int32_t> sel(static_cast<std::size_t>(pairs) * S), sel_count(static_cast<std::size_t>(pairs));
  gpu::segmented_top_k(scores.data(), stride, count.data(), first.data(), pairs, S, sel.data(), sel_count.data(),
                       stream);
  // The first plan of every pair (empty residency, uncapped), then its gather.
  auto res_block = filled<std::int32_t>(static_cast<std::size_t>(L.residency_entries), 0xff, stream);
  auto res_last = filled<std::int64_t>(static_cast<std::size_t>(L.residency_entries), 0xff, stream);
  auto dsteps = upload(std::vector<std::int64_t>(static_cast<std::size_t>(B), 0), stream);
  auto dcaps = upload(std::vector<std::int32_t>(static_cast<std::size_t>(B), L.admit_cap(0)), stream);
  gpu::DeviceBuffer<gpu::DeviceAdmit> admits(static_cast<std::size_t>(pairs) * S);
  gpu::DeviceBuffer<std::int32_t> admit_count(static_cast<std::size_t>(pairs));
  gpu::plan_transfers(L, 0, batch, dsteps.data(), dcaps.data(), sel.data(), sel_count.data(), S, res_block.data(),
                      res_last.data(), gpu::PlanBuffers{admits.data(), admit_count.data(), nullptr, nullptr, nullptr},
                      stream);
  gpu::gather_admits<fp16_t>(L, 0, batch, admits.data(), admit_count.data(), tw.ghost_device(), tw.gpool_layer(0),
                             stream);
  const auto g_scores = download(scores, stream);
  const auto g_count = download(count, stream);
  const auto g_sel = download(sel, stream);
  const auto g_sel_count = download(sel_count, stream);
  const auto g_admits = download(admits, stream);
  const auto g_admit_count = download(admit_count, stream);

  LookaheadSelector selector(L);
  std::vector<float> sc;
  int mismatched_scores = 0, mismatched_sel = 0, mismatched_plans = 0;
  for (int p = 0; p < pairs; ++p) {
    const auto up = static_cast<std::size_t>(p);
    const auto qs = group_queries(L, q, p, rows, 0);
    selector.score(tw.summ, p, 0, 0, L.sink_blocks, L.next_step_candidates_end(lens[up]), qs.data(), Q, sc);
    REQUIRE(g_count[up] == static_cast<std::int32_t>(sc.size()));
    for (std::size_t j = 0; j < sc.size(); ++j) mismatched_scores += g_scores[up * stride + j] == sc[j] ? 0 : 1;
    const auto expected = brute_top_k(sc.data(), static_cast<int>(sc.size()), L.sink_blocks, S);
    const auto n = static_cast<std::size_t>(g_sel_count[up]);
    if (n != expected.size() || !std::equal(expected.begin(), expected.end(), g_sel.begin() + static_cast<std::ptrdiff_t>(up * S))) {
      ++mismatched_sel;
      continue;
    }
    // Empty residency: admit a takes free slot a, evicting nothing.
    if (g_admit_count[up] != static_cast<std::int32_t>(n)) ++mismatched_plans;
    for (std::size_t a = 0; a < n && a < static_cast<std::size_t>(g_admit_count[up]); ++a) {
      const auto& ad = g_admits[up * S + a];
      if (ad.block != expected[a] || ad.slot != static_cast<std::int32_t>(a) || ad.evicted != kNoBlock) {
        ++mismatched_plans;
        continue;
      }
      std::memcpy(tw.pool_slot(0, L.slot_id(p, 0, L.selectable_slot(ad.slot))), tw.host_block(p, 0, 0, ad.block),
                  static_cast<std::size_t>(L.block_elems) * sizeof(fp16_t));
    }
  }
  CHECK(mismatched_scores == 0);
  CHECK(mismatched_sel == 0);
  CHECK(mismatched_plans == 0);
  tw.check_equal_state();  // the gathered slots of every pair
}

}  // namespace oasiskv::gpu_test
