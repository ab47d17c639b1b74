// The CPU kernels (detail/cpu_kernels.hpp) against simple scalar references, bit for bit: every
// kernel runs both its fastest version at the level in use and its portable one
// (set_simd_enabled). ctest runs this binary once per level the CPU supports
// (tests/kernels/CMakeLists.txt), so every vector version is compared on any machine.
#include <oasiskv/cpu/isa.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "reference_selection.hpp"
#include "support.hpp"

using namespace oasiskv;

namespace {

// The fp16 conversion as it was written first (a loop normalises subnormals): the reference.
float reference_to_float(fp16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h.bits & 0x8000u) << 16;
  const std::uint32_t exp = (h.bits >> 10) & 0x1fu;
  std::uint32_t mant = h.bits & 0x3ffu;
  std::uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {
    std::uint32_t e = 113;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --e;
    }
    bits = sign | (e << 23) | ((mant & 0x3ffu) << 13);
  }
  return std::bit_cast<float>(bits);
}
float reference_to_float(bf16_t b) { return to_float(b); }
float reference_to_float(float f) { return f; }

std::uint32_t bits_of(float f) { return std::bit_cast<std::uint32_t>(f); }

// Restores the default (SIMD on) when a test ends, whatever happened.
struct SimdMode {
  explicit SimdMode(bool on) { detail::set_simd_enabled(on); }
  ~SimdMode() { detail::set_simd_enabled(true); }
};

// The fold as SummaryStore::add_key wrote it before it had a kernel.
template <class T>
void reference_fold(float* mx, float* mn, const T* key, int d, bool reset) {
  for (int i = 0; i < d; ++i) {
    const float k = reference_to_float(key[i]);
    if (reset) {
      mx[i] = mn[i] = k;
    } else {
      mx[i] = std::max(mx[i], k);
      mn[i] = std::min(mn[i], k);
    }
  }
}

// Random keys of type T with specials mixed in: every fp16 class (subnormals, +-0, +-inf, quiet
// and signalling NaNs with payloads) as raw bits; for float and bf16 their own specials.
template <class T>
std::vector<T> special_keys(std::mt19937_64& rng, std::size_t n) {
  std::vector<T> out(n);
  std::uniform_int_distribution<std::uint32_t> any16(0, 0xffff);
  std::uniform_int_distribution<int> pick(0, 9);
  for (auto& x : out) {
    const int p = pick(rng);
    if constexpr (std::is_same_v<T, float>) {
      const float specials[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, std::numeric_limits<float>::denorm_min(), 1e-40f};
      x = p < 3 ? specials[any16(rng) % 7] : std::normal_distribution<float>(0.0f, 3.0f)(rng);
    } else if (p < 4) {
      x = T{static_cast<std::uint16_t>(any16(rng))};  // any bit pattern, NaNs included
    } else if constexpr (std::is_same_v<T, fp16_t>) {
      // Subnormals and zeros of either sign.
      x = p < 6 ? T{static_cast<std::uint16_t>((any16(rng) & 0x83ffu))} : from_float<T>(std::normal_distribution<float>()(rng));
    } else {
      x = from_float<T>(std::normal_distribution<float>(0.0f, 3.0f)(rng));
    }
  }
  return out;
}

template <class T>
void check_fold(std::mt19937_64& rng) {
  for (int d : {1, 5, 7, 8, 9, 16, 24, 31, 64, 100, 128, 129}) {
    const int rows = 20;
    const auto keys = special_keys<T>(rng, static_cast<std::size_t>(rows * d));
    for (bool simd : {true, false}) {
      SimdMode mode(simd);
      std::vector<float> mx(static_cast<std::size_t>(d)), mn(mx.size()), rmx(mx.size()), rmn(mx.size());
      for (int r = 0; r < rows; ++r) {
        const bool reset = r % 16 == 0;
        const T* key = keys.data() + static_cast<std::ptrdiff_t>(r) * d;
        detail::fold_key(mx.data(), mn.data(), key, d, reset);
        reference_fold(rmx.data(), rmn.data(), key, d, reset);
        for (int i = 0; i < d; ++i) {
          INFO("d = " << d << " row " << r << " channel " << i << " simd " << simd);
          REQUIRE(bits_of(mx[static_cast<std::size_t>(i)]) == bits_of(rmx[static_cast<std::size_t>(i)]));
          REQUIRE(bits_of(mn[static_cast<std::size_t>(i)]) == bits_of(rmn[static_cast<std::size_t>(i)]));
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("fp16 to float: every bit pattern as the reference conversion, payloads and subnormals included") {
  for (std::uint32_t b = 0; b < 0x10000u; ++b) {
    const fp16_t h{static_cast<std::uint16_t>(b)};
    INFO("bits " << b);
    REQUIRE(bits_of(to_float(h)) == bits_of(reference_to_float(h)));
  }
}

TEST_CASE("fold_key: every fp16 bit pattern, as a block's first row and folded, as the scalar fold") {
  std::vector<fp16_t> all(0x10000);
  for (std::uint32_t b = 0; b < 0x10000u; ++b) all[b].bits = static_cast<std::uint16_t>(b);
  for (bool simd : {true, false}) {
    SimdMode mode(simd);
    const int d = 128;
    std::vector<float> mx(d), mn(d), rmx(d), rmn(d);
    for (std::size_t r = 0; r < all.size() / d; ++r) {
      const bool reset = r % 16 == 0;
      detail::fold_key(mx.data(), mn.data(), all.data() + r * d, d, reset);
      reference_fold(rmx.data(), rmn.data(), all.data() + r * d, d, reset);
      REQUIRE(std::memcmp(mx.data(), rmx.data(), d * sizeof(float)) == 0);
      REQUIRE(std::memcmp(mn.data(), rmn.data(), d * sizeof(float)) == 0);
    }
  }
}

TEST_CASE("fold_key: random keys with specials, odd head dims, every dtype, as the scalar fold") {
  OASISKV_SEEDED_RNG(rng);
  check_fold<fp16_t>(rng);
  check_fold<bf16_t>(rng);
  check_fold<float>(rng);
}

namespace {

// A normal value of standard deviation `scale`; kind 1: a zero of either sign 30% of the time,
// 2: huge (products overflow), 3: tiny (products underflow), else as drawn.
float special_value(std::mt19937_64& rng, int kind, float scale) {
  std::normal_distribution<float> n(0.0f, scale);
  if (kind == 1 && std::bernoulli_distribution(0.3)(rng)) return std::bernoulli_distribution(0.5)(rng) ? 0.0f : -0.0f;
  if (kind == 2) return n(rng) * 1e37f;
  if (kind == 3) return n(rng) * 1e-30f;
  return n(rng);
}

}  // namespace

TEST_CASE("quest_bound_blocks: bit for bit quest_bound per block and query, odd sizes and specials") {
  OASISKV_SEEDED_RNG(rng);
  for (int trial = 0; trial < 300; ++trial) {
    const int d = std::vector<int>{1, 3, 7, 8, 9, 15, 16, 17, 24, 64, 100, 128, 129}[static_cast<std::size_t>(trial % 13)];
    const int nq = std::uniform_int_distribution<int>(1, 9)(rng);
    const std::int64_t blocks = std::uniform_int_distribution<std::int64_t>(1, 13)(rng);
    // Summaries folded from 16 keys a block (max >= min, as add_key makes them); some trials with
    // zeros of both signs, huge values whose products overflow, and tiny ones whose products
    // underflow.
    const int kind = trial % 4;
    auto value = [&](float scale) { return special_value(rng, kind, scale); };
    const std::vector<float> summaries =
        test::random_summaries(static_cast<std::size_t>(blocks), d, 16, [&] { return value(2.0f); });
    std::vector<float> queries(static_cast<std::size_t>(nq * d));
    for (auto& q : queries) q = value(1.0f);
    for (bool simd : {true, false}) {
      SimdMode mode(simd);
      std::vector<float> out(static_cast<std::size_t>(blocks * nq), -1.0f);
      detail::quest_bound_blocks(summaries.data(), blocks, queries.data(), nq, d, out.data());
      for (std::int64_t b = 0; b < blocks; ++b) {
        const float* mx = summaries.data() + b * 2 * d;
        for (int q = 0; q < nq; ++q) {
          const float expected = quest_bound(queries.data() + q * d, mx, mx + d, d);
          INFO("d " << d << " nq " << nq << " block " << b << " query " << q << " simd " << simd << " kind " << kind);
          REQUIRE(bits_of(out[static_cast<std::size_t>(b * nq + q)]) == bits_of(expected));
        }
      }
    }
  }
}

// The scorers' constants as a config makes them (alpha, softmax scale of head dim d).
ScoreParams params_for(BlockScore kind, float alpha, int d) {
  CacheConfig c = test::small_config();
  c.shape.head_dim = d;
  c.scorer = kind;
  c.spread_alpha = alpha;
  return CacheLayout::from(c).score;
}

TEST_CASE("score_blocks: quest and spread bit for bit their scalar scores and the reference, odd sizes and specials") {
  OASISKV_SEEDED_RNG(rng);
  for (int trial = 0; trial < 400; ++trial) {
    const int d = std::vector<int>{1, 3, 7, 8, 9, 15, 16, 17, 24, 64, 100, 128, 129}[static_cast<std::size_t>(trial % 13)];
    const int nq = std::uniform_int_distribution<int>(1, 9)(rng);
    const std::int64_t blocks = std::uniform_int_distribution<std::int64_t>(1, 13)(rng);
    const BlockScore kind = trial % 3 == 0 ? BlockScore::quest : BlockScore::spread;
    const float alpha = std::uniform_real_distribution<float>(0.0f, 1.0f)(rng);
    const ScoreParams p = params_for(kind, alpha, d);
    // As quest_bound_blocks' test: zeros of both signs, overflowing and underflowing products.
    const int special = (trial / 3) % 4;
    auto value = [&](float scale) { return special_value(rng, special, scale); };
    const std::vector<float> summaries =
        test::random_summaries(static_cast<std::size_t>(blocks), d, 16, [&] { return value(2.0f); });
    std::vector<float> queries(static_cast<std::size_t>(nq * d));
    for (auto& q : queries) q = value(1.0f);
    for (bool simd : {true, false}) {
      SimdMode mode(simd);
      std::vector<float> out(static_cast<std::size_t>(blocks * nq), -1.0f);
      detail::score_blocks(p, summaries.data(), blocks, queries.data(), nq, d, out.data());
      for (std::int64_t b = 0; b < blocks; ++b) {
        const float* mx = summaries.data() + b * 2 * d;
        for (int q = 0; q < nq; ++q) {
          const float* qv = queries.data() + q * d;
          const float scalar = ConfiguredScorer{p}.score(qv, mx, d);
          INFO("scorer " << block_score_name(kind) << " d " << d << " nq " << nq << " block " << b << " query " << q
                         << " simd " << simd << " special " << special);
          REQUIRE(bits_of(out[static_cast<std::size_t>(b * nq + q)]) == bits_of(scalar));
          REQUIRE(bits_of(scalar) == bits_of(test::reference_score(p, qv, mx, mx + d, d)));
        }
      }
    }
  }
}

TEST_CASE("scorers: the formulas in double precision, alpha 1 is Quest's bound and 0 the centre") {
  OASISKV_SEEDED_RNG(rng);
  for (int trial = 0; trial < 200; ++trial) {
    const int d = std::uniform_int_distribution<int>(1, 130)(rng);
    const float alpha = std::uniform_real_distribution<float>(0.0f, 1.0f)(rng);
    std::vector<float> mx(static_cast<std::size_t>(d)), mn(static_cast<std::size_t>(d)), q(static_cast<std::size_t>(d)),
        summary;
    std::normal_distribution<float> n(0.0f, 2.0f);
    for (int i = 0; i < d; ++i) {
      const float a = n(rng), b = n(rng);
      mx[static_cast<std::size_t>(i)] = std::max(a, b);
      mn[static_cast<std::size_t>(i)] = std::min(a, b);
      q[static_cast<std::size_t>(i)] = n(rng) * (trial % 2 == 0 ? 1.0f : 8.0f);  // large q: the clamp binds
    }
    summary.insert(summary.end(), mx.begin(), mx.end());
    summary.insert(summary.end(), mn.begin(), mn.end());
    double centre = 0, range = 0, bound = 0, mag = 0;
    for (std::size_t i = 0; i < q.size(); ++i) {
      const double c = 0.5 * (static_cast<double>(mx[i]) + mn[i]), r = static_cast<double>(mx[i]) - mn[i];
      centre += q[i] * c;
      range += std::fabs(q[i]) * r;
      bound += std::max(static_cast<double>(q[i]) * mx[i], static_cast<double>(q[i]) * mn[i]);
      mag += std::fabs(q[i]) * (std::fabs(mx[i]) + std::fabs(mn[i]));
    }
    const double tol = 1e-5 * (mag + 1.0);
    const float spread = SpreadBound::from(CacheLayout::from([&] {
                           CacheConfig c = test::small_config();
                           c.shape.head_dim = d;
                           c.spread_alpha = alpha;
                           return c;
                         }())).score(q.data(), summary.data(), d);
    CHECK(std::fabs(spread - (centre + alpha * 0.5 * range)) <= tol);
    CHECK(std::fabs(SpreadBound{0.5f}.score(q.data(), summary.data(), d) - bound) <= tol);  // alpha 1
    CHECK(std::fabs(SpreadBound{0.0f}.score(q.data(), summary.data(), d) - centre) <= tol);  // alpha 0
  }
}

namespace {
// The configured scorer through the reference formulas and without ScoreParams: the selector's
// generic scorer path, the reference for its kernel path.
struct GenericScorer {
  ScoreParams p;
  static constexpr int summary_floats(int head_dim) noexcept { return 2 * head_dim; }
  float score(const float* q, const float* summary, int head_dim) const noexcept {
    return test::reference_score(p, q, summary, summary + head_dim, head_dim);
  }
  float softmax_scale(const CacheLayout& layout) const noexcept { return layout.softmax_scale; }
};
static_assert(BlockScorer<GenericScorer>);
}  // namespace

TEST_CASE("LookaheadSelector::score: the kernel path equals the generic scorer path, every scorer and reduction") {
  OASISKV_SEEDED_RNG(rng);
  for (BlockScore scorer : {BlockScore::quest, BlockScore::spread}) {
    for (GroupReduction reduction : {GroupReduction::sum, GroupReduction::max, GroupReduction::softmax_sum}) {
      CacheConfig c = test::small_config(128, 2048, 1);
      c.shape.head_dim = 40;  // 5 lanes' worth of vectors
      c.reduction = reduction;
      c.scorer = scorer;
      c.spread_alpha = 0.4f;
      const CacheLayout layout = CacheLayout::from(c);
      SummaryStore summaries(layout);
      const int d = c.shape.head_dim;
      const std::int64_t rows = 16 * 37 + 5;
      const auto keys = test::random_rows<fp16_t>(rng, static_cast<std::size_t>(rows * d), 2.0f);
      for (std::int64_t t = 0; t < rows; ++t) summaries.add_key(0, 1, 1, t, keys.data() + t * d);
      for (int nq : {1, 2, 3, 4, 5, 8}) {
        const auto queries = test::random_rows<float>(rng, static_cast<std::size_t>(nq * d));
        for (bool simd : {true, false}) {
          SimdMode mode(simd);
          std::vector<float> fast, generic;
          LookaheadSelector(layout).score(summaries, 0, 1, 1, 1, layout.blocks_for(rows), queries.data(), nq, fast);
          BasicLookaheadSelector<GenericScorer>(layout, GenericScorer{layout.score})
              .score(summaries, 0, 1, 1, 1, layout.blocks_for(rows), queries.data(), nq, generic);
          INFO("scorer " << block_score_name(scorer) << " reduction " << reduction_name(reduction) << " nq " << nq
                         << " simd " << simd);
          REQUIRE(fast.size() == generic.size());
          REQUIRE(std::memcmp(fast.data(), generic.data(), fast.size() * sizeof(float)) == 0);
        }
      }
    }
  }
}

TEST_CASE("select_top_k on large inputs (the sampled path): as the brute force, ties, NaNs, zeros, order") {
  OASISKV_SEEDED_RNG(rng);
  for (int trial = 0; trial < 400; ++trial) {
    const int n = std::uniform_int_distribution<int>(1, 6000)(rng);
    const int k = trial % 5 == 0 ? std::uniform_int_distribution<int>(0, n + 3)(rng)
                                 : std::uniform_int_distribution<int>(1, std::max(1, n / (trial % 2 ? 12 : 4)))(rng);
    std::vector<float> scores(static_cast<std::size_t>(n));
    const int kind = trial % 7;
    for (std::size_t i = 0; i < scores.size(); ++i) {
      float& s = scores[i];
      switch (kind) {
        case 0: s = std::normal_distribution<float>()(rng); break;
        case 1: s = static_cast<float>(std::uniform_int_distribution<int>(0, 3)(rng)); break;  // heavy ties
        case 2: s = static_cast<float>(i); break;                                            // ascending
        case 3: s = -static_cast<float>(i); break;                                           // descending
        case 4: {  // specials among numbers
          const float special[] = {NAN, -NAN, INFINITY, -INFINITY, 0.0f, -0.0f};
          s = std::bernoulli_distribution(0.3)(rng) ? special[std::uniform_int_distribution<int>(0, 5)(rng)]
                                                   : std::normal_distribution<float>()(rng);
          break;
        }
        case 5: s = std::bernoulli_distribution(0.9)(rng) ? NAN : std::normal_distribution<float>()(rng); break;
        default: s = std::bernoulli_distribution(0.5)(rng) ? 0.0f : -0.0f; break;  // zeros only
      }
    }
    const std::int64_t first = std::uniform_int_distribution<int>(0, 9)(rng);
    const auto expected = test::brute_top_k(scores, first, k);
    for (bool simd : {true, false}) {
      SimdMode mode(simd);
      std::vector<std::int32_t> got{42, 43};  // stale contents must not survive
      LookaheadSelector::top_k(scores, first, k, got);
      INFO("n " << n << " k " << k << " kind " << kind << " simd " << simd);
      REQUIRE(got == expected);
    }
  }
}

TEST_CASE("copy_blocks: small and streamed batches, unaligned and odd sizes, copy every byte") {
  OASISKV_SEEDED_RNG(rng);
  for (int trial = 0; trial < 40; ++trial) {
    const std::size_t count = std::uniform_int_distribution<std::size_t>(1, trial % 2 ? 8 : 90)(rng);
    std::vector<std::size_t> sizes(count);
    for (auto& s : sizes) s = trial % 3 == 0 ? 8192 : std::uniform_int_distribution<std::size_t>(0, 20000)(rng);
    std::size_t total = 0;
    for (std::size_t s : sizes) total += s + 64;
    std::vector<unsigned char> src(total), dst(total + 64, 0xee), expected(total + 64, 0xee);
    for (auto& b : src) b = static_cast<unsigned char>(rng());
    std::vector<BlockCopy> copies;
    std::size_t at = 0;
    for (std::size_t s : sizes) {
      const std::size_t so = at + rng() % 32, dofs = at + rng() % 32;  // unaligned both sides
      copies.push_back(BlockCopy{src.data() + so, dst.data() + dofs, s});
      std::memcpy(expected.data() + dofs, src.data() + so, s);
      at += s + 64;
    }
    for (bool simd : {true, false}) {
      SimdMode mode(simd);
      std::fill(dst.begin(), dst.end(), 0xee);
      detail::copy_blocks(copies);
      INFO("trial " << trial << " simd " << simd << " bytes " << total);
      REQUIRE(dst == expected);
    }
  }
}

TEST_CASE("find_non_finite, scalar and vectorised: the first hit at and around every chunk boundary") {
  for (std::size_t n : {1u, 63u, 64u, 65u, 127u, 128u, 129u, 255u, 256u, 257u, 300u, 1000u}) {
    for (std::size_t at = 0; at < n; at += (at < 70 || (at > 120 && at < 136) || (at > 250 && at < 262) ? 1 : 17)) {
      std::vector<float> f(n, 1.0f);
      std::vector<fp16_t> h(n, to_fp16(1.0f));
      std::vector<bf16_t> b(n, to_bf16(1.0f));
      f[at] = INFINITY;
      h[at] = to_fp16(INFINITY);
      b[at] = to_bf16(NAN);
      if (at + 1 < n) {  // a later hit in the same chunk must not win
        f[at + 1] = NAN;
        h[at + 1] = to_fp16(NAN);
        b[at + 1] = to_bf16(-INFINITY);
      }
      INFO("n " << n << " at " << at);
      const auto expected = static_cast<std::int64_t>(at);
      CHECK(find_non_finite(f.data(), DType::f32, n) == expected);
      CHECK(find_non_finite(h.data(), DType::f16, n) == expected);
      CHECK(find_non_finite(b.data(), DType::bf16, n) == expected);
      for (bool simd : {true, false}) {
        SimdMode mode(simd);
        CHECK(detail::find_non_finite(f.data(), DType::f32, n) == expected);
        CHECK(detail::find_non_finite(h.data(), DType::f16, n) == expected);
        CHECK(detail::find_non_finite(b.data(), DType::bf16, n) == expected);
      }
    }
    // Clean rows of extreme finite values: nothing found.
    std::vector<fp16_t> clean(n, to_fp16(-65504.0f));
    std::vector<float> cleanf(n, -3.4e38f);
    std::vector<bf16_t> cleanb(n, to_bf16(3.3e38f));
    CHECK(find_non_finite(clean.data(), DType::f16, n) == -1);
    CHECK(detail::find_non_finite(clean.data(), DType::f16, n) == -1);
    CHECK(detail::find_non_finite(cleanf.data(), DType::f32, n) == -1);
    CHECK(detail::find_non_finite(cleanb.data(), DType::bf16, n) == -1);
  }
}

namespace {
template <class T>
void check_append_rows(std::mt19937_64& rng) {
  for (int trial = 0; trial < 60; ++trial) {
    const int d = std::vector<int>{8, 13, 32, 64, 128, 129}[static_cast<std::size_t>(trial % 6)];
    const int rows = std::uniform_int_distribution<int>(1, 16)(rng);
    const int heads = 3;
    const bool pinned = trial % 3 != 0, reset = trial % 2 == 0;
    // Host blocks 64-byte aligned in some trials (the streaming path where rows are whole lines),
    // one element off in the others (the plain path). Head strides with a gap, as a pool's.
    const std::size_t shift = trial % 4 < 2 ? 0 : 1;
    const std::int64_t block = 2 * 16 * d, host_stride = block + 32, slot_stride = 2 * block, summary_stride = 3 * d;
    const auto in = special_keys<T>(rng, static_cast<std::size_t>(2 * rows * heads * d));
    for (bool simd : {true, false}) {
      SimdMode mode(simd);
      const std::size_t host_elems = static_cast<std::size_t>(heads * host_stride) + 64;
      const std::size_t slot_elems = static_cast<std::size_t>(heads * slot_stride) + 64;
      std::vector<T> host[2], slot[2];
      std::vector<float> summary[2];
      for (int c = 0; c < 2; ++c) {
        host[c].assign(host_elems, from_float<T>(7.0f));
        slot[c].assign(slot_elems, from_float<T>(9.0f));
      }
      summary[0].resize(static_cast<std::size_t>(heads * summary_stride));
      for (auto& x : summary[0]) x = std::normal_distribution<float>()(rng);
      summary[1] = summary[0];
      // The first 64-byte boundary in host[0], then shift elements.
      const auto align = [&](std::vector<T>& v) {
        const auto off = (64 - reinterpret_cast<std::uintptr_t>(v.data()) % 64) % 64;
        return v.data() + (off % sizeof(T) == 0 ? off / sizeof(T) : 0) + shift;
      };
      T* base[2] = {align(host[0]), host[1].data() + (align(host[0]) - host[0].data())};
      detail::AppendRows<T> a;
      a.key = in.data();
      a.value = in.data() + static_cast<std::size_t>(rows * heads * d);
      a.row_stride = static_cast<std::int64_t>(heads) * d;
      a.rows = rows;
      a.heads = heads;
      a.d = d;
      a.value_offset = 16 * d;
      a.host = base[0];
      a.host_head_stride = host_stride;
      a.slot = pinned ? slot[0].data() + 1 : nullptr;
      a.slot_head_stride = slot_stride;
      a.summary = summary[0].data();
      a.summary_head_stride = summary_stride;
      a.reset_first = reset;
      detail::append_rows(a);
      detail::stream_fence();
      for (int h = 0; h < heads; ++h) {  // the reference: copies and the scalar fold
        for (int r = 0; r < rows; ++r) {
          const T* k = a.key + r * a.row_stride + h * d;
          const T* v = a.value + r * a.row_stride + h * d;
          T* hb = base[1] + h * host_stride + r * d;
          std::memcpy(hb, k, d * sizeof(T));
          std::memcpy(hb + 16 * d, v, d * sizeof(T));
          if (pinned) {
            T* sb = slot[1].data() + 1 + h * slot_stride + r * d;
            std::memcpy(sb, k, d * sizeof(T));
            std::memcpy(sb + 16 * d, v, d * sizeof(T));
          }
          float* mx = summary[1].data() + h * summary_stride;
          reference_fold(mx, mx + d, k, d, reset && r == 0);
        }
      }
      INFO("d " << d << " rows " << rows << " pinned " << pinned << " shift " << shift << " simd " << simd);
      REQUIRE(std::memcmp(host[0].data(), host[1].data(), host_elems * sizeof(T)) == 0);
      REQUIRE(std::memcmp(slot[0].data(), slot[1].data(), slot_elems * sizeof(T)) == 0);
      REQUIRE(std::memcmp(summary[0].data(), summary[1].data(), summary[0].size() * sizeof(float)) == 0);
    }
  }
}
}  // namespace

TEST_CASE("append_rows: host rows (streamed or not), slot rows and the fold, as copies and the scalar fold") {
  OASISKV_SEEDED_RNG(rng);
  check_append_rows<fp16_t>(rng);
  check_append_rows<bf16_t>(rng);
  check_append_rows<float>(rng);
}
