// BudgetProfile: the text format, validation against a config, the builders, and a Cache<cpu>
// with budgets by (layer, kv head) checked against a reference selection and its own rows.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "oasiskv/cpu/admission_export.hpp"
#include "reference_selection.hpp"
#include "support.hpp"

using namespace oasiskv;

namespace {

// The error of f, or "" when it does not throw.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

#define CHECK_ERROR_HAS(expr, text)                       \
  do {                                                    \
    const std::string what_ = error_of([&] { (void)(expr); }); \
    INFO("error: " << what_);                             \
    CHECK(what_.find(text) != std::string::npos);         \
  } while (0)

// small_config: 2 layers x 2 kv heads, 16-token blocks, 1 sink + 3 ring blocks pinned, 8 blocks
// per head (128 tokens), 64 blocks per sequence.
CacheConfig config_of(double fetch_ratio = 1.0) {
  CacheConfig c = test::small_config(128, 1024, 3);
  c.fetch_ratio = fetch_ratio;
  return c;
}

}  // namespace

TEST_CASE("a budget profile's text parses back to the same profile, and so does a saved file") {
  OASISKV_SEEDED_RNG(rng);
  for (int trial = 0; trial < 20; ++trial) {
    const int L = std::uniform_int_distribution<int>(1, 6)(rng), H = std::uniform_int_distribution<int>(1, 4)(rng);
    std::vector<int> blocks(static_cast<std::size_t>(L * H));
    for (int& b : blocks) b = std::uniform_int_distribution<int>(1, 5000)(rng);
    const BudgetProfile p(L, H, 16, blocks);
    const BudgetProfile back = BudgetProfile::parse(p.text());
    CHECK(back.num_layers() == L);
    CHECK(back.num_kv_heads() == H);
    CHECK(back.block_tokens() == 16);
    CHECK(std::vector<int>(back.blocks().begin(), back.blocks().end()) == blocks);
  }
  // Comments, blank lines and spacing are free.
  const BudgetProfile q = BudgetProfile::parse(
      "# made by hand\n\noasiskv-budget-profile 1   # v1\nlayers 2 kv_heads 2 block_tokens 16\r\n"
      "layer 0\t12 5\n\n  layer 1 4 11  \n");
  CHECK(q.blocks(0, 0) == 12);
  CHECK(q.blocks(1, 1) == 11);
  CHECK(q.total_blocks() == 32);
  const std::string path =
      (std::filesystem::temp_directory_path() / ("oasiskv_profile_" + std::to_string(rng()) + ".txt")).string();
  q.save(path);
  const BudgetProfile loaded = BudgetProfile::load(path);
  std::filesystem::remove(path);
  CHECK(loaded.text() == q.text());
  CHECK_ERROR_HAS(BudgetProfile::load(path), path);
}

TEST_CASE("every bad profile file is refused with the line and the problem named") {
  const std::string head = "oasiskv-budget-profile 1\nlayers 2 kv_heads 2 block_tokens 16\n";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "empty"},
      {"# nothing\n", "empty"},
      {"budget-profile 1\n", "line 1: expected the header"},
      {"oasiskv-budget-profile\n", "line 1: the header is"},
      {"oasiskv-budget-profile 2\n", "version 2 is not supported"},
      {"oasiskv-budget-profile x\n", "the version must be a non-negative integer (int), got 'x'"},
      {"oasiskv-budget-profile 1\n", "no 'layers L kv_heads H block_tokens B' line"},
      {"oasiskv-budget-profile 1\nlayers 2 heads 2 block_tokens 16\n", "line 2: expected 'layers L"},
      {"oasiskv-budget-profile 1\nlayers 0 kv_heads 2 block_tokens 16\n", "must be positive"},
      {"oasiskv-budget-profile 1\nlayers 2 kv_heads -2 block_tokens 16\n", "kv_heads must be a non-negative integer"},
      {head + "layer 0 12 5\n", "1 layer lines, the header says 2 layers"},
      {head + "layer 0 12 5\nlayer 2 4 11\n", "line 4: layer 2 out of order, expected layer 1"},
      {head + "layer 1 12 5\n", "line 3: layer 1 out of order, expected layer 0"},
      {head + "layer 0 12 5\nlayer 1 4 11\nlayer 2 1 1\n", "line 5: layer 2 is past the header's 2 layers"},
      {head + "layer 0 12\nlayer 1 4 11\n", "line 3: layer 0 has 1 budgets, the header says 2 kv heads"},
      {head + "layer 0 12 5 7\n", "line 3: layer 0 has 3 budgets"},
      {head + "layer 0 12 0\n", "line 3: layer 0 kv head 1 has a budget of 0 blocks"},
      {head + "layer 0 12 5x\n", "line 3: a budget must be a non-negative integer (int), got '5x'"},
      {head + "layer 0 12 99999999999\n", "got '99999999999'"},
      {head + "layer 0 12 -5\n", "got '-5'"},
      {head + "heads 0 12 5\n", "line 3: expected 'layer 0 ...', got 'heads'"},
      {head + "layer\n", "line 3: 'layer' without a layer number"},
      // Counts far beyond the data: refused by the data, nothing reserved for them.
      {"oasiskv-budget-profile 1\nlayers 2147483647 kv_heads 2147483647 block_tokens 16\nlayer 0 1 2\n",
       "line 3: layer 0 has 2 budgets, the header says 2147483647 kv heads"},
      {"oasiskv-budget-profile 1\nlayers 2147483647 kv_heads 1 block_tokens 16\nlayer 0 1\n",
       "1 layer lines, the header says 2147483647 layers"},
      {"oasiskv-budget-profile 1\nlayers 2147483647 kv_heads 2147483647 block_tokens 16\n",
       "0 layer lines, the header says 2147483647 layers"},
  };
  for (const auto& [text, message] : cases) {
    CAPTURE(text);
    CHECK_ERROR_HAS(BudgetProfile::parse(text, "p.txt"), message);
    CHECK_ERROR_HAS(BudgetProfile::parse(text, "p.txt"), "p.txt");
  }
  CHECK_ERROR_HAS(BudgetProfile(2, 2, 16, {1, 2, 3}), "3 budgets given for 2 layers x 2 kv heads = 4");
  CHECK_ERROR_HAS(BudgetProfile(1, 2, 16, {1, -2}), "layer 0 kv head 1 has a budget of -2 blocks");
  CHECK_ERROR_HAS(BudgetProfile(0, 2, 16, {}), "must be positive");
}

TEST_CASE("a profile is validated against the cache's shape, pinned slots, max blocks and total") {
  const CacheConfig c = config_of();
  CHECK_NOTHROW(BudgetProfile(2, 2, 16, {12, 5, 4, 11}).validate(c));
  CHECK_NOTHROW(BudgetProfile::uniform(c).validate(c));
  CHECK_ERROR_HAS(BudgetProfile(3, 2, 16, std::vector<int>(6, 8)).validate(c), "made for 3 layers x 2 kv heads");
  CHECK_ERROR_HAS(BudgetProfile(2, 1, 16, {16, 16}).validate(c), "made for 2 layers x 1 kv heads");
  CHECK_ERROR_HAS(BudgetProfile(2, 2, 32, {8, 8, 8, 8}).validate(c), "of 32-token blocks, the cache has 2 x 2 of 16");
  CHECK_ERROR_HAS(BudgetProfile(2, 2, 16, {13, 3, 5, 11}).validate(c),
                  "layer 0 kv head 1 has 3 blocks, fewer than its 4 pinned slots (1 sink + 3 ring)");
  CHECK_ERROR_HAS(BudgetProfile(2, 2, 16, {12, 5, 4, 12}).validate(c),
                  "the budgets sum to 33 blocks, but the configured total is 32");
  CacheConfig small = c;
  small.max_tokens_per_sequence = 160;  // 10 blocks
  CHECK_ERROR_HAS(BudgetProfile(2, 2, 16, {12, 5, 4, 11}).validate(small),
                  "layer 0 kv head 0 has 12 blocks, more than the 10 blocks of a sequence");
  CacheConfig big = small;
  big.budget_tokens = 2048;  // more than a sequence's blocks: valid, and so is its uniform profile
  CHECK_NOTHROW(BudgetProfile::uniform(big).validate(big));
  CHECK_ERROR_HAS(BudgetProfile(2, 2, 16, {129, 127, 128, 128}).validate(big), "129 blocks, more than the 128 blocks");
  CacheConfig bad = c;
  bad.budget_tokens = 100;
  CHECK_ERROR_HAS(BudgetProfile::uniform(c).validate(bad), "budget_tokens (100)");
  // The cache refuses what validate refuses, and leaves nothing behind.
  CHECK_ERROR_HAS((Cache<cpu, float>(c, BudgetProfile(2, 2, 16, {12, 5, 4, 12}))), "sum to 33");
}

TEST_CASE("uniform and first_layers_dense keep the configured total, each head within its bounds") {
  const CacheConfig c = config_of();
  const BudgetProfile u = BudgetProfile::uniform(c);
  CHECK(u.uniform());
  CHECK(u.total_blocks() == 32);
  for (std::int64_t context : {1, 100, 160, 200, 1000, 1024}) {
    CAPTURE(context);
    const std::string err = error_of([&] { (void)BudgetProfile::first_layers_dense(c, 1, context); });
    const std::int64_t dense = std::clamp<std::int64_t>((context + 15) / 16, 4, 64);
    if (2 * dense > 32 - 2 * 4) {  // the other layer's 2 heads need 4 blocks each
      CHECK(err.find("leave") != std::string::npos);
      continue;
    }
    REQUIRE(err.empty());
    const BudgetProfile p = BudgetProfile::first_layers_dense(c, 1, context);
    CHECK_NOTHROW(p.validate(c));
    CHECK(p.blocks(0, 0) == dense);
    CHECK(p.blocks(0, 1) == dense);
    CHECK(p.blocks(1, 0) + p.blocks(1, 1) == 32 - 2 * dense);
    CHECK(std::abs(p.blocks(1, 0) - p.blocks(1, 1)) <= 1);
  }
  CHECK(BudgetProfile::first_layers_dense(c, 0, 100).text() == u.text());
  CHECK_ERROR_HAS(BudgetProfile::first_layers_dense(c, 3, 100), "dense_layers must be in [0, 2], got 3");
  CHECK_ERROR_HAS(BudgetProfile::first_layers_dense(c, 1, 0), "context_tokens must be in [1, 1024] (max_tokens_per_sequence), got 0");
  // Past the capacity, up to where blocks_for(context) would overflow: refused, naming the capacity.
  CHECK_ERROR_HAS(BudgetProfile::first_layers_dense(c, 1, 1025), "context_tokens must be in [1, 1024] (max_tokens_per_sequence), got 1025");
  CHECK_ERROR_HAS(BudgetProfile::first_layers_dense(c, 1, INT64_MAX),
                  "context_tokens must be in [1, 1024] (max_tokens_per_sequence), got 9223372036854775807");
  CHECK_ERROR_HAS(BudgetProfile::first_layers_dense(c, 2, 1024), "every layer dense at 64 blocks makes 256 blocks");
  CHECK_NOTHROW(BudgetProfile::first_layers_dense(c, 2, 128).validate(c));  // 8 blocks: the uniform budget
}

TEST_CASE("from_mass_curves: water-filling reaches the best total mass of a brute-force allocation") {
  OASISKV_SEEDED_RNG(rng);
  CacheConfig c = config_of();
  c.max_tokens_per_sequence = 160;  // at most 10 blocks per head: 6 above the 4 pinned
  const int n = 4, spare = 32 - 4 * 4;
  for (int trial = 0; trial < 50; ++trial) {
    // Concave curves (the mass of the best k blocks): descending gains, cumulated. Some shorter
    // than the max (flat past their end).
    std::vector<std::vector<double>> curves(n);
    for (auto& curve : curves) {
      std::vector<double> gains(static_cast<std::size_t>(std::uniform_int_distribution<int>(0, 8)(rng)));
      for (double& g : gains) g = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
      std::sort(gains.begin(), gains.end(), std::greater<>());
      curve.push_back(std::uniform_real_distribution<double>(0.0, 1.0)(rng));
      for (double g : gains) curve.push_back(curve.back() + g);
    }
    const auto mass = [&](int i, int k) {
      const auto& cv = curves[static_cast<std::size_t>(i)];
      return cv[std::min<std::size_t>(static_cast<std::size_t>(k), cv.size() - 1)];
    };
    double best = -1.0;
    for (int a = 0; a <= 6; ++a)
      for (int b = 0; b <= 6; ++b)
        for (int d = 0; d <= 6; ++d) {
          const int e = spare - a - b - d;
          if (e < 0 || e > 6) continue;
          best = std::max(best, mass(0, a) + mass(1, b) + mass(2, d) + mass(3, e));
        }
    const BudgetProfile p = BudgetProfile::from_mass_curves(c, curves);
    CHECK_NOTHROW(p.validate(c));
    double got = 0.0;
    for (int i = 0; i < n; ++i) {
      const int blocks = p.blocks(i / 2, i % 2);
      CHECK(blocks >= 4);
      CHECK(blocks <= 10);
      got += mass(i, blocks - 4);
    }
    CHECK(got == doctest::Approx(best).epsilon(1e-12));
  }
  // Flat curves: the spare blocks still go somewhere (lowest heads first), the total is kept.
  const BudgetProfile flat = BudgetProfile::from_mass_curves(c, std::vector<std::vector<double>>(4, {0.5}));
  CHECK(flat.total_blocks() == 32);
  CHECK(flat.blocks(0, 0) == 10);
  CHECK_ERROR_HAS(BudgetProfile::from_mass_curves(c, std::vector<std::vector<double>>(3)), "3 curves for 2 layers x 2");
  CHECK_ERROR_HAS(BudgetProfile::from_mass_curves(c, std::vector<std::vector<double>>(4, {0.0, NAN})),
                  "layer 0 kv head 0 point 1 is not finite");
  CacheConfig tight = c;
  tight.max_tokens_per_sequence = 128;  // 8 blocks per head, the budget: no head can take more
  const BudgetProfile full = BudgetProfile::from_mass_curves(tight, std::vector<std::vector<double>>{{0.0, 9.0, 9.5}, {0.0}, {0.0}, {0.0}});
  CHECK(full.uniform());
  CHECK(full.blocks(0, 0) == 8);
}

TEST_CASE("without a profile, or with a uniform one, the layout is the uniform layout") {
  const CacheConfig c = config_of(0.3);
  Cache<cpu, float> plain(c), with(c, BudgetProfile::uniform(c));
  const CacheLayout &a = plain.layout(), &b = with.layout();
  CHECK_FALSE(a.profiled());
  CHECK_FALSE(b.profiled());
  CHECK(a.slots_per_layer == b.slots_per_layer);
  CHECK(a.residency_entries == b.residency_entries);
  CHECK(a.total_slots() == a.num_layers() * a.slots_per_layer);
  CHECK(a.max_budget_blocks == a.budget_blocks);  // the per-pair row strides (Cache<cuda>)
  CHECK(a.max_selectable_blocks == a.selectable_blocks);
  CHECK(b.max_selectable_blocks == a.selectable_blocks);
  for (int l = 0; l < a.num_layers(); ++l) {
    for (int h = 0; h < a.num_kv_heads(); ++h) {
      CHECK(a.head_selectable_blocks(l, h) == a.selectable_blocks);
      CHECK(a.head_fetch_cap(l, h) == a.fetch_cap);
      for (int s = 0; s < c.max_sequences; ++s) CHECK(a.slot_id(s, l, h, 3) == a.slot_id(s, h, 3));
    }
  }
}

namespace {

// One sequence's rows as the test appended them: [token][kv head][d] keys and values.
struct Rows {
  std::vector<float> k, v;
};

// Checks layer `layer`'s view of one sequence `id` (length n, planned from queries q of R rows)
// against the profile: per kv head the blocks are the sinks, the ring and the reference top-K of
// the head's own selectable count; at most the head's budget; slot ids inside the layer's pool
// and not shared with another (sequence, head); each slot holds the head's rows of its block.
void check_view(const LayerView<float>& view, const CacheLayout& L, int layer, std::size_t i, const Rows& rows,
                std::int64_t n, const std::vector<float>& q, int R, std::set<std::int32_t>& used) {
  const int Hk = L.num_kv_heads(), Hq = L.num_q_heads(), G = L.group_size, d = L.head_dim();
  const std::int64_t nb = L.blocks_for(n);
  for (int h = 0; h < Hk; ++h) {
    CAPTURE(h);
    const std::size_t p = i * static_cast<std::size_t>(Hk) + static_cast<std::size_t>(h);
    const std::int32_t begin = view.indptr[p], end = view.indptr[p + 1];
    CHECK(end - begin <= L.head_budget_blocks(layer, h));
    std::vector<float> head_keys;
    for (std::int64_t r = 0; r < n; ++r) {
      head_keys.insert(head_keys.end(), rows.k.begin() + (r * Hk + h) * d, rows.k.begin() + (r * Hk + h + 1) * d);
    }
    const std::int64_t first = L.sink_blocks, last = std::max(first, std::min(nb, L.ring_start(n + 1)));
    std::vector<float> scores;
    for (std::int64_t b = first; b < last; ++b) {
      float s = 0.0f;
      for (int r = 0; r < R; ++r) {
        for (int g = 0; g < G; ++g) {
          s += test::reference_bound(q.data() + (r * Hq + h * G + g) * d, head_keys, b * 16,
                                     std::min<std::int64_t>(16, n - b * 16), d);
        }
      }
      scores.push_back(s);
    }
    std::vector<std::int32_t> expected = test::brute_top_k(scores, first, L.head_selectable_blocks(layer, h));
    for (std::int64_t b = 0; b < std::min<std::int64_t>(L.sink_blocks, nb); ++b) expected.push_back(static_cast<std::int32_t>(b));
    for (std::int64_t b = L.ring_start(n); b < nb; ++b) expected.push_back(static_cast<std::int32_t>(b));
    std::sort(expected.begin(), expected.end());
    expected.erase(std::unique(expected.begin(), expected.end()), expected.end());
    const std::vector<std::int32_t> got(view.block + begin, view.block + end);
    CHECK(got == expected);
    for (std::int32_t e = begin; e < end; ++e) {
      const std::int32_t slot = view.slot[e];
      REQUIRE(slot >= 0);
      REQUIRE(slot < L.layer_slots(layer));
      CHECK(used.insert(slot).second);
      const std::int64_t b = view.block[e];
      for (std::int32_t r = 0; r < view.valid_tokens[e]; ++r) {
        const std::int64_t t = b * 16 + r;
        const float* key = view.keys(e) + static_cast<std::int64_t>(r) * d;
        const float* value = key + 16 * d;
        CHECK(std::equal(key, key + d, rows.k.begin() + (t * Hk + h) * d));
        CHECK(std::equal(value, value + d, rows.v.begin() + (t * Hk + h) * d));
      }
    }
  }
}

}  // namespace

namespace {
void profiled_cache_rounds(double ratio) {
  OASISKV_SEEDED_RNG(rng);
  CAPTURE(ratio);
  const CacheConfig c = config_of(ratio);
  const BudgetProfile profile(2, 2, 16, {12, 5, 4, 11});
  Cache<cpu, float> cache(c, profile);
  const CacheLayout& L = cache.layout();
  REQUIRE(L.profiled());
  CHECK(L.total_slots() == CacheLayout::from(c).total_slots());  // the memory is the configured total
  CHECK(L.residency_entries == CacheLayout::from(c).residency_entries);
  CHECK(L.layer_slots(0) == 3 * 17);
  CHECK(L.layer_slots(1) == 3 * 15);
  // The per-pair row strides are the largest head's (12 blocks, 4 of them pinned).
  CHECK(L.max_budget_blocks == 12);
  CHECK(L.max_selectable_blocks == 12 - L.sink_blocks - L.ring_blocks);
  CHECK(cache.backend().slot_pool().bytes_reserved() >= SlotPool<float>::bytes_for(CacheLayout::from(c)));
  const int Hk = L.num_kv_heads(), Hq = L.num_q_heads(), d = L.head_dim();
  std::map<SeqId, Rows> rows;
  std::vector<SeqId> live{1, 2};
  for (SeqId id : live) cache.add_sequence(id);
  auto append = [&](SeqId id, std::int64_t n) {
    Rows& r = rows[id];
    const auto k = test::random_rows<float>(rng, static_cast<std::size_t>(n * Hk * d));
    const auto v = test::random_rows<float>(rng, static_cast<std::size_t>(n * Hk * d));
    r.k.insert(r.k.end(), k.begin(), k.end());
    r.v.insert(r.v.end(), v.begin(), v.end());
    const SeqId batch[] = {id};
    const std::int32_t counts[] = {static_cast<std::int32_t>(n)};
    for (int l = 0; l < L.num_layers(); ++l) cache.append(batch, l, counts, rows_view(k.data(), n), rows_view(v.data(), n));
  };
  // A round: rows appended to every live sequence, one prefetch of the batch per layer, checked.
  auto round = [&](int max_rows) {
    for (SeqId id : live) append(id, std::uniform_int_distribution<std::int64_t>(1, max_rows)(rng));
    for (int l = 0; l < L.num_layers(); ++l) {
      CAPTURE(l);
      const int R = std::uniform_int_distribution<int>(1, 2)(rng);
      const auto q = test::random_rows<float>(rng, static_cast<std::size_t>(live.size()) * R * Hq * d);
      std::vector<std::vector<std::int32_t>> before;
      for (SeqId id : live) {
        for (int h = 0; h < Hk; ++h) {
          const auto b = cache.backend().planned_blocks(cache.block_table().find(id), l, h);
          before.emplace_back(b.begin(), b.end());
        }
      }
      const Ticket t = cache.prefetch(live, l, rows_view(q.data(), static_cast<std::int64_t>(live.size()) * R));
      // Admits per head: at most its fetch cap (its whole top-K on a first plan).
      for (std::size_t i = 0; i < live.size(); ++i) {
        for (int h = 0; h < Hk; ++h) {
          const auto after = cache.backend().planned_blocks(cache.block_table().find(live[i]), l, h);
          const auto& old = before[i * static_cast<std::size_t>(Hk) + static_cast<std::size_t>(h)];
          CHECK(static_cast<int>(after.size()) == L.head_selectable_blocks(l, h));
          int admits = 0;
          for (std::int32_t b : after) admits += b != kNoBlock && std::find(old.begin(), old.end(), b) == old.end();
          const bool first = std::all_of(old.begin(), old.end(), [](std::int32_t b) { return b == kNoBlock; });
          CHECK(admits <= (first ? L.head_selectable_blocks(l, h) : L.head_fetch_cap(l, h)));
        }
      }
      const LayerView<float> view = cache.acquire(t);
      std::set<std::int32_t> used;
      for (std::size_t i = 0; i < live.size(); ++i) {
        CAPTURE(live[i]);
        const std::int64_t n = cache.sequence_length(live[i], l);
        const std::vector<float> qi(q.begin() + static_cast<std::ptrdiff_t>(i * R * Hq * d),
                                    q.begin() + static_cast<std::ptrdiff_t>((i + 1) * R * Hq * d));
        // With a fetch cap the view lags the selection: only the pool and the rows are checked.
        if (ratio == 1.0) {
          check_view(view, L, l, i, rows[live[i]], n, qi, R, used);
        } else {
          for (int h = 0; h < Hk; ++h) {
            const std::size_t p = i * static_cast<std::size_t>(Hk) + static_cast<std::size_t>(h);
            CHECK(view.indptr[p + 1] - view.indptr[p] <= L.head_budget_blocks(l, h));
            for (std::int32_t e = view.indptr[p]; e < view.indptr[p + 1]; ++e) {
              REQUIRE(view.slot[e] < L.layer_slots(l));
              CHECK(used.insert(view.slot[e]).second);
              const std::int64_t t0 = static_cast<std::int64_t>(view.block[e]) * 16;
              CHECK(std::equal(view.keys(e), view.keys(e) + d, rows[live[i]].k.begin() + (t0 * Hk + h) * d));
            }
          }
        }
      }
      cache.release(t);
    }
  };
  round(400);  // the first plans: whole working sets
  for (int step = 0; step < 6; ++step) round(step % 2 ? 1 : 20);
  // Truncate one sequence, fork another from it, go on with all three.
  const std::int64_t cut = std::uniform_int_distribution<std::int64_t>(1, cache.sequence_length(1, 0) - 1)(rng);
  CAPTURE(cut);
  cache.truncate(1, cut);
  rows[1].k.resize(static_cast<std::size_t>(cut * Hk * d));
  rows[1].v.resize(static_cast<std::size_t>(cut * Hk * d));
  cache.fork(1, 3);
  rows[3] = rows[1];
  live = {1, 2, 3};
  for (int step = 0; step < 5; ++step) round(step == 0 ? 60 : 3);
  // Removing a sequence frees its slots for a new one.
  cache.remove_sequence(2);
  rows.erase(2);
  cache.add_sequence(4);
  live = {1, 3, 4};
  for (int step = 0; step < 3; ++step) round(step == 0 ? 300 : 2);
}
}  // namespace

TEST_CASE("a cache with budgets by layer and kv head selects, copies and views each head within its budget") {
  profiled_cache_rounds(1.0);
}

TEST_CASE("with budgets by layer and kv head, each head's admits stay within its own fetch cap") {
  profiled_cache_rounds(0.25);
}

// Admission into a cache with a profile: tests/test_remote_admission.cpp.
