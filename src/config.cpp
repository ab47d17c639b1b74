#include "oasiskv/config.hpp"

#include <cmath>
#include <cstdint>
#include <limits>

#include "oasiskv/detail/checked.hpp"
#include "oasiskv/error.hpp"
#include "oasiskv/kit/key_clusters_format.hpp"
#include "oasiskv/kit/quantized_rows.hpp"

namespace oasiskv {
inline namespace v0 {

std::string_view reduction_name(GroupReduction r) noexcept {
  switch (r) {
    case GroupReduction::max: return "max";
    case GroupReduction::sum: return "sum";
    case GroupReduction::softmax_sum: return "softmax_sum";
  }
  return "unknown";
}

GroupReduction parse_reduction(std::string_view text) {
  for (GroupReduction r : {GroupReduction::max, GroupReduction::sum, GroupReduction::softmax_sum}) {
    if (text == reduction_name(r)) return r;
  }
  fail("unknown group reduction '{}' (expected max, sum or softmax_sum)", text);
}

std::string_view remainder_name(RemainderEstimate r) noexcept {
  switch (r) {
    case RemainderEstimate::none: return "none";
    case RemainderEstimate::clusters: return "clusters";
    case RemainderEstimate::quantized: return "quantized";
  }
  return "unknown";
}

RemainderEstimate parse_remainder(std::string_view text) {
  for (RemainderEstimate r : {RemainderEstimate::none, RemainderEstimate::clusters, RemainderEstimate::quantized}) {
    if (text == remainder_name(r)) return r;
  }
  fail("unknown remainder estimate '{}' (expected none, clusters or quantized)", text);
}

std::string_view block_score_name(BlockScore s) noexcept {
  switch (s) {
    case BlockScore::quest: return "quest";
    case BlockScore::spread: return "spread";
    case BlockScore::runs: return "runs";
  }
  return "unknown";
}

BlockScore parse_block_score(std::string_view text) {
  for (BlockScore s : {BlockScore::quest, BlockScore::spread, BlockScore::runs}) {
    if (text == block_score_name(s)) return s;
  }
  fail("unknown block scorer '{}' (expected quest, spread or runs)", text);
}

CacheLayout CacheLayout::from(const CacheConfig& c) {
  const ModelShape& s = c.shape;
  if (s.num_layers <= 0) fail("CacheConfig: num_layers must be positive, got {}", s.num_layers);
  if (s.num_q_heads <= 0) fail("CacheConfig: num_q_heads must be positive, got {}", s.num_q_heads);
  if (s.num_kv_heads <= 0) {
    fail("CacheConfig: num_kv_heads must be positive, got {}", s.num_kv_heads);
  }
  if (s.num_q_heads % s.num_kv_heads != 0) {
    fail("CacheConfig: num_q_heads ({}) is not a multiple of num_kv_heads ({})", s.num_q_heads, s.num_kv_heads);
  }
  if (s.head_dim <= 0) fail("CacheConfig: head_dim must be positive, got {}", s.head_dim);
  if (c.block_tokens <= 0) fail("CacheConfig: block_tokens must be positive, got {}", c.block_tokens);
  if (c.budget_tokens <= 0 || c.budget_tokens % c.block_tokens != 0) {
    fail("CacheConfig: budget_tokens ({}) must be a positive multiple of block_tokens ({})", c.budget_tokens,
         c.block_tokens);
  }
  if (c.sink_tokens < 0 || c.sink_tokens % c.block_tokens != 0) {
    fail("CacheConfig: sink_tokens ({}) must be a non-negative multiple of block_tokens ({})", c.sink_tokens,
         c.block_tokens);
  }
  if (c.recent_tokens < 0 || c.recent_tokens % c.block_tokens != 0) {
    fail("CacheConfig: recent_tokens ({}) must be a non-negative multiple of block_tokens ({})", c.recent_tokens,
         c.block_tokens);
  }
  if (!(c.fetch_ratio > 0.0 && c.fetch_ratio <= 1.0)) {
    fail("CacheConfig: fetch_ratio must be in (0, 1], got {}", c.fetch_ratio);
  }
  if (c.max_sequences <= 0) {
    fail("CacheConfig: max_sequences must be positive, got {}", c.max_sequences);
  }
  if (c.max_tokens_per_sequence <= 0) {
    fail("CacheConfig: max_tokens_per_sequence must be positive, got {}", c.max_tokens_per_sequence);
  }
  if (!(c.softmax_scale >= 0.0f) || std::isinf(c.softmax_scale)) {
    fail("CacheConfig: softmax_scale must be finite and >= 0 (0 = 1/sqrt(head_dim)), got {}", c.softmax_scale);
  }
  if (reduction_name(c.reduction) == "unknown") {
    fail("CacheConfig: unknown reduction value {}", static_cast<int>(c.reduction));
  }

  CacheLayout l;
  l.config = c;
  l.group_size = s.num_q_heads / s.num_kv_heads;
  l.budget_blocks = c.budget_tokens / c.block_tokens;
  l.sink_blocks = c.sink_tokens / c.block_tokens;
  l.ring_blocks = c.recent_tokens / c.block_tokens + 1;
  if (l.budget_blocks < l.sink_blocks + l.ring_blocks) {
    fail(
        "CacheConfig: budget_tokens ({}) is smaller than the pinned blocks: {} sink + {} recent-ring "
        "blocks of {} tokens ({} tokens)",
        c.budget_tokens, l.sink_blocks, l.ring_blocks, c.block_tokens,
        (l.sink_blocks + l.ring_blocks) * c.block_tokens);
  }
  l.selectable_blocks = l.budget_blocks - l.sink_blocks - l.ring_blocks;
  const auto cap = static_cast<int>(std::floor(c.fetch_ratio * l.budget_blocks));
  l.fetch_cap = cap < 1 ? 1 : cap;
  l.max_budget_blocks = l.budget_blocks;
  l.max_selectable_blocks = l.selectable_blocks;
  // Sizes: every product checked, so a "no limit" capacity is refused instead of wrapping.
  using detail::checked_product;
  l.max_blocks = c.max_tokens_per_sequence / c.block_tokens + (c.max_tokens_per_sequence % c.block_tokens != 0);
  constexpr std::int64_t int32_max = std::numeric_limits<std::int32_t>::max();
  if (l.max_blocks > int32_max) {
    fail(
        "CacheConfig: max_tokens_per_sequence ({}) needs {} blocks of {} tokens, more than the {} block ids "
        "(int32) a sequence may have",
        c.max_tokens_per_sequence, l.max_blocks, c.block_tokens, int32_max);
  }
  l.block_elems =
      checked_product("CacheConfig: elements per block (2 x block_tokens x head_dim)", 2, c.block_tokens, s.head_dim);
  l.row_elems = checked_product("CacheConfig: elements per row (num_kv_heads x head_dim)", s.num_kv_heads, s.head_dim);
  l.q_row_elems =
      checked_product("CacheConfig: elements per query row (num_q_heads x head_dim)", s.num_q_heads, s.head_dim);
  l.slots_per_layer = checked_product("CacheConfig: slots per layer (max_sequences x num_kv_heads x budget blocks)",
                                      c.max_sequences, s.num_kv_heads, l.budget_blocks);
  if (l.slots_per_layer > int32_max) {
    fail(
        "CacheConfig: {} slots per layer (max_sequences {} x num_kv_heads {} x {} budget blocks) is more than "
        "the {} slot ids (int32) a LayerView holds",
        l.slots_per_layer, c.max_sequences, s.num_kv_heads, l.budget_blocks, int32_max);
  }
  checked_product("CacheConfig: slot pool elements (num_layers x slots per layer x block elements x 4 bytes)",
                  s.num_layers, l.slots_per_layer, l.block_elems, 4);
  checked_product("CacheConfig: block map entries (max_sequences x blocks per sequence x 4 bytes)", c.max_sequences,
                  l.max_blocks, 4);
  if (c.host_pool_blocks < 0) {
    fail("CacheConfig: host_pool_blocks must be >= 0 (0 = room for max_sequences full-length sequences), got {}",
         c.host_pool_blocks);
  }
  l.pool_blocks = c.host_pool_blocks > 0
                      ? c.host_pool_blocks
                      : checked_product("CacheConfig: default host pool blocks (max_sequences x blocks per sequence)",
                                        c.max_sequences, l.max_blocks);
  if (l.pool_blocks > int32_max) {
    fail("CacheConfig: a host pool of {} blocks is more than the {} host block ids (int32); set host_pool_blocks",
         l.pool_blocks, int32_max);
  }
  l.pool_block_elems =
      checked_product("CacheConfig: elements per host pool block (num_layers x num_kv_heads x block elements)",
                      s.num_layers, s.num_kv_heads, l.block_elems);
  l.host_tier_elements = checked_product("CacheConfig: host pool elements (pool blocks x elements per pool block)",
                                         l.pool_blocks, l.pool_block_elems);
  checked_product("CacheConfig: host pool bytes", l.host_tier_elements, 4);
  l.summary_stride = checked_product("CacheConfig: summary floats per kv head (blocks x 2 x head_dim)",
                                     l.max_blocks | 1, 2, s.head_dim);  // odd: see summary_stride
  l.summary_floats =
      checked_product("CacheConfig: summary floats (sequences x layers x kv heads x odd blocks x 2 x head_dim)",
                      c.max_sequences, s.num_layers, s.num_kv_heads, l.summary_stride);
  checked_product("CacheConfig: summary bytes", l.summary_floats, 4);
  if (remainder_name(c.remainder) == "unknown") {
    fail("CacheConfig: remainder has no estimate of value {}", static_cast<int>(c.remainder));
  }
  // Every field is validated whatever the estimate, so that a value the estimate in use does not
  // read is not silently kept (its range alone; how it fits the blocks only where it is used).
  if (const int r = c.remainder_cluster_rows; r < 4 || (r & (r - 1)) != 0) {
    fail("CacheConfig: remainder_cluster_rows must be a power of two, at least 4, got {}", r);
  }
  if (c.remainder_bits < kMinQuantizedBits || c.remainder_bits > kMaxQuantizedBits) {
    fail("CacheConfig: remainder_bits must be in [{}, {}], got {}", kMinQuantizedBits, kMaxQuantizedBits,
         c.remainder_bits);
  }
  // The estimate's memory, as its codec lays it out (remainder_geometry.hpp); none: all 0.
  if (c.remainder == RemainderEstimate::clusters) l.remainder = clusters_geometry(c, l.max_blocks);
  if (c.remainder == RemainderEstimate::quantized) l.remainder = quantized_geometry(c, l.max_blocks);
  l.residency_entries = checked_product("CacheConfig: residency entries", c.max_sequences, s.num_layers, s.num_kv_heads,
                                        l.selectable_blocks);
  l.softmax_scale = c.softmax_scale > 0.0f ? c.softmax_scale : 1.0f / std::sqrt(static_cast<float>(s.head_dim));
  // Checked whatever the scorer, so a config stays valid when only the scorer changes.
  if (!(c.spread_alpha >= 0.0f && c.spread_alpha <= 1.0f)) {
    fail("CacheConfig: spread_alpha must be in [0, 1], got {}", c.spread_alpha);
  }
  if (c.run_tokens <= 0 || c.block_tokens % c.run_tokens != 0) {
    fail("CacheConfig: run_tokens must divide block_tokens ({}), got {}", c.block_tokens, c.run_tokens);
  }
  if (block_score_name(c.scorer) == "unknown") {
    fail("CacheConfig: unknown scorer value {}", static_cast<int>(c.scorer));
  }
  l.score.kind = c.scorer;
  l.score.half_alpha = 0.5f * c.spread_alpha;
  l.score.softmax_scale = l.softmax_scale;
  if (c.scorer == BlockScore::runs) {
    l.score.runs = c.block_tokens / c.run_tokens;
    l.score.run_scale = 1.0f / static_cast<float>(c.run_tokens);
    // The same odd block count as summary_stride, for the same reason.
    l.run_stride = checked_product("CacheConfig: run floats per kv head (blocks x runs x head_dim)", l.max_blocks | 1,
                                   l.score.runs, s.head_dim);
    l.run_floats = checked_product("CacheConfig: run floats (sequences x layers x kv heads x run floats per kv head)",
                                   c.max_sequences, s.num_layers, s.num_kv_heads, l.run_stride);
    checked_product("CacheConfig: run bytes", l.run_floats, 4);
  }
  return l;
}

}  // namespace v0
}  // namespace oasiskv
