#include "drafters.hpp"

#include <algorithm>
#include <stdexcept>

namespace smollm2 {

std::int32_t NgramDrafter::draft(std::span<const std::int32_t> history, std::int32_t) {
  const auto n_hist = static_cast<std::int64_t>(history.size());
  for (int n = std::min<std::int64_t>(max_n_, n_hist - 1); n >= 1; --n) {
    const auto suffix = history.subspan(history.size() - n);
    // Most recent earlier occurrence whose follower exists (start + n < n_hist).
    for (std::int64_t start = n_hist - n - 1; start >= 0; --start) {
      if (std::equal(suffix.begin(), suffix.end(), history.begin() + start)) return history[start + n];
    }
  }
  return history.back();
}

std::unique_ptr<Drafter> make_drafter(const std::string& name) {
  if (name == "ngram") return std::make_unique<NgramDrafter>();
  if (name == "previous") return std::make_unique<PreviousQueryDrafter>();
  throw std::invalid_argument("unknown drafter '" + name +
                              "' (ngram, previous; oracle and early-exit are the evaluation's: smollm2-evaluate)");
}

}  // namespace smollm2
