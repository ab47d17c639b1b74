// The lookahead claim on real text: the oracle drafter's lookahead row (the true next token at
// the next position) predicts the next step's blocks at least as well as the previous-query
// baseline, measured over all 30 layers and 3 kv heads on >= 512 tokens of GPL-3.
#include <doctest/doctest.h>

#include "evaluation.hpp"
#include "model_fixture.hpp"

TEST_SUITE("model") {
  TEST_CASE("oracle lookahead matches or beats the previous-query baseline") {
    const auto& f = model_tests::model_fixture();
    smollm2::EvaluationOptions o;
    o.prompt_tokens = 768;  // real text, >= 512 tokens of context
    o.decode_tokens = 48;
    o.budgets = {256};      // 16 blocks: 1 sink + 5 recent-ring + 10 selected, so prediction matters
    o.drafters = {"oracle", "previous"};
    o.fetch_ratios = {1.0};
    // Pinned here rather than taken from CacheConfig's defaults, so that a change of defaults
    // does not silently change what this test asserts. Every GQA reduction must hold.
    o.sink_tokens = {16};
    o.recent_tokens = {64};
    o.reductions = {oasiskv::GroupReduction::max, oasiskv::GroupReduction::sum, oasiskv::GroupReduction::softmax_sum};
    const auto result = smollm2::evaluate(*f.model, model_tests::gpl3_tokens(), o, [](const std::string&) {});
    REQUIRE(result.runs.size() == 6);  // [drafter][reduction]
    for (std::size_t i = 0; i < 3; ++i) {
      const auto& oracle = result.runs[i];
      const auto& previous = result.runs[3 + i];
      REQUIRE(oracle.reduction == previous.reduction);
      CAPTURE(oasiskv::reduction_name(oracle.reduction));
      MESSAGE(oasiskv::reduction_name(oracle.reduction)
              << ": agreement oracle " << oracle.agreement_mean << " previous " << previous.agreement_mean
              << "; mass recall oracle " << oracle.mass_recall_mean << " previous " << previous.mass_recall_mean);
      // Measured (max, sum, softmax_sum): agreement 0.975/0.987/0.981 vs 0.706/0.790/0.777;
      // recall 0.871/0.880/0.878 vs 0.867/0.873/0.874. The recall margin is small: at this
      // budget the selector's proxy (Quest bound), not the prediction, limits recall.
      CHECK(oracle.agreement_mean >= previous.agreement_mean);
      CHECK(oracle.mass_recall_mean >= previous.mass_recall_mean);
      // The paper reports 98.7% for an EAGLE draft.
      CHECK(oracle.agreement_mean > 0.9);
      // Recall can never beat the best resident set of the same size.
      CHECK(oracle.mass_recall_mean <= oracle.exact_topk_mass_mean + 1e-9);
    }
  }
}
