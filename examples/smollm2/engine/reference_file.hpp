// Reads the file written by tools/model_reference/reference.py (format documented there) and
// compares the engine's logits with it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "llama_model.hpp"

namespace smollm2 {

struct ReferenceLogits {
  struct Position {
    std::int32_t position = 0;
    float log_sum_exp = 0.0f;
    std::vector<std::int32_t> ids;
    std::vector<float> logits;
  };
  std::vector<std::int32_t> prompt;
  std::vector<Position> positions;
  std::vector<std::int32_t> text_tokens;  // reference tokenisation of the whole text
};

ReferenceLogits read_reference(const std::string& path);

struct LogitComparison {
  double max_abs_diff = 0.0;       // over the stored logits
  double max_abs_logit = 0.0;      // scale of the stored logits
  double max_log_prob_diff = 0.0;  // log-softmax values (uses the stored log-sum-exp)
  bool top1_matches = true;
  int positions = 0;                    // positions compared
  int top1_mismatches = 0;              // positions whose engine top-1 is not the reference's
  // The largest reference margin at a mismatch: the reference's logit of its own top-1 minus its
  // logit of the engine's top-1 (infinity when the engine's top-1 is not among the stored ids).
  // A small margin says the two were a near tie that rounding may flip.
  double max_mismatch_margin = 0.0;
};

// Runs a dense prefill of the reference prompt and compares.
LogitComparison compare_with_reference(const LlamaModel& model, const ReferenceLogits& ref);

}  // namespace smollm2
