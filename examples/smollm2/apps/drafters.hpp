// Drafters propose the token at the next position; its lookahead row's queries tell the cache
// what to prefetch (and, with speculative decoding, the drafts the target verifies). A drafter
// never changes the tokens fed to the model, only what is prefetched. These are the apps' drafters,
// which need nothing but the tokens; the evaluation adds its own (experiments/smollm2).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

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

// No lookahead row: select with the current token's query (the baseline of the paper).
class PreviousQueryDrafter final : public Drafter {
 public:
  std::string name() const override { return "previous"; }
  bool has_lookahead_row() const override { return false; }
  std::int32_t draft(std::span<const std::int32_t> history, std::int32_t) override { return history.back(); }
};

// "ngram" or "previous"; throws std::invalid_argument otherwise.
std::unique_ptr<Drafter> make_drafter(const std::string& name);

}  // namespace smollm2
