// The argument types of the CacheEngine hooks (cache_engine.hpp): the entries of an append, a
// plan and a view, the kind of a Cache call, the engine's counters and a view's CSR arrays. Kept
// apart from the contract so that the kit both engines share includes them without the contract
// (oasiskv/kit/host_block_pool.hpp takes the append entries; cache_engine.hpp includes that pool).
#pragma once

#include <cstdint>

#include "oasiskv/view.hpp"

namespace oasiskv {
inline namespace v0 {

// One sequence of an append: its slot, its length before the call, the rows it gets.
struct AppendEntry {
  int slot = 0;
  std::int64_t length = 0;
  std::int64_t rows = 0;
};

// One sequence of a plan (prefetch): its slot and length now, the plan's number in its (sequence,
// layer), the admits the plan may make (CacheLayout::admit_cap) and the rows the next step will
// append (its candidates: CacheLayout::next_step_candidates_end). next_rows is the same for every
// entry of one prefetch.
struct PlanEntry {
  int slot = 0;
  std::uint32_t generation = 0;
  std::int64_t length = 0;
  std::int64_t plan_index = 0;
  int admit_cap = 0;
  std::int64_t next_rows = 1;
  // Whether this is the first plan since the resident set was empty (uncapped): with a budget
  // profile the engine takes each kv head's cap from CacheLayout::admit_cap(.., layer, kv_head).
  bool first_plan = false;
};

// One sequence of an acquired view: slot, id and length now.
struct ViewEntry {
  int slot = 0;
  SeqId id = 0;
  std::int64_t length = 0;
};

// The calls of the Cache, for engine.enter: whether a call may be made while a CUDA stream is
// being captured into a graph.
enum class CallKind : std::uint8_t { decode, host_only };

// Counters the engine keeps (on the device for CUDA): folded into LayerStatistics.
struct EngineCounters {
  std::uint64_t blocks_fetched = 0;
  std::uint64_t admits_capped = 0;
  std::uint64_t observed_hits = 0;
  std::uint64_t remote_blocks_fetched = 0;
  std::int64_t copy_ns = 0;  // time the engine spent running the layer's copies (CPU backend)
};

// The CSR arrays of a layer's view (host or device memory, as the engine keeps them).
struct ViewArrays {
  int batch_size = 0;
  const SeqId* seq_ids = nullptr;
  const std::int64_t* seq_len = nullptr;
  const std::int32_t *indptr = nullptr, *slot = nullptr, *block = nullptr, *valid_tokens = nullptr;
};

}  // namespace v0
}  // namespace oasiskv
