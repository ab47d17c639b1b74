// The evaluation measures what the product runs: ExperimentSession (experiments/smollm2) repeats
// OasisKvSession's protocol (examples/smollm2) with its mirror and measurements added, so the two
// must give bit-identical logits and fetch the same blocks, measurements on, for fp32 and fp16 rows,
// without a remainder and with each of the cache's estimates merged, through lookahead steps and
// through speculative forwards whose rejected drafts are truncated. A budget of 256 tokens over a
// 600-token prompt leaves most blocks out of the view, so the plans matter.
#include <doctest/doctest.h>

#include <cstring>
#include <optional>
#include <span>
#include <type_traits>
#include <vector>

#include "dense_attention.hpp"
#include "drafters.hpp"
#include "experiment_session.hpp"
#include "model_fixture.hpp"
#include "oasiskv_session.hpp"

namespace {

constexpr int kPrompt = 600, kSteps = 6, kForwards = 4, kDrafts = 3;

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

template <class T>
void check_same_decode(const smollm2::LlamaModel& model, oasiskv::RemainderEstimate remainder) {
  constexpr bool half = std::is_same_v<T, oasiskv::fp16_t>;
  const auto& c = model.config();
  const auto text = model_tests::gpl3_tokens();
  const std::int64_t capacity = kPrompt + kSteps + kForwards * (kDrafts + 1) + 2;
  smollm2::DenseKv kv(c.num_layers, c.kv_width(), capacity, half ? smollm2::KvPrecision::fp16 : smollm2::KvPrecision::fp32);
  const auto pre = smollm2::prefill(model, kv, std::span(text.data(), kPrompt));
  oasiskv::CacheConfig config;
  config.shape = smollm2::model_shape(c);
  config.budget_tokens = 256;
  config.max_sequences = 1;
  config.max_tokens_per_sequence = capacity;
  config.remainder = remainder;
  smollm2::NgramDrafter drafter;           // lookahead steps: a row only after a 2-3 token match
  smollm2::NgramDrafter every_step(0, 3);  // speculative forwards: kDrafts drafts each
  smollm2::StepMetrics metrics;

  {  // lookahead steps
    smollm2::OasisKvSession<T> product(model, config, kv, kPrompt);
    smollm2::ExperimentSession<T> experiment(model, config, kv, kPrompt, capacity);
    product.start(pre.last_queries);
    experiment.start(pre.last_queries);
    std::vector<std::int32_t> history(text.begin(), text.begin() + kPrompt);
    int drafted = 0;
    for (int s = 0; s < kSteps; ++s) {  // teacher-forced: the text's tokens, the n-gram drafter's drafts
      const std::int32_t token = text[static_cast<std::size_t>(kPrompt + s)];
      history.push_back(token);
      const std::optional<std::int32_t> draft = drafter.draft(history, -1);
      drafted += draft.has_value();
      CAPTURE(s);
      CHECK(same_bits(product.step(token, draft), experiment.step(token, draft, &metrics)));
    }
    // Steps of both kinds ran: two rows (a draft) and one (none).
    CHECK(drafted > 0);
    CHECK(drafted < kSteps);
    CHECK(product.cache().statistics().total().blocks_fetched ==
          experiment.cache().statistics().total().blocks_fetched);
  }

  {  // speculative forwards
    smollm2::OasisKvSession<T> product(model, config, kv, kPrompt);
    smollm2::ExperimentSession<T> experiment(model, config, kv, kPrompt, capacity);
    product.start(pre.last_queries, 1 + kDrafts);
    experiment.start(pre.last_queries, 1 + kDrafts);
    std::vector<std::int32_t> history(text.begin(), text.begin() + kPrompt);
    int t = kPrompt, rejected = 0;
    for (int f = 0; f < kForwards; ++f) {  // drafts that are not the text's next tokens are truncated
      history.push_back(text[static_cast<std::size_t>(t)]);
      std::vector<std::int32_t> drafts, scratch = history;
      for (int i = 0; i < kDrafts; ++i) scratch.push_back(drafts.emplace_back(every_step.draft(scratch, -1).value()));
      const auto a = product.speculate(text[static_cast<std::size_t>(t)], drafts);
      const auto b = experiment.speculate(text[static_cast<std::size_t>(t)], drafts, &metrics);
      int kept = 0;
      while (kept < kDrafts && drafts[static_cast<std::size_t>(kept)] == text[static_cast<std::size_t>(t + 1 + kept)]) ++kept;
      CAPTURE(f);
      REQUIRE(a.size() == b.size());
      for (std::size_t r = 0; r < a.size(); ++r) CHECK(same_bits(a[r], b[r]));
      product.accept(kept + 1, 1 + kDrafts);
      experiment.accept(kept + 1, 1 + kDrafts);
      CHECK(product.length() == experiment.length());
      rejected += kDrafts - kept;
      for (int r = 1; r <= kept; ++r) history.push_back(text[static_cast<std::size_t>(t + r)]);
      t += kept + 1;
    }
    CHECK(rejected > 0);  // the truncation ran
    CHECK(product.cache().statistics().total().blocks_fetched ==
          experiment.cache().statistics().total().blocks_fetched);
  }
}

}  // namespace

TEST_SUITE("model") {
  TEST_CASE("the experiment session decodes as OasisKvSession: the same logits and the same blocks fetched") {
    const auto& f = model_tests::model_fixture();
    const smollm2::LlamaModel model(*f.file, smollm2::WeightFormat::quantized_int8);  // fast: the test stays short
    for (const auto remainder : {oasiskv::RemainderEstimate::none, oasiskv::RemainderEstimate::clusters,
                                 oasiskv::RemainderEstimate::quantized}) {
      CAPTURE(oasiskv::remainder_name(remainder));
      check_same_decode<float>(model, remainder);
      check_same_decode<oasiskv::fp16_t>(model, remainder);
    }
  }
}
