// Ticket: the handle of one prefetch (its layer, and the sequences with their generations).
#pragma once

#include <cstdint>
#include <vector>

#include "oasiskv/attention.hpp"

namespace oasiskv {
inline namespace v0 {

// Names one prefetch: its layer and the sequences (with their generations) it planned for.
// Acquire refuses a ticket whose sequence was removed or reused since.
struct Ticket {
  std::uint64_t id = 0;  // 0: no prefetch was made
  int layer = -1;
  std::vector<SeqId> sequences;
  std::vector<std::uint32_t> generations;
};

}  // namespace v0
}  // namespace oasiskv
