// With a budget that covers the whole context, every block is resident, so decoding through the
// OasisKV cache must reproduce the dense engine's logits (same keys, same order, same kernel).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>

#include "dense_attention.hpp"
#include "drafters.hpp"
#include "model_fixture.hpp"
#include "sparse_decoder.hpp"

namespace {

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, static_cast<double>(std::abs(a[i] - b[i])));
  return m;
}

}  // namespace

TEST_SUITE("model") {
  TEST_CASE("sparse decode with a budget covering the context reproduces dense logits") {
    const auto& f = model_tests::model_fixture();
    const auto& c = f.model->config();
    const auto text = model_tests::gpl3_tokens();
    constexpr int kPrompt = 200, kDecode = 12;
    const std::int64_t capacity = kPrompt + kDecode + 2;

    smollm2::DenseKv kv(c.num_layers, c.kv_width(), capacity);
    const auto pre = smollm2::prefill(*f.model, kv, std::span(text.data(), kPrompt));
    std::vector<std::vector<float>> dense;
    for (int t = 0; t < kDecode; ++t) dense.push_back(smollm2::dense_decode_step(*f.model, kv, text[kPrompt + t]));
    kv.truncate(kPrompt);

    oasiskv::CacheConfig config;
    config.shape = smollm2::model_shape(c);
    config.budget_tokens = 2048;  // > kPrompt + kDecode: everything resident
    config.sink_tokens = 16;
    config.recent_tokens = 64;
    config.max_sequences = 1;
    config.max_tokens_per_sequence = capacity;

    for (const bool lookahead : {true, false}) {
      CAPTURE(lookahead);
      smollm2::SparseSession session(*f.model, config, kv, kPrompt, capacity);
      if (lookahead)
        session.start(smollm2::dense_row_queries(*f.model, session.mirror(), text[kPrompt], kPrompt));
      else
        session.start(pre.last_queries);
      smollm2::StepMetrics metrics;
      for (int t = 0; t < kDecode; ++t) {
        std::optional<std::int32_t> draft;
        if (lookahead) draft = text[kPrompt + t + 1];  // the oracle's draft
        const auto logits = session.step(text[kPrompt + t], draft, &metrics);
        CAPTURE(t);
        // Same keys in the same (ascending token) order through the same kernel: bit-identical
        // in practice; the bound only allows for a different but equivalent kernel later.
        CHECK(max_abs_diff(logits, dense[t]) < 1e-4);
        for (double r : metrics.mass_recall) CHECK(r == doctest::Approx(1.0).epsilon(1e-5));
      }
    }
  }
}
