// CacheConfig: what the engine chooses; CacheLayout: the sizes derived from it, after validation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "oasiskv/dtype.hpp"

namespace oasiskv {
inline namespace v0 {

struct ModelShape {
  int num_layers = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
};

// How the scores of one kv head's group of query heads, and of several lookahead rows, become
// one score per block.
enum class GroupReduction : std::uint8_t {
  max,          // the largest bound over (row, query head)
  sum,          // the sum of the bounds
  softmax_sum,  // per (row, query head) a softmax over the blocks, summed: every head gets a vote
};

std::string_view reduction_name(GroupReduction r) noexcept;
// Parses "max", "sum" or "softmax_sum"; throws oasiskv::Error naming the text otherwise.
GroupReduction parse_reduction(std::string_view text);

struct CacheConfig {
  ModelShape shape;
  // Tokens per block. A block of one kv head is one copy: K then V, each [block_tokens][head_dim].
  int block_tokens = 16;
  // Tokens resident per (sequence, layer, kv head): pinned blocks plus selected blocks.
  int budget_tokens = 2048;
  // The first sink_tokens of each sequence are always resident (attention sinks).
  int sink_tokens = 16;
  // The last recent_tokens, plus the partial tail block, are always resident: they live in a
  // ring of recent_tokens / block_tokens + 1 slots that append writes through.
  int recent_tokens = 64;
  // At most max(1, floor(fetch_ratio * budget blocks)) admits per (sequence, layer, kv head) and
  // step; the rest wait for a later step. 1.0: no cap. The first plan of a sequence (the working
  // set after prefill) is never capped: nothing is resident yet, and decode has not started.
  double fetch_ratio = 1.0;
  int max_sequences = 1;
  // Host-tier capacity per sequence (appending past it is an error).
  std::int64_t max_tokens_per_sequence = 0;
  // sum: measured on SmolLM2-135M (examples/smollm2) against max and softmax_sum: best or tied
  // attention-mass recall and agreement at every budget, with the fewest blocks fetched.
  GroupReduction reduction = GroupReduction::sum;
  // Scale of q.k inside the softmax_sum reduction; 0 means 1/sqrt(head_dim).
  float softmax_scale = 0.0f;
};

// Sizes derived from a validated CacheConfig. Slot numbering inside one (sequence, layer,
// kv head): [0, sink_blocks) sinks, then ring_blocks recent-ring slots, then selectable slots.
struct CacheLayout {
  CacheConfig config;
  int group_size = 0;         // query heads per kv head
  int budget_blocks = 0;      // slots per (sequence, layer, kv head)
  int sink_blocks = 0;
  int ring_blocks = 0;        // recent_tokens / block_tokens + 1 (the tail block)
  int selectable_blocks = 0;  // budget_blocks - sink_blocks - ring_blocks: the top-K
  int fetch_cap = 0;          // admits per (sequence, layer, kv head) and step
  std::int64_t max_blocks = 0;      // logical blocks per sequence
  std::int64_t block_elems = 0;     // elements in one block: 2 * block_tokens * head_dim
  std::int64_t row_elems = 0;       // elements in one appended row: kv_heads * head_dim
  float softmax_scale = 0.0f;

  // Validates every field and throws oasiskv::Error naming the first bad value.
  static CacheLayout from(const CacheConfig& config);

  // Blocks that hold `tokens` tokens.
  std::int64_t blocks_for(std::int64_t tokens) const noexcept {
    return (tokens + config.block_tokens - 1) / config.block_tokens;
  }
  // First logical block of the recent ring for a sequence of `tokens` tokens.
  std::int64_t ring_start(std::int64_t tokens) const noexcept {
    const std::int64_t start = blocks_for(tokens) - ring_blocks;
    return start > sink_blocks ? start : sink_blocks;
  }
  // Host-tier layout (block-major, every backend): [sequence slot][layer][kv head][block][K|V]
  // [block_tokens][head_dim]. Elements in the whole tier, and the offset of one block.
  std::int64_t host_tier_elements() const noexcept {
    return static_cast<std::int64_t>(config.max_sequences) * config.shape.num_layers *
           config.shape.num_kv_heads * max_blocks * block_elems;
  }
  std::int64_t host_block_offset(int seq_slot, int layer, int kv_head,
                                 std::int64_t block) const noexcept {
    const auto& s = config.shape;
    const std::int64_t head =
        (static_cast<std::int64_t>(seq_slot) * s.num_layers + layer) * s.num_kv_heads + kv_head;
    return (head * max_blocks + block) * block_elems;
  }
  // Admits allowed to plan `plan_index` of a (sequence, layer, kv head): the first plan (the
  // working set after prefill) is not capped.
  int admit_cap(std::int64_t plan_index) const noexcept {
    return plan_index == 0 ? selectable_blocks : fetch_cap;
  }
  // Local slot (within its (sequence, layer, kv head)) of a pinned block.
  int pinned_slot(std::int64_t block) const noexcept {
    return block < sink_blocks ? static_cast<int>(block)
                               : sink_blocks + static_cast<int>(block % ring_blocks);
  }
};

}  // namespace v0
}  // namespace oasiskv
