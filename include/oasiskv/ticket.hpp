// Ticket: the handle of one prefetch.
#pragma once

#include <cstdint>
#include <vector>

#include "oasiskv/view.hpp"

namespace oasiskv {
inline namespace v0 {

// Names one prefetch: the cache that made it, its layer, and per sequence its generation and the
// number of the plan made for it. acquire refuses a ticket of another cache, and one whose
// sequence was removed, reused or truncated since, or whose plan was superseded by a newer one.
struct Ticket {
  std::uint64_t id = 0;     // 0: no prefetch was made
  std::uint64_t cache = 0;  // Cache::id() of the cache that issued it
  int layer = -1;
  std::vector<SeqId> sequences;
  std::vector<std::uint32_t> generations;  // BlockTable::version of each sequence at the prefetch
  std::vector<std::int64_t> plans;         // plan number of each sequence at `layer`
};

}  // namespace v0
}  // namespace oasiskv
