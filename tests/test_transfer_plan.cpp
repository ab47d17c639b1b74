// Transfer plans on random residencies against the rules, checked independently.
#include <algorithm>
#include <set>

#include "support.hpp"

using namespace oasiskv;

TEST_CASE("transfer plans: cap, victim order, distinct slots, budget, and apply") {
  OASISKV_SEEDED_RNG(rng);
  TransferPlanner planner;
  TransferPlan plan;
  for (int trial = 0; trial < 3000; ++trial) {
    const int slots = std::uniform_int_distribution<int>(1, 24)(rng);
    const int universe = std::uniform_int_distribution<int>(slots, 3 * slots + 4)(rng);
    std::vector<std::int32_t> blocks(static_cast<std::size_t>(universe));
    std::iota(blocks.begin(), blocks.end(), 0);
    std::shuffle(blocks.begin(), blocks.end(), rng);
    std::vector<std::int32_t> block(static_cast<std::size_t>(slots), kNoBlock);
    std::vector<std::int64_t> last(static_cast<std::size_t>(slots), -1);
    std::bernoulli_distribution occupied(0.7);
    std::uniform_int_distribution<int> step_of(0, 5);  // few values: ties in last-selected
    for (int j = 0; j < slots; ++j) {
      if (occupied(rng)) {
        block[static_cast<std::size_t>(j)] = blocks[static_cast<std::size_t>(j)];
        last[static_cast<std::size_t>(j)] = step_of(rng);
      }
    }
    std::shuffle(blocks.begin(), blocks.end(), rng);
    const int nsel = std::uniform_int_distribution<int>(0, slots)(rng);
    const std::vector<std::int32_t> selected(blocks.begin(), blocks.begin() + nsel);
    const int cap = std::uniform_int_distribution<int>(1, slots + 1)(rng);
    const std::int64_t step = 10 + trial;

    const auto before_block = block;
    const auto before_last = last;
    planner.plan(selected, SlotResidency{block, last}, cap, step, plan);

    // Independent expectations.
    auto resident = [&](std::int32_t b) { return std::find(before_block.begin(), before_block.end(), b) != before_block.end(); };
    std::vector<std::int32_t> missing;
    for (std::int32_t b : selected) if (!resident(b)) missing.push_back(b);
    std::vector<std::int32_t> free_slots, victims;
    for (int j = 0; j < slots; ++j) {
      const auto b = before_block[static_cast<std::size_t>(j)];
      if (b == kNoBlock) free_slots.push_back(j);
      else if (std::find(selected.begin(), selected.end(), b) == selected.end()) victims.push_back(j);
    }
    std::stable_sort(victims.begin(), victims.end(), [&](int a, int b) {
      return std::pair(before_last[static_cast<std::size_t>(a)], before_block[static_cast<std::size_t>(a)]) <
             std::pair(before_last[static_cast<std::size_t>(b)], before_block[static_cast<std::size_t>(b)]);
    });
    std::vector<std::int32_t> targets = free_slots;
    targets.insert(targets.end(), victims.begin(), victims.end());

    REQUIRE(plan.admits.size() <= static_cast<std::size_t>(cap));
    REQUIRE(plan.admits.size() == std::min<std::size_t>(missing.size(), static_cast<std::size_t>(cap)));
    CHECK(plan.capped == static_cast<std::int32_t>(missing.size() - plan.admits.size()));
    std::set<std::int32_t> used;
    for (std::size_t i = 0; i < plan.admits.size(); ++i) {
      const Admit& a = plan.admits[i];
      CHECK(a.block == missing[i]);                   // highest score first
      CHECK(a.slot == targets[i]);                    // free, then least recently selected
      CHECK(a.evicted == before_block[static_cast<std::size_t>(a.slot)]);
      CHECK(used.insert(a.slot).second);              // no slot given twice
    }

    apply(plan, SlotResidency{block, last});
    int count = 0;
    for (int j = 0; j < slots; ++j) {
      const auto b = block[static_cast<std::size_t>(j)];
      count += b != kNoBlock;
      const bool admitted = used.count(j) != 0;
      if (!admitted) CHECK(b == before_block[static_cast<std::size_t>(j)]);
      const bool selected_here = std::find(selected.begin(), selected.end(), b) != selected.end();
      CHECK(last[static_cast<std::size_t>(j)] == (b != kNoBlock && selected_here ? step : before_last[static_cast<std::size_t>(j)]));
    }
    CHECK(count <= slots);
    // The residency is exactly the plan's: admitted blocks in, their victims out, the rest kept.
    std::multiset<std::int32_t> expected(before_block.begin(), before_block.end());
    for (const Admit& a : plan.admits) {
      expected.erase(expected.find(a.evicted));
      expected.insert(a.block);
    }
    CHECK(std::multiset<std::int32_t>(block.begin(), block.end()) == expected);
    // Every selected block is resident unless capped.
    int absent = 0;
    for (std::int32_t b : selected) absent += std::find(block.begin(), block.end(), b) == block.end();
    CHECK(absent == plan.capped);
  }
}
