// Bodies of Cache<Backend, T> (oasiskv/cache.hpp): the sequence operations an engine's memory
// manager calls (add, remove, truncate, fork), over the host block pool (host_block_pool.hpp).
#pragma once

#include <algorithm>
#include <limits>

#include "oasiskv/cache.hpp"  // the declarations (when this file is included on its own)
#include "oasiskv/detail/argument_checks.hpp"

namespace oasiskv {
inline namespace v0 {

// ---- sequence lifecycle -----------------------------------------------------------------------

template <class B, KvElement T>
void Cache<B, T>::add_sequence(SeqId id) {
  if (table_.find(id) >= 0) fail("add_sequence: sequence {} is already in the cache", id);
  if (table_.free_slots() == 0) {
    fail("add_sequence: cannot add sequence {}: all {} sequence slots are in use (max_sequences)", id,
         layout_.config.max_sequences);
  }
  engine_.enter("add_sequence", CallKind::host_only);
  const int s = table_.add(id);
  gate_.reset(s);
  engine_.sequence_added(s, table_.generation(s));
}

template <class B, KvElement T>
void Cache<B, T>::remove_sequence(SeqId id) {
  const int s = slot_of(id, "remove_sequence");
  for (std::size_t l = 0; l < acquired_.size(); ++l) {
    if (under_attention(s, static_cast<int>(l))) {
      fail("remove_sequence: sequence {} is in ticket {}, acquired at layer {}: release it first", id,
           acquired_[l].ticket, l);
    }
  }
  engine_.enter("remove_sequence", CallKind::host_only);
  const std::uint32_t generation = table_.remove(s);
  gate_.reset(s);
  engine_.sequence_removed(s, generation);
  engine_.release_blocks(s, 0);
  sweep_tickets();
}

template <class B, KvElement T>
void Cache<B, T>::fork(SeqId src, SeqId dst) {
  fork_sequence(src, dst, -1);
}

template <class B, KvElement T>
void Cache<B, T>::fork(SeqId src, SeqId dst, std::int64_t length) {
  if (length < 0) fail("fork: length {} for a fork of sequence {} is negative", length, src);
  fork_sequence(src, dst, length);
}

// length -1: all of src (its layers must have one length).
template <class B, KvElement T>
void Cache<B, T>::fork_sequence(SeqId src, SeqId dst, std::int64_t length) {
  constexpr const char* call = "fork";
  const int s = slot_of(src, call);
  if (table_.find(dst) >= 0)
    fail("fork: cannot fork sequence {} into sequence {}: {} is already in the cache", src, dst, dst);
  if (table_.free_slots() == 0) {
    fail("fork: cannot fork sequence {} into sequence {}: all {} sequence slots are in use (max_sequences)", src, dst,
         layout_.config.max_sequences);
  }
  std::int64_t shortest = std::numeric_limits<std::int64_t>::max(), longest = 0;
  for (int l = 0; l < layout_.num_layers(); ++l) {
    check_layer(l, call);
    shortest = std::min(shortest, table_.length(s, l));
    longest = std::max(longest, table_.length(s, l));
  }
  if (length < 0 && shortest != longest) {
    fail(
        "fork: sequence {} has layers of different lengths ({} to {}: a step is in progress); pass the length to "
        "fork (at most {})",
        src, shortest, longest, shortest);
  }
  if (length < 0) length = longest;
  if (length > shortest) {
    fail("fork: length {} for a fork of sequence {} is outside [0, {}] (its shortest layer)", length, src, shortest);
  }
  check_local_rows(s, length, call);
  engine_.enter(call, CallKind::host_only);
  const int d = table_.add(dst);
  gate_.reset(d);
  engine_.sequence_added(d, table_.generation(d));
  try {
    engine_.fork(s, d, length);
  } catch (...) {
    remove_sequence(dst);
    throw;
  }
  for (int l = 0; l < layout_.num_layers(); ++l) table_.set_length(d, l, length);
}

// A remote-backed sequence (admit) keeps only its sinks and recent ring locally: a truncate or fork
// to `length` needs the ring of that length and its partial block's rows on this side.
template <class B, KvElement T>
void Cache<B, T>::check_local_rows(int slot, std::int64_t length, const char* call) const {
  const std::int64_t remote_end = engine_.host_tier().pool().remote_end(slot);
  const std::int64_t ring_first = layout_.ring_start(length);
  if (remote_end > 0 && ring_first < remote_end) {
    std::int64_t shortest = remote_end * layout_.block_tokens();  // ring_start grows with the length
    while (layout_.ring_start(shortest) < remote_end) ++shortest;
    fail(
        "{}: sequence {} was admitted from another process and its blocks before {} (token {}) are remote; "
        "length {} needs the recent ring from block {} on locally (the shortest length allowed is {})",
        call, table_.id(slot), remote_end, remote_end * layout_.block_tokens(), length, ring_first, shortest);
  }
}

template <class B, KvElement T>
std::vector<Ticket> Cache<B, T>::admit(SeqId id, const AdmissionMessage& m,
                                       std::shared_ptr<RemoteBlockSource> source) requires AdmittingEngine<Engine> {
  constexpr const char* call = "admit";
  check_admission(m, layout_, dtype_of_v<T>);
  if (table_.find(id) >= 0) fail("admit: sequence {} is already in the cache", id);
  if (table_.free_slots() == 0) {
    fail("admit: cannot admit sequence {}: all {} sequence slots are in use (max_sequences)", id,
         layout_.config.max_sequences);
  }
  for (int l = 0; l < layout_.num_layers(); ++l) check_layer(l, call);
  const std::int64_t blocks = layout_.blocks_for(m.length);
  std::int64_t local = 0;
  for (std::int64_t b = 0; b < blocks; ++b) local += layout_.pinned_block(b, m.length) ? 1 : 0;
  if (local < blocks && !source) {
    fail("admit: request {} (sequence {}) leaves {} blocks remote but no RemoteBlockSource was given", m.request_id, id,
         blocks - local);
  }
  const std::int64_t free = engine_.host_tier().pool().free_blocks();
  if (local > free) {
    fail(
        "admit: the host pool is exhausted: sequence {} needs {} blocks for its sinks and recent ring, and {} of the "
        "pool's {} blocks are free (CacheConfig::host_pool_blocks)",
        id, local, free, engine_.host_tier().pool().capacity());
  }
  engine_.enter(call, CallKind::host_only);
  const int s = table_.add(id);
  gate_.reset(s);
  engine_.sequence_added(s, table_.generation(s));
  std::vector<Ticket> tickets;
  try {
    engine_.admit(s, m, std::move(source));
    for (int l = 0; l < layout_.num_layers(); ++l) table_.set_length(s, l, m.length);
    const SeqId batch[] = {id};
    const auto floats = static_cast<std::size_t>(m.lookahead_rows) * static_cast<std::size_t>(layout_.q_row_elems);
    // The message's queries are host memory: the engine puts them where its planning reads them.
    const float* queries = engine_.admission_queries(m.lookahead_queries);
    for (int l = 0; l < layout_.num_layers(); ++l) {
      const RowsView q = rows_view(queries + static_cast<std::size_t>(l) * floats, m.lookahead_rows);
      tickets.push_back(prefetch(batch, l, q, m.next_step_rows));
    }
  } catch (...) {
    engine_.finish_admission(s);
    remove_sequence(id);
    throw;
  }
  engine_.finish_admission(s);
  return tickets;
}

template <class B, KvElement T>
void Cache<B, T>::truncate(SeqId id, std::int64_t length) {
  constexpr const char* call = "truncate";
  const int s = slot_of(id, call);
  std::int64_t longest = 0;
  for (int l = 0; l < layout_.num_layers(); ++l) longest = std::max(longest, table_.length(s, l));
  if (length < 0 || length > longest) {
    fail("truncate: length {} for sequence {} is outside [0, {}] (its longest layer)", length, id, longest);
  }
  check_local_rows(s, length, call);
  for (std::size_t l = 0; l < acquired_.size(); ++l) {
    if (under_attention(s, static_cast<int>(l))) {
      fail("truncate: sequence {} is in ticket {}, acquired at layer {}: release it first", id, acquired_[l].ticket, l);
    }
    if (table_.length(s, static_cast<int>(l)) > length) check_layer(static_cast<int>(l), call);
  }
  engine_.enter(call, CallKind::host_only);
  for (int l = 0; l < layout_.num_layers(); ++l) {
    const std::int64_t old = table_.length(s, l);
    if (old <= length) continue;
    guarded(l, call, [&] {
      // No attention of this sequence is in flight: every plan it has may start its copies now, so
      // that they land before the truncated blocks' residency is dropped.
      gate_.retire(s, l, table_.next_plan(s, l) - 1);
      pump(l);
      engine_.truncate(s, l, old, length);
    });
    table_.set_length(s, l, length);
  }
  std::int64_t longest_now = 0;
  for (int l = 0; l < layout_.num_layers(); ++l) longest_now = std::max(longest_now, table_.length(s, l));
  engine_.release_blocks(s, layout_.blocks_for(longest_now));
  table_.truncated(s);
  sweep_tickets();
}

template <class B, KvElement T>
std::int64_t Cache<B, T>::sequence_length(SeqId id, int layer) const {
  oasiskv::check_layer(layout_, layer, "sequence_length");
  return table_.length(slot_of(id, "sequence_length"), layer);
}

}  // namespace v0
}  // namespace oasiskv
