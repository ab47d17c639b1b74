// The apps' drafters (examples/smollm2/apps/drafters.hpp): prompt lookup against a simple
// reference on random histories, its minimum match (no proposal, so no lookahead row, below it),
// and the names and bad arguments make_drafter takes. No model needed.
#include <doctest/doctest.h>

#include <cstdint>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "drafters.hpp"

namespace {

// Every earlier occurrence of every suffix length is a candidate; the longest length wins, then
// the latest start. No proposal below min_match; min_match 0 proposes the current token then.
std::optional<std::int32_t> reference_draft(const std::vector<std::int32_t>& h, int min_match, int max_match) {
  const int N = static_cast<int>(h.size());
  int best_n = 0, best_start = -1;
  for (int n = 1; n <= max_match && n < N; ++n) {
    for (int start = 0; start + n < N; ++start) {
      bool same = true;
      for (int i = 0; i < n; ++i) same = same && h[start + i] == h[N - n + i];
      if (same && (n > best_n || (n == best_n && start > best_start))) {
        best_n = n;
        best_start = start;
      }
    }
  }
  if (best_n > 0 && best_n >= min_match) return h[best_start + best_n];
  if (min_match == 0 && N > 0) return h.back();
  return std::nullopt;
}

}  // namespace

TEST_SUITE("drafters") {
  TEST_CASE("prompt lookup matches a reference on random histories, for each minimum match") {
    std::mt19937 rng(20261207);
    for (int min_match = 0; min_match <= 3; ++min_match) {
      smollm2::NgramDrafter drafter(min_match, 3);
      int proposed = 0, abstained = 0;
      for (int trial = 0; trial < 400; ++trial) {
        // Small alphabets make matches of every length; long histories over large ones make none.
        const int alphabet = 2 + static_cast<int>(rng() % 40);
        std::vector<std::int32_t> h(1 + rng() % 60);
        for (auto& t : h) t = static_cast<std::int32_t>(rng() % alphabet);
        const auto expected = reference_draft(h, min_match, 3);
        CAPTURE(min_match);
        CAPTURE(trial);
        CHECK(drafter.draft(h, -1) == expected);
        (expected ? proposed : abstained) += 1;
      }
      CHECK(proposed > 0);
      if (min_match > 0) CHECK(abstained > 0);
    }
  }

  TEST_CASE("the minimum match decides whether a step gets a lookahead row") {
    // "... 7 8 | 5 7": the suffix 7 occurred once (followed by 8); the suffix 5 7 never did.
    const std::vector<std::int32_t> one_token_match{1, 7, 8, 5, 7};
    CHECK(smollm2::NgramDrafter(1, 3).draft(one_token_match, -1) == 8);
    CHECK_FALSE(smollm2::NgramDrafter(2, 3).draft(one_token_match, -1).has_value());
    CHECK_FALSE(smollm2::NgramDrafter().draft(one_token_match, -1).has_value());  // the default: 2
    // "5 7" occurred at 1..2, followed by 9; the most recent "7" (followed by 8) is a shorter match.
    const std::vector<std::int32_t> two_token_match{5, 7, 9, 7, 8, 5, 7};
    CHECK(smollm2::NgramDrafter().draft(two_token_match, -1) == 9);
    // Nothing occurred before: no proposal, or with minimum 0 the current token again.
    const std::vector<std::int32_t> fresh{1, 2, 3};
    CHECK_FALSE(smollm2::NgramDrafter(1, 3).draft(fresh, -1).has_value());
    CHECK(smollm2::NgramDrafter(0, 3).draft(fresh, -1) == 3);
    CHECK_FALSE(smollm2::NgramDrafter(0, 3).draft(std::vector<std::int32_t>{}, -1).has_value());
  }

  TEST_CASE("drafter names and bad arguments") {
    CHECK(smollm2::make_drafter("ngram")->name() == "ngram");
    for (const char* name : {"ngram:0", "ngram:1", "ngram:3"}) CHECK(smollm2::make_drafter(name)->name() == name);
    CHECK(smollm2::make_drafter("ngram:2")->name() == "ngram");
    const auto previous = smollm2::make_drafter("previous");
    CHECK_FALSE(previous->has_lookahead_row());
    CHECK_FALSE(previous->draft(std::vector<std::int32_t>{4, 4, 4}, 4).has_value());
    for (const char* bad : {"ngram:4", "ngram:", "ngram:-1", "ngram:12", "Ngram", "oracle"}) {
      CAPTURE(bad);
      try {
        smollm2::make_drafter(bad);
        FAIL("accepted");
      } catch (const std::invalid_argument& e) {
        CHECK(std::string(e.what()).find(std::string("'") + bad + "'") != std::string::npos);
      }
    }
    CHECK_THROWS_AS(smollm2::NgramDrafter(3, 2), std::invalid_argument);
    CHECK_THROWS_AS(smollm2::NgramDrafter(-1, 3), std::invalid_argument);
    CHECK_THROWS_AS(smollm2::NgramDrafter(0, 0), std::invalid_argument);
  }
}
