// Transfer planning per (sequence, layer, kv head): TransferPlanner::plan for the 122 selectable
// slots of a 2,048-token budget, against a std::sort of the same number of block ids (the plan's
// core is two sorts and a binary search per selected block).
#include "bench_support.hpp"

#include <algorithm>
#include <numeric>
#include <vector>

namespace oasiskv::bench {
namespace {

enum class Scenario : int { steady = 0, cold = 1, churn = 2 };

struct PlanInputs {
  std::vector<std::int32_t> selected;  // best first
  std::vector<std::int32_t> block;     // residency: block per slot
  std::vector<std::int64_t> last_selected;
  int fetch_cap = 0;
};

// steady: the selection keeps all but 6 resident blocks (fetch ratio 0.05: 6 admits);
// cold: nothing resident, every selected block admitted (first step);
// churn: a disjoint selection, every slot a victim (fetch ratio 1.0, the query jumped).
PlanInputs plan_inputs(Scenario scenario) {
  const CacheLayout layout = CacheLayout::from(layer_config(kLongContext, scenario == Scenario::steady ? 0.05 : 1.0, 1));
  const int slots = layout.selectable_blocks;
  Random r(5);
  std::vector<std::int32_t> pool(2000);
  std::iota(pool.begin(), pool.end(), 1);
  for (std::size_t i = pool.size() - 1; i > 0; --i) std::swap(pool[i], pool[r.next() % (i + 1)]);
  PlanInputs in;
  in.fetch_cap = layout.fetch_cap;
  in.block.assign(static_cast<std::size_t>(slots), kNoBlock);
  in.last_selected.assign(static_cast<std::size_t>(slots), 0);
  for (int j = 0; j < slots; ++j) in.last_selected[static_cast<std::size_t>(j)] = static_cast<std::int64_t>(r.next() % 50);
  const auto resident = pool.begin();
  if (scenario != Scenario::cold) std::copy(resident, resident + slots, in.block.begin());
  switch (scenario) {
    case Scenario::steady:
      in.selected.assign(resident + in.fetch_cap, resident + slots + in.fetch_cap);
      break;
    case Scenario::cold:
      in.selected.assign(resident, resident + slots);
      break;
    case Scenario::churn:
      in.selected.assign(resident + slots, resident + 2 * slots);
      break;
  }
  for (std::size_t i = in.selected.size() - 1; i > 0; --i) std::swap(in.selected[i], in.selected[r.next() % (i + 1)]);
  return in;
}

void BM_TransferPlan(benchmark::State& state) {
  PlanInputs in = plan_inputs(static_cast<Scenario>(state.range(0)));
  const SlotResidency residency{in.block, in.last_selected};
  TransferPlanner planner;
  TransferPlan plan;
  std::int64_t step = 100;
  for (auto _ : state) {
    planner.plan(in.selected, residency, in.fetch_cap, step++, plan);
    benchmark::DoNotOptimize(plan.admits.data());
  }
  state.SetItemsProcessed(state.iterations());  // plans per second
  state.counters["admits"] = static_cast<double>(plan.admits.size());
  state.counters["slots"] = static_cast<double>(in.block.size());
  set_reference(state, "BM_SortBlockIds");
}
BENCHMARK(BM_TransferPlan)->UseRealTime()->ArgName("steady0_cold1_churn2")->Arg(0)->Arg(1)->Arg(2);

// Reference: copy and std::sort 122 random block ids.
void BM_SortBlockIds(benchmark::State& state) {
  const PlanInputs in = plan_inputs(Scenario::churn);
  std::vector<std::int32_t> work(in.selected.size());
  for (auto _ : state) {
    std::copy(in.selected.begin(), in.selected.end(), work.begin());
    std::sort(work.begin(), work.end());
    benchmark::DoNotOptimize(work.data());
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_SortBlockIds)->UseRealTime();

}  // namespace
}  // namespace oasiskv::bench
