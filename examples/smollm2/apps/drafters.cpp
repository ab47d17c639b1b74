#include "drafters.hpp"

#include <algorithm>
#include <stdexcept>

namespace smollm2 {

NgramDrafter::NgramDrafter(int min_match, int max_match) : min_match_(min_match), max_match_(max_match) {
  if (max_match < 1 || min_match < 0 || min_match > max_match) {
    throw std::invalid_argument("NgramDrafter: matches of " + std::to_string(min_match) + " to " +
                                std::to_string(max_match) + " tokens (need 0 <= min <= max, max >= 1)");
  }
}

std::string NgramDrafter::name() const { return min_match_ == 2 ? "ngram" : "ngram:" + std::to_string(min_match_); }

std::optional<std::int32_t> NgramDrafter::draft(std::span<const std::int32_t> history, std::int32_t) {
  if (history.empty()) return std::nullopt;
  const auto n_hist = static_cast<std::int64_t>(history.size());
  for (int n = static_cast<int>(std::min<std::int64_t>(max_match_, n_hist - 1)); n >= std::max(min_match_, 1); --n) {
    const auto suffix = history.subspan(history.size() - n);
    // Most recent earlier occurrence whose follower exists (start + n < n_hist).
    for (std::int64_t start = n_hist - n - 1; start >= 0; --start) {
      if (std::equal(suffix.begin(), suffix.end(), history.begin() + start)) return history[start + n];
    }
  }
  if (min_match_ == 0) return history.back();
  return std::nullopt;
}

std::unique_ptr<Drafter> make_drafter(const std::string& name) {
  if (name == "ngram") return std::make_unique<NgramDrafter>();
  if (name.rfind("ngram:", 0) == 0 && name.size() == 7 && name[6] >= '0' && name[6] <= '3') {
    return std::make_unique<NgramDrafter>(name[6] - '0', 3);
  }
  if (name == "previous") return std::make_unique<PreviousQueryDrafter>();
  throw std::invalid_argument("unknown drafter '" + name +
                              "' (ngram, ngram:N for a minimum match of N = 0..3 tokens, previous; oracle and "
                              "early-exit are the evaluation's: smollm2-evaluate)");
}

}  // namespace smollm2
