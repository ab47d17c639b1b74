// CacheConfig: what the engine chooses; CacheLayout: the sizes derived from it, after validation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "oasiskv/dtype.hpp"
#include "oasiskv/kit/host_device.hpp"
#include "oasiskv/remainder_geometry.hpp"

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

// What Cache::remainder estimates of the attention over the blocks that are not resident (the
// engine's opt-in; the implementations: cpu/detail/remainder/, cuda/detail/remainder/).
//   clusters:  every block keeps the sum of its key rows and of its value rows; when an append
//              fills a segment of kClusterSegmentBlocks blocks, its keys are clustered (per layer
//              and kv head; k-means, L2) into segment rows / remainder_cluster_rows clusters, each
//              keeping its key sum, value sum and row count beside a one-byte cluster id per row.
//              A cluster (and a block of a segment not clustered) of n rows with mean key mu and
//              mean value vbar weighs exp(log n + s q.mu) (s the softmax scale), a cluster scaled
//              to its rows outside the view; the state is lse = log sum w, out = sum w vbar / sum w.
//   quantized: a low-bit copy of every full block's rows (quantized_rows.hpp,
//              CacheConfig::remainder_bits): keys coded per channel against the block's own key
//              min/max (its Quest summary: no scale is stored), values per row in groups of 32
//              channels (a float minimum and step each). The state is the attention of q over the
//              non-resident blocks' decoded rows, each score lowered by half the variance of its
//              rounding noise (quantized_score_offset). remainder_bits / 16 of the fp16 rows'
//              bytes, plus 1/16 for the value scales (head dims that are multiples of 32).
// (Three estimates from per-block sums, centroid, gaussian and variance, were measured worse
// than these and left: docs/evaluation/remainder.md.)
enum class RemainderEstimate : std::uint8_t {
  none,       // nothing kept or estimated: Cache::remainder refuses
  clusters,   // centroids of k-means clusters of each 1,024-row segment's keys
  quantized,  // attention over low-bit copies of the non-resident rows
};

std::string_view remainder_name(RemainderEstimate r) noexcept;
// Parses "none", "clusters" or "quantized"; throws oasiskv::Error naming the text otherwise.
RemainderEstimate parse_remainder(std::string_view text);

// How a block's key summary (channel-wise max and min; centre c = (max+min)/2, range r = max-min)
// and one query q become the block's score (block_scorer.hpp). All read the same bytes.
//   quest:  Quest's upper bound of q.k over the block's keys, sum_i max(q_i max_i, q_i min_i)
//           (= q.c + 0.5 sum_i |q_i| r_i in exact arithmetic). The default: today's bits.
//   spread: q.c + alpha 0.5 sum_i |q_i| r_i, alpha = CacheConfig::spread_alpha (1: Quest's bound,
//           0: the centre's score; in between, a bound that trusts the range less)
//   runs:   the best run of the block: max over its runs of run_tokens rows of q.(mean key of the
//           run). Reads a second summary (each run's key sum, block_tokens / run_tokens x head_dim
//           floats a block) beside the min/max, which the quantized remainder still codes against.
//           It keeps where in a block a peak sits, which the min/max loses: on the task suite it keeps
//           the facts Quest's bound drops (docs/evaluation/tasks.md). Both backends; an
//           admission message carries the run sums.
// (A third, `mass`, a softmax-mass estimate, was measured worse than `spread` on perplexity and KL
// at 2/3 of its cost, and left: docs/evaluation/block-scorers.md.)
enum class BlockScore : std::uint8_t {
  quest,
  spread,
  runs,
};

std::string_view block_score_name(BlockScore s) noexcept;
// Parses "quest", "spread" or "runs"; throws oasiskv::Error naming the text otherwise.
BlockScore parse_block_score(std::string_view text);

// The configured scorer's constants, derived once by CacheLayout::from: what every backend's
// scoring kernel reads (float, computed on the host, so backends use the same bits).
struct ScoreParams {
  BlockScore kind = BlockScore::quest;
  float half_alpha = 0.5f;  // spread: 0.5 * alpha
  int runs = 0;             // runs: runs a block (block_tokens / run_tokens); 0 for the other scorers
  float run_scale = 1.0f;   // runs: 1 / run_tokens (a run's key sum times it is its mean key)
  // Scale of a score inside the softmax_sum reduction: the softmax scale (scores are in q.k units).
  float softmax_scale = 0.0f;
};

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
  // Length limit of one sequence (appending past it is an error).
  std::int64_t max_tokens_per_sequence = 0;
  // The host tier is a pool of this many blocks, each one block_tokens-token block of one
  // sequence for every layer and kv head; sequences take blocks as they grow and forks share
  // them. 0: enough for max_sequences full-length sequences (max_sequences x
  // ceil(max_tokens_per_sequence / block_tokens)).
  std::int64_t host_pool_blocks = 0;
  // sum: measured on SmolLM2-135M (examples/smollm2) against max and softmax_sum: best or tied
  // attention-mass recall and agreement at every budget, with the fewest blocks fetched.
  GroupReduction reduction = GroupReduction::sum;
  // Scale of q.k inside the softmax_sum reduction and the remainder estimate; 0 means
  // 1/sqrt(head_dim).
  float softmax_scale = 0.0f;
  // The estimate of the non-resident blocks' attention (Cache::remainder; RemainderEstimate
  // above). Both backends. Memory: clusters keeps per block a key sum and a value sum (as many
  // floats as the key summaries) and per clustered segment as many again plus a byte per row;
  // quantized keeps remainder_bits / 16 of the fp16 rows' bytes plus 1/16 (reserved, committed as
  // rows arrive on the CPU; allocated in HBM on Cache<cuda>). An admitted sequence (Cache::admit)
  // gets its prompt's sums and clusters from the admission message, so the prefill cache must keep
  // the same estimate (make_admission sends them); quantized refuses admissions (the message
  // carries no codes).
  RemainderEstimate remainder = RemainderEstimate::none;
  // clusters: rows a cluster on average, a power of two in [4, segment rows] (at most 256 clusters
  // a segment). 16: measured on SmolLM2 (docs/evaluation/remainder.md).
  int remainder_cluster_rows = 16;
  // quantized: bits per coded key and value element, in [2, 8]. 4: measured on SmolLM2
  // (docs/evaluation/remainder.md): 3 bits lose a few tenths of a percent of perplexity more, 2 bits
  // several percent.
  int remainder_bits = 4;
  // The block scorer (BlockScore above). quest is the default: the same bits as before scorers
  // could be chosen. Every backend, the admission path and admitted sequences use it.
  BlockScore scorer = BlockScore::quest;
  // spread: the weight of the range term, in [0, 1].
  float spread_alpha = 1.0f;
  // runs: rows a run, a divisor of block_tokens. 4: the best of the run lengths simulated on the
  // task suite (docs/evaluation/tasks.md).
  int run_tokens = 4;
};

// Blocks of one clustered segment (RemainderEstimate::clusters).
inline constexpr int kClusterSegmentBlocks = 64;

// One (layer, kv head)'s share of the slot pool under a BudgetProfile (budget_profile.hpp): its
// budget, the top-K and fetch cap that follow from it, and where its slots and residency entries
// start within one sequence slot's run. Built by BudgetTable; CacheLayout points at it.
struct HeadBudget {
  int budget_blocks = 0;
  int selectable_blocks = 0;
  int fetch_cap = 0;
  int slot_offset = 0;                // first slot in a sequence's run of the layer's pool
  std::int64_t residency_offset = 0;  // first entry in a sequence's run of the residency
};
// One layer's slot pool under a BudgetProfile: where it starts in the whole slot region and the
// slots each sequence slot owns in it (the sum of the layer's head budgets).
struct LayerSlots {
  std::int64_t pool_offset = 0;
  std::int64_t sequence_slots = 0;
};

// Sizes derived from a validated CacheConfig, and the one place where slot, ring, candidate and
// array-offset arithmetic is written. Plain data: kernels take it by value, and every OASISKV_HD
// member is compiled for the device too, so host and device code index the same way.
//
// Slot numbering inside one (sequence, layer, kv head): [0, sink_blocks) sinks, then ring_blocks
// recent-ring slots, then selectable slots. Per-head arrays (summaries, residency) are indexed
// [sequence slot][layer][kv head][...] through head_index; the host tier is a pool of blocks
// reached through a per-sequence block map ([sequence slot][logical block] -> pool block).
struct CacheLayout {
  CacheConfig config;
  int group_size = 0;     // query heads per kv head
  int budget_blocks = 0;  // slots per (sequence, layer, kv head)
  int sink_blocks = 0;
  int ring_blocks = 0;        // recent_tokens / block_tokens + 1 (the tail block)
  int selectable_blocks = 0;  // budget_blocks - sink_blocks - ring_blocks: the top-K
  int fetch_cap = 0;          // admits per (sequence, layer, kv head) and step
  // The largest head's budget and top-K: budget_blocks and selectable_blocks unless a profile
  // gives some head more. The stride of per-(sequence, kv head) arrays (admits, selections,
  // residency snapshots, view rows) that every head of a profiled layout shares.
  int max_budget_blocks = 0;
  int max_selectable_blocks = 0;
  std::int64_t max_blocks = 0;          // logical blocks per sequence (fits int32: block ids are int32)
  std::int64_t block_elems = 0;         // elements in one block: 2 * block_tokens * head_dim
  std::int64_t row_elems = 0;           // elements in one appended row: kv_heads * head_dim
  std::int64_t q_row_elems = 0;         // elements in one query row: q_heads * head_dim
  std::int64_t slots_per_layer = 0;     // max_sequences * kv_heads * budget_blocks (fits int32)
  std::int64_t pool_blocks = 0;         // host pool blocks (fits int32: host block ids are int32)
  std::int64_t pool_block_elems = 0;    // elements in one pool block: num_layers x num_kv_heads x block_elems
  std::int64_t host_tier_elements = 0;  // pool_blocks x pool_block_elems
  std::int64_t summary_floats = 0;      // max and min per channel, per block
  // Floats from one (sequence, layer, kv head)'s summaries to the next: an odd number of blocks
  // (max_blocks, or one more) x 2 x head_dim. max_blocks is often a power of two (512 blocks of
  // head dim 128: 512 KiB), and the current blocks of every head of a batch of equal lengths would
  // then map to the same cache sets: the summary fold of a decode step missed the caches. An odd
  // block count spreads the heads' current blocks over distinct sets.
  std::int64_t summary_stride = 0;
  // scorer runs: each run's key sum, [sequence slot][layer][kv head] (run_stride floats each) of
  // [block][run][head_dim]; both 0 for the other scorers.
  std::int64_t run_stride = 0;
  std::int64_t run_floats = 0;
  // The memory of the remainder estimate (config.remainder): its block sums or block codes, as
  // that estimate's codec computes them (remainder_geometry.hpp; moment_offset, quantized_offset).
  RemainderGeometry remainder;
  std::int64_t residency_entries = 0;  // selectable slots of every (sequence, layer, kv head)
  float softmax_scale = 0.0f;
  ScoreParams score;  // the block scorer's constants (config.scorer and its parameters)
  // Budgets by (layer, kv head) from a non-uniform BudgetProfile (Cache's profile constructor), or
  // null: every head has budget_blocks slots (the uniform layout, every field above as written).
  // With a profile, budget_blocks, selectable_blocks and fetch_cap are the configured uniform
  // values (the mean), slots_per_layer is the largest layer's pool, and the per-head members
  // below (head_budget_blocks, slot_id with a layer, residency_offset, layer_pool_offset, ...) are
  // the ones to use. The tables belong to the Cache: a copy of its layout is valid while it lives.
  // Host memory in the Cache's layout; Cache<cuda> passes its kernels a copy that points at device
  // copies of the tables.
  const HeadBudget* head_budgets = nullptr;  // [layer][kv head]
  const LayerSlots* layer_pools = nullptr;   // [layer]
  std::int64_t sequence_residency = 0;       // residency entries per sequence slot (profiled)

  // Validates every field, with checked arithmetic for every size, and throws oasiskv::Error
  // naming the first bad value.
  static CacheLayout from(const CacheConfig& config);

  OASISKV_HD bool profiled() const noexcept { return head_budgets != nullptr; }
  OASISKV_HD int head_budget_blocks(int layer, int kv_head) const noexcept {
    return profiled() ? head_budgets[layer * config.shape.num_kv_heads + kv_head].budget_blocks : budget_blocks;
  }
  // The top-K of (layer, kv head): its budget less the pinned slots.
  OASISKV_HD int head_selectable_blocks(int layer, int kv_head) const noexcept {
    return profiled() ? head_budgets[layer * config.shape.num_kv_heads + kv_head].selectable_blocks : selectable_blocks;
  }
  // max(1, floor(fetch_ratio x the head's budget)).
  OASISKV_HD int head_fetch_cap(int layer, int kv_head) const noexcept {
    return profiled() ? head_budgets[layer * config.shape.num_kv_heads + kv_head].fetch_cap : fetch_cap;
  }
  // Residency entries of one sequence slot at `layer` (every kv head): contiguous from
  // residency_offset(seq, layer, 0).
  OASISKV_HD std::int64_t layer_residency(int layer) const noexcept {
    if (!profiled()) return static_cast<std::int64_t>(config.shape.num_kv_heads) * selectable_blocks;
    const int H = config.shape.num_kv_heads;
    const HeadBudget& last = head_budgets[layer * H + H - 1];
    return last.residency_offset + last.selectable_blocks - head_budgets[layer * H].residency_offset;
  }
  // Slots in layer `layer`'s pool, and the slots of the layers before it (SlotPool).
  OASISKV_HD std::int64_t layer_slots(int layer) const noexcept {
    return profiled() ? layer_pools[layer].sequence_slots * config.max_sequences : slots_per_layer;
  }
  OASISKV_HD std::int64_t layer_pool_offset(int layer) const noexcept {
    return profiled() ? layer_pools[layer].pool_offset : static_cast<std::int64_t>(layer) * slots_per_layer;
  }
  // Slots of every layer (the slot pool's size in blocks): num_layers x slots_per_layer, with a
  // profile too (the profile's sum is the configured total).
  OASISKV_HD std::int64_t total_slots() const noexcept {
    return layer_pool_offset(config.shape.num_layers - 1) + layer_slots(config.shape.num_layers - 1);
  }

  OASISKV_HD int num_layers() const noexcept { return config.shape.num_layers; }
  OASISKV_HD int num_q_heads() const noexcept { return config.shape.num_q_heads; }
  OASISKV_HD int num_kv_heads() const noexcept { return config.shape.num_kv_heads; }
  OASISKV_HD int head_dim() const noexcept { return config.shape.head_dim; }
  OASISKV_HD int block_tokens() const noexcept { return config.block_tokens; }

  // Blocks that hold `tokens` tokens.
  OASISKV_HD std::int64_t blocks_for(std::int64_t tokens) const noexcept {
    return (tokens + config.block_tokens - 1) / config.block_tokens;
  }
  // First logical block of the recent ring for a sequence of `tokens` tokens.
  OASISKV_HD std::int64_t ring_start(std::int64_t tokens) const noexcept {
    const std::int64_t start = blocks_for(tokens) - ring_blocks;
    return start > sink_blocks ? start : sink_blocks;
  }
  // Candidates of a plan for the NEXT step of a sequence of `len` tokens: [sink_blocks, end).
  // The next step appends `next_rows` rows (one for plain decoding, k + 1 to verify k drafts), so
  // the blocks that leave the ring during it are candidates now, but only full ones: a copy is
  // taken before the step's rows arrive and append writes through to the ring only, so a block
  // still being filled (or not begun) is never a copy target. When a step appends more rows than
  // the ring covers, the block that was partial at the plan leaves the view (remainder counts it).
  // With one row per step (and any ring) no candidate is lost: ring_start(len + 1) <= len / bt.
  OASISKV_HD std::int64_t next_step_candidates_end(std::int64_t len, std::int64_t next_rows = 1) const noexcept {
    const std::int64_t a = len / config.block_tokens, b = ring_start(len + next_rows);
    const std::int64_t last = a < b ? a : b;
    return last > sink_blocks ? last : sink_blocks;
  }
  // Candidates of the CURRENT step (observe: what the true query would select now).
  OASISKV_HD std::int64_t current_candidates_end(std::int64_t len) const noexcept { return ring_start(len); }
  // Index of (sequence slot, layer, kv head) in every per-head array.
  OASISKV_HD std::int64_t head_index(int seq_slot, int layer, int kv_head) const noexcept {
    return (static_cast<std::int64_t>(seq_slot) * config.shape.num_layers + layer) * config.shape.num_kv_heads +
           kv_head;
  }
  // Host pool (every backend): [pool block][layer][kv head][K|V][block_tokens][head_dim]. Offset in
  // elements of one (layer, kv head) block of pool block `pool_block`: one contiguous copy.
  OASISKV_HD std::int64_t host_block_offset(std::int32_t pool_block, int layer, int kv_head) const noexcept {
    return ((static_cast<std::int64_t>(pool_block) * config.shape.num_layers + layer) * config.shape.num_kv_heads +
            kv_head) *
           block_elems;
  }
  // Entry of (sequence slot, logical block) in the block map.
  OASISKV_HD std::int64_t block_map_index(int seq_slot, std::int64_t block) const noexcept {
    return static_cast<std::int64_t>(seq_slot) * max_blocks + block;
  }
  // Summaries: [sequence slot][layer][kv head] (summary_stride floats each) of [block][max | min]
  // [head_dim] floats: one (sequence, layer, kv head)'s blocks are contiguous.
  OASISKV_HD std::int64_t summary_offset(int seq_slot, int layer, int kv_head, std::int64_t block) const noexcept {
    return head_index(seq_slot, layer, kv_head) * summary_stride + block * 2 * config.shape.head_dim;
  }
  // Run key sums of one block (scorer runs): score.runs x head_dim floats.
  OASISKV_HD std::int64_t run_offset(int seq_slot, int layer, int kv_head, std::int64_t block) const noexcept {
    return head_index(seq_slot, layer, kv_head) * run_stride + block * score.runs * config.shape.head_dim;
  }
  // The sums (key sum | value sum) of one block: remainder.moment_vectors x head_dim
  // floats, one (sequence, layer, kv head)'s blocks contiguous.
  OASISKV_HD std::int64_t moment_offset(int seq_slot, int layer, int kv_head, std::int64_t block) const noexcept {
    return head_index(seq_slot, layer, kv_head) * remainder.moment_stride +
           block * remainder.moment_vectors * config.shape.head_dim;
  }
  // Codes of one block (RemainderEstimate::quantized): remainder.quantized_block_bytes bytes, one
  // (sequence, layer, kv head)'s blocks contiguous.
  OASISKV_HD std::int64_t quantized_offset(int seq_slot, int layer, int kv_head, std::int64_t block) const noexcept {
    return (head_index(seq_slot, layer, kv_head) * max_blocks + block) * remainder.quantized_block_bytes;
  }
  // Residency of the selectable slots: [sequence slot][layer][kv head][selectable_blocks] (with a
  // profile: each head's own selectable count, packed in the same order).
  OASISKV_HD std::int64_t residency_offset(int seq_slot, int layer, int kv_head) const noexcept {
    if (profiled()) {
      return static_cast<std::int64_t>(seq_slot) * sequence_residency +
             head_budgets[layer * config.shape.num_kv_heads + kv_head].residency_offset;
    }
    return head_index(seq_slot, layer, kv_head) * selectable_blocks;
  }
  // Slot id within a layer's slot pool (fits int32: checked by from()). Uniform layouts only: the
  // form with a layer below serves both.
  OASISKV_HD std::int32_t slot_id(int seq_slot, int kv_head, int local_slot) const noexcept {
    return static_cast<std::int32_t>(
        (static_cast<std::int64_t>(seq_slot) * config.shape.num_kv_heads + kv_head) * budget_blocks + local_slot);
  }
  // Slot id within layer `layer`'s pool: [sequence slot][kv head][the head's budget] (with a
  // profile, a sequence's run is the layer's head budgets back to back).
  OASISKV_HD std::int32_t slot_id(int seq_slot, int layer, int kv_head, int local_slot) const noexcept {
    if (!profiled()) return slot_id(seq_slot, kv_head, local_slot);
    return static_cast<std::int32_t>(static_cast<std::int64_t>(seq_slot) * layer_pools[layer].sequence_slots +
                                     head_budgets[layer * config.shape.num_kv_heads + kv_head].slot_offset +
                                     local_slot);
  }
  // Local slot of a pinned block (a sink, or its place in the recent ring).
  // Whether logical block `block` of a sequence of `tokens` tokens is pinned: a sink, or in the
  // recent ring (what an admitted sequence keeps locally; the rest may stay remote).
  OASISKV_HD bool pinned_block(std::int64_t block, std::int64_t tokens) const noexcept {
    return block < sink_blocks || block >= ring_start(tokens);
  }
  OASISKV_HD int pinned_slot(std::int64_t block) const noexcept {
    return block < sink_blocks ? static_cast<int>(block) : sink_blocks + static_cast<int>(block % ring_blocks);
  }
  // Local slot of selectable slot j.
  OASISKV_HD int selectable_slot(int j) const noexcept { return sink_blocks + ring_blocks + j; }
  // Admits allowed to a plan, numbered from 0 since its (sequence, layer)'s resident set was last
  // empty: that first plan (the working set after prefill) is not capped.
  OASISKV_HD int admit_cap(std::int64_t plans_since_empty) const noexcept {
    return plans_since_empty == 0 ? selectable_blocks : fetch_cap;
  }
  // The same for one (layer, kv head) of a profiled layout.
  OASISKV_HD int admit_cap(std::int64_t plans_since_empty, int layer, int kv_head) const noexcept {
    return plans_since_empty == 0 ? head_selectable_blocks(layer, kv_head) : head_fetch_cap(layer, kv_head);
  }
  // The blocks the top-K of every kv head at `layer` selects among n candidates: the sum of
  // min(selectable, n) (Statistics).
  OASISKV_HD std::int64_t layer_selected(int layer, std::int64_t n) const noexcept {
    std::int64_t sum = 0;
    for (int h = 0; h < config.shape.num_kv_heads; ++h) {
      const std::int64_t k = head_selectable_blocks(layer, h);
      sum += k < n ? k : n;
    }
    return sum;
  }
};

}  // namespace v0
}  // namespace oasiskv
