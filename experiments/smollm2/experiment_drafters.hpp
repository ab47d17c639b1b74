// The evaluation's drafters, beside the apps' (ngram, previous: examples/smollm2/apps/drafters.hpp):
// the oracle, which needs the true text, and the early-exit drafter, which attends over the
// ExperimentSession's mirror of every row. Neither is what an engine ships.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "dense_kv.hpp"
#include "drafters.hpp"
#include "llama_model.hpp"

namespace smollm2 {

// The true next token: the upper bound of any drafter.
class OracleDrafter final : public Drafter {
 public:
  std::string name() const override { return "oracle"; }
  std::optional<std::int32_t> draft(std::span<const std::int32_t> history, std::int32_t true_next) override;
};

// Self-speculative early exit: the first `layers` layers of the target model, then its final
// norm and LM head. It attends densely over the engine's full-precision KV mirror of those
// layers (positions before the current token), which `kv` must hold when draft() is called.
class EarlyExitDrafter final : public Drafter {
 public:
  EarlyExitDrafter(const LlamaModel& model, const DenseKv& kv, int layers) : model_(model), kv_(kv), layers_(layers) {}
  std::string name() const override { return "early-exit"; }
  std::optional<std::int32_t> draft(std::span<const std::int32_t> history, std::int32_t true_next) override;

 private:
  const LlamaModel& model_;
  const DenseKv& kv_;
  int layers_;
};

// "oracle", "ngram", "ngram:N", "early-exit" (early_exit_layers), "early-exit:N" or "previous"; throws
// std::invalid_argument otherwise. kv: the mirror the early-exit drafter reads.
std::unique_ptr<Drafter> make_experiment_drafter(const std::string& name, const LlamaModel& model, const DenseKv& kv,
                                                 int early_exit_layers);

}  // namespace smollm2
