// The fast path (weights kept Q4_1 / Q8_0 as in the file, AVX2 dot products) against the fp32
// reference path on the real model: the same weights summed in another order, so the logits agree
// to well under 1e-2 and greedy decoding gives the same tokens.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>

#include "dense_attention.hpp"
#include "model_fixture.hpp"
#include "reference_file.hpp"

namespace {

float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  float worst = 0.0f;
  for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(a[i] - b[i]));
  return worst;
}
std::int32_t argmax(const std::vector<float>& v) {
  return static_cast<std::int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

}  // namespace

TEST_SUITE("model") {
  TEST_CASE("the quantized fast path gives the reference path's logits within 1e-2 and its greedy tokens") {
    const auto& f = model_tests::model_fixture();
    const smollm2::LlamaModel fast(*f.file, smollm2::WeightFormat::quantized);
    const smollm2::LlamaModel& reference = *f.model;
    const auto& c = reference.config();
    auto tokens = model_tests::gpl3_tokens();
    tokens.resize(200);
    const int steps = 16;
    smollm2::DenseKv kv_ref(c.num_layers, c.kv_width(), 200 + steps), kv_fast(c.num_layers, c.kv_width(), 200 + steps);
    const auto pre_ref = smollm2::prefill(reference, kv_ref, tokens);
    const auto pre_fast = smollm2::prefill(fast, kv_fast, tokens);
    float worst = max_abs_diff(pre_ref.last_logits, pre_fast.last_logits);
    std::int32_t t_ref = argmax(pre_ref.last_logits), t_fast = argmax(pre_fast.last_logits);
    int same = t_ref == t_fast ? 1 : 0;
    for (int s = 0; s < steps && t_ref == t_fast; ++s) {
      const auto a = smollm2::dense_decode_step(reference, kv_ref, t_ref);
      const auto b = smollm2::dense_decode_step(fast, kv_fast, t_fast);
      worst = std::max(worst, max_abs_diff(a, b));
      t_ref = argmax(a);
      t_fast = argmax(b);
      same += t_ref == t_fast ? 1 : 0;
    }
    MESSAGE("fast vs reference path: max |logit diff| " << worst << " over a prefill of 200 tokens and " << steps
                                                          << " decode steps");
    CHECK(worst < 1e-2f);
    CHECK(same == steps + 1);
    // And against the independent numpy reference, as the reference path is.
    const auto cmp = smollm2::compare_with_reference(fast, smollm2::read_reference(model_tests::data_path("reference_gpl3.bin")));
    CHECK(cmp.max_abs_diff < 1e-2);
    CHECK(cmp.top1_matches);
  }
}
