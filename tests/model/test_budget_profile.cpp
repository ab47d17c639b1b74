// Budgets by layer and kv head on the real model (issue #13 part 2): with dense-first:1 at a total
// of 512 tokens per head on average, layer 0 holds every block of a 1,024-token GPL-3 prompt and
// its attention is exactly what a cache holding everything computes (the same bits), while the
// uniform 512 misses some of its mass; a calibrated profile is written, loads, and runs.
#include <doctest/doctest.h>

#include <unistd.h>

#include <filesystem>
#include <string>

#include <oasiskv/budget_profile.hpp>

#include "evaluation.hpp"
#include "model_fixture.hpp"

TEST_SUITE("model") {
  TEST_CASE("dense-first:1 makes layer 0 exact at budget 512 and a calibrated profile keeps the total and runs") {
    const auto& f = model_tests::model_fixture();
    const smollm2::LlamaModel model(*f.file, smollm2::WeightFormat::quantized_int8);  // fast: the test stays short
    smollm2::EvaluationOptions o;
    o.prompt_tokens = 1024;
    o.decode_tokens = 16;
    o.budgets = {512, 2048};  // 2048 > 1024 + 16: every block resident
    o.drafters = {"oracle"};
    o.fetch_ratios = {1.0};
    o.sink_tokens = {16};
    o.recent_tokens = {64};
    o.reductions = {oasiskv::GroupReduction::sum};
    const auto quiet = [](const std::string&) {};
    const auto uniform_runs = smollm2::evaluate(model, model_tests::gpl3_tokens(), o, quiet);
    REQUIRE(uniform_runs.runs.size() == 2);  // [budget]
    const auto& uniform = uniform_runs.runs[0];
    const auto& everything = uniform_runs.runs[1];
    REQUIRE(everything.budget == 2048);

    // Calibration: a profile for 512 from this window, written, then loaded by the run below.
    const std::string path =
        (std::filesystem::temp_directory_path() / ("oasiskv_calibrated_" + std::to_string(::getpid()) + ".txt")).string();
    smollm2::EvaluationOptions cal = o;
    cal.budgets = {512};
    cal.calibrate_profile = path;
    REQUIRE(smollm2::evaluate(model, model_tests::gpl3_tokens(), cal, quiet).runs.empty());
    const oasiskv::BudgetProfile p = oasiskv::BudgetProfile::load(path);
    CHECK(p.total_blocks() == 30 * 3 * 512 / 16);
    CHECK_FALSE(p.uniform());

    smollm2::EvaluationOptions run = o;
    run.budgets = {512};
    run.profiles = {"dense-first:1", path};
    const auto profiled = smollm2::evaluate(model, model_tests::gpl3_tokens(), run, quiet);
    std::filesystem::remove(path);
    REQUIRE(profiled.runs.size() == 2);  // [profile]
    const auto& dense_first = profiled.runs[0];
    const auto& calibrated = profiled.runs[1];
    REQUIRE(dense_first.profile == "dense-first:1");
    MESSAGE("layer 0 at 512: mass recall " << uniform.mass_recall_by_layer[0] << " uniform, "
                                           << dense_first.mass_recall_by_layer[0] << " dense-first:1; attention error "
                                           << uniform.attn_rel_err_by_layer[0] << " / "
                                           << dense_first.attn_rel_err_by_layer[0] << "; ppl " << uniform.ppl << " / "
                                           << dense_first.ppl << " / " << calibrated.ppl << " calibrated (dense "
                                           << uniform_runs.dense_ppl << "); best-k mass " << uniform.exact_topk_mass_mean
                                           << " / " << calibrated.exact_topk_mass_mean << " calibrated");
    CHECK(dense_first.mass_recall_by_layer[0] == doctest::Approx(1.0).epsilon(1e-6));
    CHECK(uniform.mass_recall_by_layer[0] < 0.999);
    // Layer 0 sees the same input in every run: with every block resident its attention is the
    // all-resident run's, bit for bit (what remains is the float rounding of the reference).
    CHECK(dense_first.attn_rel_err_by_layer[0] == everything.attn_rel_err_by_layer[0]);
    CHECK(dense_first.attn_rel_err_by_layer[0] < 1e-4);
    CHECK(uniform.attn_rel_err_by_layer[0] > 10 * dense_first.attn_rel_err_by_layer[0]);
    // Calibrated on this very window, the water-filling maximises the best-k mass: the best
    // resident sets of the calibrated budgets hold no less than the uniform split's.
    CHECK(calibrated.exact_topk_mass_mean >= uniform.exact_topk_mass_mean - 1e-3);
  }
}
