// Argument checks shared by every Cache backend, so that each refuses the same calls with the
// same message. Each throws oasiskv::Error naming the bad value; none changes anything.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <span>
#include <unordered_set>
#include <vector>

#include "oasiskv/config.hpp"
#include "oasiskv/detail/block_table.hpp"
#include "oasiskv/dtype.hpp"
#include "oasiskv/error.hpp"
#include "oasiskv/ticket.hpp"

namespace oasiskv {
inline namespace v0 {

inline void check_layer(const CacheLayout& layout, int layer, const char* call) {
  if (layer < 0 || layer >= layout.config.shape.num_layers) {
    fail("{}: layer {} is out of range [0, {})", call, layer, layout.config.shape.num_layers);
  }
}

// The slot of a live sequence.
inline int slot_of(const BlockTable& table, SeqId id, const char* call) {
  const int s = table.find(id);
  if (s < 0) fail("{}: sequence {} is not in the cache", call, id);
  return s;
}

// The slots of a batch: not empty, every sequence live and named once.
inline std::vector<int> resolve_batch(const BlockTable& table, std::span<const SeqId> batch, const char* call) {
  if (batch.empty()) fail("{}: the batch is empty", call);
  std::vector<int> slots;
  slots.reserve(batch.size());
  // A decode batch is small: comparing with the earlier ids is cheaper than a hash set's
  // allocations (every append and prefetch resolves its batch). Same checks, same order.
  constexpr std::size_t kLinearScan = 64;
  std::unordered_set<SeqId> seen;
  for (std::size_t i = 0; i < batch.size(); ++i) {
    const SeqId id = batch[i];
    const auto earlier = batch.first(i);
    const bool twice = batch.size() <= kLinearScan ? std::find(earlier.begin(), earlier.end(), id) != earlier.end()
                                                   : !seen.insert(id).second;
    if (twice) fail("{}: sequence {} appears twice in the batch", call, id);
    slots.push_back(slot_of(table, id, call));
  }
  return slots;
}

// rows_per_seq of an append: one entry per sequence, none negative, capacity respected. Returns
// the total row count.
inline std::int64_t append_row_total(const BlockTable& table, const CacheLayout& layout, std::span<const SeqId> batch,
                                     std::span<const int> slots, int layer, std::span<const std::int32_t> rows_per_seq,
                                     const char* call) {
  if (rows_per_seq.size() != batch.size()) {
    fail("{}: rows_per_seq has {} entries for a batch of {} sequences", call, rows_per_seq.size(), batch.size());
  }
  std::int64_t total = 0;
  for (std::size_t i = 0; i < batch.size(); ++i) {
    const std::int64_t n = rows_per_seq[i];
    if (n < 0) fail("{}: rows_per_seq[{}] (sequence {}) is negative: {}", call, i, batch[i], n);
    const std::int64_t len = table.length(slots[i], layer);
    if (len + n > layout.config.max_tokens_per_sequence) {
      fail(
          "{}: sequence {} at layer {} would hold {} tokens, past its capacity of {} "
          "(max_tokens_per_sequence)",
          call, batch[i], layer, len + n, layout.config.max_tokens_per_sequence);
    }
    total += n;
  }
  if (total > std::numeric_limits<std::int32_t>::max()) {
    fail("{}: {} rows in one call, more than {}", call, total, std::numeric_limits<std::int32_t>::max());
  }
  return total;
}

// Row count, element type (`expected`, or f32 where allow_float) and a null pointer. The values
// are not read: a backend whose rows are on the host checks them as well.
inline void check_rows_shape(const RowsView& r, DType expected, const char* name, std::int64_t expected_rows,
                             const char* call, bool allow_float) {
  if (r.rows != expected_rows) {
    fail("{}: {} has {} rows, expected {}", call, name, r.rows, expected_rows);
  }
  if (r.dtype != expected && !(allow_float && r.dtype == DType::f32)) {
    fail("{}: {} has element type {}, but this cache holds {}{}", call, name, dtype_name(r.dtype), dtype_name(expected),
         allow_float ? " (or f32)" : "");
  }
  if (expected_rows > 0 && r.data == nullptr) fail("{}: {} is a null pointer", call, name);
}

// Query rows: a positive multiple of the batch size. Returns the rows per sequence.
inline std::int64_t query_rows_per_sequence(const RowsView& q, std::size_t batch, const char* call) {
  const auto n = static_cast<std::int64_t>(batch);
  if (q.rows < n || q.rows % n != 0) {
    fail("{}: q has {} rows, expected a positive multiple of the batch size {}", call, q.rows, n);
  }
  return q.rows / n;
}

// Every sequence of the ticket is still the one it was made for.
inline void check_ticket_fresh(const BlockTable& table, const Ticket& t, const char* call) {
  if (t.sequences.size() != t.generations.size() || t.sequences.size() != t.plans.size()) {
    fail("{}: ticket {} is malformed: {} sequences, {} generations, {} plan numbers", call, t.id, t.sequences.size(),
         t.generations.size(), t.plans.size());
  }
  for (std::size_t i = 0; i < t.sequences.size(); ++i) {
    const int s = table.find(t.sequences[i]);
    if (s < 0) {
      fail("{}: ticket {} is stale: sequence {} was removed after the prefetch", call, t.id, t.sequences[i]);
    }
    if (t.generations[i] < table.generation(s)) {
      fail(
          "{}: ticket {} is stale: sequence {} was removed and added again after the prefetch "
          "(generation {}, now {})",
          call, t.id, t.sequences[i], t.generations[i], table.generation(s));
    }
    if (t.generations[i] != table.version(s)) {
      fail("{}: ticket {} is stale: sequence {} was truncated after the prefetch (version {}, now {})", call, t.id,
           t.sequences[i], t.generations[i], table.version(s));
    }
  }
}

}  // namespace v0
}  // namespace oasiskv
