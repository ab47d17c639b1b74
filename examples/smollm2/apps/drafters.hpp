// Drafters propose the token at the next position; its lookahead row's queries tell the cache
// what to prefetch (and, with speculative decoding, the drafts the target verifies). A drafter
// never changes the tokens fed to the model, only what is prefetched. These are the apps' drafters,
// which need nothing but the tokens; the evaluation adds its own (experiments/smollm2).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>

namespace smollm2 {

class Drafter {
 public:
  virtual ~Drafter() = default;
  virtual std::string name() const = 0;
  // false: never a lookahead row; the cache is steered by the current token's own query.
  virtual bool has_lookahead_row() const { return true; }
  // history: every token so far, the last being the current one (not yet run through the model).
  // true_next: the next token under teacher forcing, or -1 when unknown (free generation).
  // nullopt: no proposal this step, so the step runs without a lookahead row (its own row's
  // queries plan the next step) and a speculative forward gets no more drafts.
  virtual std::optional<std::int32_t> draft(std::span<const std::int32_t> history, std::int32_t true_next) = 0;
};

// Prompt lookup: the token that followed the most recent earlier occurrence of the longest suffix
// of the history, of max_match down to min_match tokens; no proposal when none occurs.
//
// Why a minimum of 2 by default: the lookahead row costs a whole extra row of every weight
// product, and it only buys anything when its token is the true next one. On SmolLM2 over the
// GNU licences a one-token match was right 10% of the time and no match never (the current token
// again, the rule before 2026-12-07); a two-token match 23%, three 26%. With the minimum, the
// evaluation's quality is unchanged at under half the rows (docs/evaluation/lookahead.md).
// min_match 0 keeps the old rule: the current token again when nothing matches, a row every step.
class NgramDrafter final : public Drafter {
 public:
  // Throws std::invalid_argument unless 0 <= min_match <= max_match and max_match >= 1.
  explicit NgramDrafter(int min_match = 2, int max_match = 3);
  std::string name() const override;
  std::optional<std::int32_t> draft(std::span<const std::int32_t> history, std::int32_t true_next) override;

 private:
  int min_match_, max_match_;
};

// No lookahead row: select with the current token's query (the baseline of the paper).
class PreviousQueryDrafter final : public Drafter {
 public:
  std::string name() const override { return "previous"; }
  bool has_lookahead_row() const override { return false; }
  std::optional<std::int32_t> draft(std::span<const std::int32_t>, std::int32_t) override { return std::nullopt; }
};

// "ngram" (a minimum match of 2 tokens), "ngram:N" (a minimum of N, 0 to 3) or "previous"; throws
// std::invalid_argument otherwise, naming the bad name.
std::unique_ptr<Drafter> make_drafter(const std::string& name);

}  // namespace smollm2
