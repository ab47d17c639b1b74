// The remainder estimate on the real model: at a budget of 512 tokens over a 1,024-token GPL-3
// prompt, merging an estimate of the non-resident blocks lowers the attention output error
// against dense attention (the block centroid, from the evaluator's mirror, does; the cache's key
// clusters lower it more, its 4-bit rows most: so the test fails if an estimate is switched off
// or broken), the exact remainder (the ceiling)
// removes it, and with a budget that covers the context the remainder is exactly zero mass and
// changes nothing.
#include <doctest/doctest.h>

#include "evaluation.hpp"
#include "model_fixture.hpp"

TEST_SUITE("model") {
  TEST_CASE("the remainder estimate lowers the attention error at budget 512 and is zero mass when all is resident") {
    const auto& f = model_tests::model_fixture();
    const smollm2::LlamaModel model(*f.file, smollm2::WeightFormat::quantized_int8);  // fast: the test stays short
    smollm2::EvaluationOptions o;
    o.prompt_tokens = 1024;
    o.decode_tokens = 24;
    o.budgets = {512, 2048};  // 2048 > 1024 + 24: every block resident
    o.drafters = {"oracle"};
    o.fetch_ratios = {1.0};
    o.sink_tokens = {16};
    o.recent_tokens = {64};
    o.reductions = {oasiskv::GroupReduction::sum};
    // clusters: the prompt is one 1,024-row segment; quantized: 4-bit codes of every full block
    // mirror-groups:16: the block centroid from the evaluator's mirror of every row (what `clusters`
    // gives a segment it has not clustered; the cache's own `centroid` estimate was removed).
    o.remainders = {"none", "mirror-groups:16", "clusters", "quantized", "exact"};
    const auto result = smollm2::evaluate(model, model_tests::gpl3_tokens(), o, [](const std::string&) {});
    REQUIRE(result.runs.size() == 10);  // [budget][remainder]
    const auto& none = result.runs[0];
    const auto& estimate = result.runs[1];
    const auto& clusters = result.runs[2];
    const auto& quantized = result.runs[3];
    const auto& exact = result.runs[4];
    REQUIRE(estimate.remainder == "mirror-groups:16");
    MESSAGE("budget 512: attention error " << none.attn_rel_err_mean << " without, " << estimate.attn_rel_err_mean
                                            << " with the estimate, " << exact.attn_rel_err_mean << " exact; dropped mass "
                                            << estimate.dropped_mass_true_mean << " true, " << estimate.dropped_mass_est_mean
                                            << " estimated (correlation " << estimate.dropped_mass_corr << ")");
    CHECK(estimate.attn_rel_err_mean < none.attn_rel_err_mean);
    // Key clusters of the same size estimate better than the block centroid (docs/evaluation/remainder.md).
    REQUIRE(clusters.remainder == "clusters");
    MESSAGE("budget 512: attention error " << clusters.attn_rel_err_mean << " with key clusters");
    CHECK(clusters.attn_rel_err_mean < estimate.attn_rel_err_mean);
    // The non-resident rows at 4 bits (docs/evaluation/remainder.md): far closer than any mean-based
    // estimate, a few times the exact ceiling's rounding.
    REQUIRE(quantized.remainder == "quantized");
    MESSAGE("budget 512: attention error " << quantized.attn_rel_err_mean << " with 4-bit rows; dropped mass "
                                            << quantized.dropped_mass_est_mean << " estimated");
    CHECK(quantized.attn_rel_err_mean < 0.5 * clusters.attn_rel_err_mean);
    CHECK(quantized.dropped_mass_corr > 0.99);
    CHECK(exact.attn_rel_err_mean < 1e-3);  // the exact remainder restores dense attention (float rounding)
    // The estimate sees something of what is dropped, and follows it.
    CHECK(estimate.dropped_mass_est_mean > 0.0);
    CHECK(estimate.dropped_mass_corr > 0.5);
    for (std::size_t i = 5; i < 10; ++i) {
      const auto& run = result.runs[i];
      CAPTURE(run.remainder);
      CHECK(run.mass_recall_mean == doctest::Approx(1.0).epsilon(1e-5));
      if (run.remainder != "none") {
        CHECK(run.dropped_mass_est_mean == 0.0);  // exactly: lse = -inf for every head and step
        CHECK(run.attn_rel_err_mean == result.runs[5].attn_rel_err_mean);  // the merge changed no bit
        CHECK(run.ppl == result.runs[5].ppl);
      }
    }
  }
}

TEST_SUITE("model") {
  // With the quantized remainder the blocks a fetch cap holds back are still counted (at low
  // precision), so a capped selection keeps the attention error of the uncapped one, far below the
  // error without the remainder, while fetching fewer blocks: the configuration docs/evaluation/remainder.md gives for
  // decode close to dense (remainder = quantized with fetch_ratio 0.1).
  TEST_CASE("with the quantized remainder a fetch cap of 0.1 fetches fewer blocks and keeps the attention error") {
    const auto& f = model_tests::model_fixture();
    const smollm2::LlamaModel model(*f.file, smollm2::WeightFormat::quantized_int8);
    smollm2::EvaluationOptions o;
    o.prompt_tokens = 1024;
    o.decode_tokens = 24;
    o.budgets = {512};
    o.drafters = {"oracle"};
    o.fetch_ratios = {1.0, 0.1};
    o.sink_tokens = {16};
    o.recent_tokens = {64};
    o.reductions = {oasiskv::GroupReduction::sum};
    o.remainders = {"none", "quantized"};
    const auto result = smollm2::evaluate(model, model_tests::gpl3_tokens(), o, [](const std::string&) {});
    REQUIRE(result.runs.size() == 4);  // [fetch ratio][remainder]
    const auto& none = result.runs[0];
    const auto& uncapped = result.runs[1];
    const auto& none_capped = result.runs[2];
    const auto& capped = result.runs[3];
    REQUIRE(none.remainder == "none");
    REQUIRE(capped.remainder == "quantized");
    REQUIRE(capped.fetch_ratio == 0.1);
    MESSAGE("blocks per step: none " << none.blocks_fetched_per_step << ", none capped "
                                     << none_capped.blocks_fetched_per_step << ", quantized capped "
                                     << capped.blocks_fetched_per_step << "; attention error: none " << none.attn_rel_err_mean
                                     << ", none capped " << none_capped.attn_rel_err_mean << ", quantized "
                                     << uncapped.attn_rel_err_mean << ", quantized capped " << capped.attn_rel_err_mean);
    CHECK(capped.blocks_fetched_per_step < 0.8 * none.blocks_fetched_per_step);
    CHECK(capped.attn_rel_err_mean < 0.5 * none.attn_rel_err_mean);
    CHECK(capped.attn_rel_err_mean < 1.1 * uncapped.attn_rel_err_mean);  // the cap costs the remainder next to nothing
  }
}
