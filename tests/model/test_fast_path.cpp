// The fast paths against the fp32 reference path on the real model, at every instruction-set
// level the CPU supports (ctest runs this binary once per level: tests/model/CMakeLists.txt).
// Both paths decode the reference's greedy tokens (teacher forcing), and each comparison is stated
// so that a near tie cannot decide it: a greedy token may differ only where the reference's lead
// is within what the path is allowed to move a logit.
// - quantized (Q4_1 / Q8_0 weights, fp32 activations, tiled attention): the same values summed in
//   another order, so the logits agree to well under 1e-2.
// - quantized-int8 (activations rounded to int8 per block of 32, as llama.cpp does): 8-bit
//   activations move logits by up to ~1.5, so it is held to what matters for decoding: greedy
//   tokens flipped only at near ties, and a next-token distribution within a small KL.
// - fp16 KV (dense and OasisKV caches): against the same path with fp32 KV.
// Each runs on 1 and on 2 engine threads (the results do not depend on the split).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>

#include "dense_attention.hpp"
#include "model_fixture.hpp"
#include "reference_file.hpp"
#include "oasiskv_session.hpp"
#include "thread_pool.hpp"

namespace {

float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  float worst = 0.0f;
  for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(a[i] - b[i]));
  return worst;
}
std::int32_t argmax(const std::vector<float>& v) {
  return static_cast<std::int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}
// KL(p_reference || p_fast) of the two softmax distributions, in nats.
double kl_divergence(const std::vector<float>& reference, const std::vector<float>& fast) {
  auto log_softmax = [](const std::vector<float>& x) {
    const double top = *std::max_element(x.begin(), x.end());
    double total = 0.0;
    for (float v : x) total += std::exp(v - top);
    std::vector<double> out(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) out[i] = x[i] - top - std::log(total);
    return out;
  };
  const auto p = log_softmax(reference), q = log_softmax(fast);
  double kl = 0.0;
  for (std::size_t i = 0; i < p.size(); ++i) kl += std::exp(p[i]) * (p[i] - q[i]);
  return kl;
}

struct Comparison {
  float max_diff = 0.0f;
  double max_kl = 0.0, total_kl = 0.0;
  int positions = 0;    // next-token distributions compared
  int same_tokens = 0;  // positions where both paths' greedy token is the same
  // Where they differ: the largest gap, in the reference's logits, between the reference's greedy
  // token and the fast path's (0 where none differ): how near a tie the flip was.
  float max_flip_margin = 0.0f;
};

// A prefill of 200 GPL-3 tokens and 16 decode steps on both models, both fed the reference path's
// greedy tokens (teacher forcing: a flip at a near tie does not send the two paths into different
// texts, so every one of the 17 positions is compared).
Comparison compare_paths(const smollm2::LlamaModel& reference, const smollm2::LlamaModel& fast,
                         smollm2::KvPrecision ref_kv, smollm2::KvPrecision fast_kv, int steps = 16) {
  const auto& c = reference.config();
  auto tokens = model_tests::gpl3_tokens();
  tokens.resize(200);
  smollm2::DenseKv kv_ref(c.num_layers, c.kv_width(), 200 + steps, ref_kv);
  smollm2::DenseKv kv_fast(c.num_layers, c.kv_width(), 200 + steps, fast_kv);
  const auto pre_ref = smollm2::prefill(reference, kv_ref, tokens);
  const auto pre_fast = smollm2::prefill(fast, kv_fast, tokens);
  Comparison out;
  const auto compare = [&](const std::vector<float>& a, const std::vector<float>& b) {
    out.max_diff = std::max(out.max_diff, max_abs_diff(a, b));
    out.max_kl = std::max(out.max_kl, kl_divergence(a, b));
    out.total_kl += kl_divergence(a, b);
    const std::int32_t t_ref = argmax(a), t_fast = argmax(b);
    out.positions += 1;
    out.same_tokens += t_ref == t_fast ? 1 : 0;
    out.max_flip_margin = std::max(out.max_flip_margin, a[t_ref] - a[t_fast]);
    return t_ref;
  };
  std::int32_t t = compare(pre_ref.last_logits, pre_fast.last_logits);
  for (int s = 0; s < steps; ++s) {
    const auto a = smollm2::dense_decode_step(reference, kv_ref, t);
    const auto b = smollm2::dense_decode_step(fast, kv_fast, t);
    t = compare(a, b);
  }
  return out;
}

struct ThreadsGuard {
  explicit ThreadsGuard(int n) { smollm2::set_engine_threads(n); }
  ~ThreadsGuard() { smollm2::set_engine_threads(1); }
};

}  // namespace

TEST_SUITE("model") {
  TEST_CASE("the quantized fast path gives the reference path's logits within 1e-2 and its greedy tokens") {
    const auto& f = model_tests::model_fixture();
    const smollm2::LlamaModel fast(*f.file, smollm2::WeightFormat::quantized);
    for (int threads : {1, 2}) {
      ThreadsGuard guard(threads);
      const auto r = compare_paths(*f.model, fast, smollm2::KvPrecision::fp32, smollm2::KvPrecision::fp32);
      MESSAGE("quantized vs reference path, " << threads << " thread(s): max |logit diff| " << r.max_diff << "; "
              << r.same_tokens << " of " << r.positions << " greedy tokens the same over a prefill of 200 tokens and "
              << "16 decode steps");
      CHECK(r.max_diff < 1e-2f);
      // Logits within 1e-2 keep every greedy token whose lead over the next is at least 2e-2; a
      // token may differ only where the reference nearly ties.
      CHECK(r.max_flip_margin < 2e-2f);
    }
    // And against the independent numpy reference, as the reference path is.
    const auto cmp = smollm2::compare_with_reference(fast, smollm2::read_reference(model_tests::data_path("reference_gpl3.bin")));
    CHECK(cmp.max_abs_diff < 1e-2);
    CHECK(cmp.max_mismatch_margin < 2e-2);  // a top-1 differs only at a tie within the tolerance
  }

  TEST_CASE("the int8-activation fast path keeps the reference path's greedy tokens and next-token distribution") {
    // 8-bit activations (llama.cpp's Q8_1 scheme) move single logits by up to ~1.5, so the greedy
    // token of two the reference nearly ties may flip, and which near tie flips depends on the
    // path's rounding (on the last -march=native build the EPYC's AVX2 path flipped the first of
    // the 17, at max |logit diff| 0.45, where the Xeon's AVX-512 path did not; this build flips one
    // position at scalar and two at avx2 and avx512, each where the reference leads by under 0.1,
    // and avx2 gives avx512's bits on every CPU). Required on every path:
    // flips only at near ties (the reference's lead under half a logit) and at no more than one
    // position in eight, as against the numpy reference below; the next-token distribution within
    // a KL of 1e-2 nats on average over the positions and 3e-2 at any one (single positions move
    // by 2x between levels: 0.006 at scalar, 0.013 at avx2 and avx512 at the same position).
    const auto& f = model_tests::model_fixture();
    const smollm2::LlamaModel fast(*f.file, smollm2::WeightFormat::quantized_int8);
    for (int threads : {1, 2}) {
      ThreadsGuard guard(threads);
      const auto r = compare_paths(*f.model, fast, smollm2::KvPrecision::fp32, smollm2::KvPrecision::fp32);
      MESSAGE("quantized-int8 vs reference path, " << threads << " thread(s): max |logit diff| " << r.max_diff
              << ", KL mean " << r.total_kl / r.positions << " max " << r.max_kl << " nats; " << r.same_tokens << " of "
              << r.positions << " greedy tokens the same, the reference's largest lead where not " << r.max_flip_margin);
      CHECK(r.max_flip_margin < 0.5f);
      CHECK((r.positions - r.same_tokens) * 8 <= r.positions);
      CHECK(r.total_kl / r.positions < 1e-2);
      CHECK(r.max_kl < 3e-2);
    }
    const auto cmp = smollm2::compare_with_reference(fast, smollm2::read_reference(model_tests::data_path("reference_gpl3.bin")));
    MESSAGE("quantized-int8 vs numpy reference: " << cmp.top1_mismatches << " of " << cmp.positions
            << " top-1 differ, largest reference margin there " << cmp.max_mismatch_margin << ", max |logit diff| " << cmp.max_abs_diff);
    CHECK(cmp.max_mismatch_margin < 0.5);
    CHECK(cmp.top1_mismatches * 8 <= cmp.positions);
  }

  TEST_CASE("fp16 KV gives the fp32-KV logits within 1e-1 and the same greedy tokens") {
    const auto& f = model_tests::model_fixture();
    const smollm2::LlamaModel fast(*f.file, smollm2::WeightFormat::quantized);
    ThreadsGuard guard(2);
    const auto r = compare_paths(fast, fast, smollm2::KvPrecision::fp32, smollm2::KvPrecision::fp16);
    MESSAGE("fp16 vs fp32 KV (quantized path): max |logit diff| " << r.max_diff << ", max KL " << r.max_kl << "; "
            << r.same_tokens << " of " << r.positions << " greedy tokens the same");
    CHECK(r.max_diff < 1e-1f);  // K and V rounded to 11 significant bits
    CHECK(r.max_flip_margin < 2e-1f);  // so a greedy token may differ only at a lead under 0.2
  }

  TEST_CASE("an fp16 OasisKV cache whose budget holds the whole context decodes as the fp16 dense cache") {
    const auto& f = model_tests::model_fixture();
    const smollm2::LlamaModel fast(*f.file, smollm2::WeightFormat::quantized);
    const auto& c = fast.config();
    ThreadsGuard guard(2);
    auto text = model_tests::gpl3_tokens();
    constexpr int kPrompt = 300, kSteps = 8;
    const std::int64_t capacity = kPrompt + kSteps + 2;
    smollm2::DenseKv kv(c.num_layers, c.kv_width(), capacity, smollm2::KvPrecision::fp16);
    const auto pre = smollm2::prefill(fast, kv, std::span(text.data(), kPrompt));
    std::vector<std::vector<float>> dense;
    for (int t = 0; t < kSteps; ++t) dense.push_back(smollm2::dense_decode_step(fast, kv, text[kPrompt + t]));
    kv.truncate(kPrompt);
    oasiskv::CacheConfig config;
    config.shape = smollm2::model_shape(c);
    config.budget_tokens = 512;  // >= every context of the run: every block resident
    config.max_sequences = 1;
    config.max_tokens_per_sequence = capacity;
    smollm2::OasisKvSession<oasiskv::fp16_t> session(fast, config, kv, kPrompt);
    session.start(pre.last_queries);
    float worst = 0.0f;
    for (int t = 0; t < kSteps; ++t) worst = std::max(worst, max_abs_diff(dense[t], session.step(text[kPrompt + t], {})));
    MESSAGE("fp16 OasisKV (whole context resident) vs fp16 dense: max |logit diff| " << worst);
    CHECK(worst < 1e-3f);  // the same rows and kernels; only the split of rows into blocks differs
    // The fp16 session refuses an fp32 prompt cache, naming both.
    smollm2::DenseKv kv32(c.num_layers, c.kv_width(), capacity);
    CHECK_THROWS_WITH_AS(smollm2::OasisKvSession<oasiskv::fp16_t>(fast, config, kv32, 0),
                         doctest::Contains("a cache of fp16 rows from a prompt DenseKv of fp32"), std::invalid_argument);
  }
}
