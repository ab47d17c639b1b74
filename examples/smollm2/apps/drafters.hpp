// Drafters propose the token at the next position; its lookahead row's queries tell the cache
// what to prefetch. A drafter never changes the tokens fed to the model, only what is prefetched.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "dense_kv.hpp"
#include "llama_model.hpp"

namespace smollm2 {

class Drafter {
 public:
  virtual ~Drafter() = default;
  virtual std::string name() const = 0;
  // false: no lookahead row; the cache is steered by the current token's own query.
  virtual bool has_lookahead_row() const { return true; }
  // history: every token so far, the last being the current one (not yet run through the model).
  // true_next: the next token under teacher forcing, or -1 when unknown (free generation).
  virtual std::int32_t draft(std::span<const std::int32_t> history, std::int32_t true_next) = 0;
};

// The true next token: the upper bound of any drafter.
class OracleDrafter final : public Drafter {
 public:
  std::string name() const override { return "oracle"; }
  std::int32_t draft(std::span<const std::int32_t> history, std::int32_t true_next) override;
};

// Prompt lookup: the token that followed the most recent earlier occurrence of the longest
// suffix (max_n down to 1 tokens) of the history; the current token again when nothing matches.
class NgramDrafter final : public Drafter {
 public:
  explicit NgramDrafter(int max_n = 3) : max_n_(max_n) {}
  std::string name() const override { return "ngram"; }
  std::int32_t draft(std::span<const std::int32_t> history, std::int32_t true_next) override;

 private:
  int max_n_;
};

// Self-speculative early exit: the first `layers` layers of the target model, then its final
// norm and LM head. It attends densely over the engine's full-precision KV mirror of those
// layers (positions before the current token), which `kv` must hold when draft() is called.
class EarlyExitDrafter final : public Drafter {
 public:
  EarlyExitDrafter(const LlamaModel& model, const DenseKv& kv, int layers) : model_(model), kv_(kv), layers_(layers) {}
  std::string name() const override { return "early-exit"; }
  std::int32_t draft(std::span<const std::int32_t> history, std::int32_t true_next) override;

 private:
  const LlamaModel& model_;
  const DenseKv& kv_;
  int layers_;
};

// No lookahead row: select with the current token's query (the baseline of the paper).
class PreviousQueryDrafter final : public Drafter {
 public:
  std::string name() const override { return "previous"; }
  bool has_lookahead_row() const override { return false; }
  std::int32_t draft(std::span<const std::int32_t> history, std::int32_t) override { return history.back(); }
};

// "oracle", "ngram", "early-exit" (early_exit_layers), "early-exit:N" or "previous"; throws
// std::invalid_argument otherwise.
std::unique_ptr<Drafter> make_drafter(const std::string& name, const LlamaModel& model, const DenseKv& kv,
                                      int early_exit_layers);

}  // namespace smollm2
