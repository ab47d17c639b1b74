// AdmissionMessage: what a prefill process sends a decode process so that the decode side can
// admit a request without the prompt's KV (prefill-decode disaggregation with partial fetching):
// the shape and length, every block's key summary, the first working set as rows, and where the
// rest lives in the prefill side's registered memory (addresses and the packed remote key of one
// registration per request). The format is versioned and self-checking: decode() refuses a
// truncated, corrupted or unknown-version message, and check_admission() one whose shape, element
// type or sizes do not fit a cache, each with an oasiskv::Error naming the field, before anything
// is admitted. Transport-neutral: the bytes travel however the engine likes (UCX active messages
// in the remote tier).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "oasiskv/config.hpp"
#include "oasiskv/dtype.hpp"

namespace oasiskv {
inline namespace v0 {

inline constexpr std::uint32_t kAdmissionMagic = 0x41564b4fu;  // "OKVA", little-endian
// 2: the first plan's lookahead queries; 3: the blocks' sums (the remainder estimate's);
// 4: the prompt's key clusters (RemainderEstimate::clusters); 5: the run key sums (scorer runs).
inline constexpr std::uint32_t kAdmissionVersion = 5;

struct AdmissionMessage {
  std::uint64_t request_id = 0;  // the prefill side's handle: released with it
  ModelShape shape;
  int block_tokens = 0;
  DType dtype = DType::f32;
  std::int64_t length = 0;  // prompt tokens
  // Key summaries of every block: [layer][kv head][block][max | min][head_dim] floats, blocks_for(length)
  // blocks (SummaryStore's per-sequence layout).
  std::vector<float> summaries;
  // The key sum | value sum of every block (`remainder = clusters`): moment_vectors (0: none sent,
  // or 2) vectors of head_dim floats per block, [layer][kv head][block][vector][head_dim],
  // blocks_for(length) blocks. A decode cache with that estimate admits only a message with them.
  std::int32_t moment_vectors = 0;
  std::vector<float> moments;
  // The run key sums of every block (scorer runs): run_tokens rows a run (0: none sent, else a
  // divisor of block_tokens), [layer][kv head][block][run][head_dim], block_tokens / run_tokens
  // runs a block, blocks_for(length) blocks; a run past the prompt's end is zero. A decode cache
  // with the runs scorer admits only a message with them, of its run_tokens; others ignore them.
  std::int32_t run_tokens = 0;
  std::vector<float> run_sums;
  // The key clusters of the prompt's first cluster_segments segments (RemainderEstimate::clusters:
  // kClusterSegmentBlocks blocks a segment, cluster_rows rows a cluster on average; 0 segments:
  // none sent), for every (layer, kv head) in that order and segment: each row's cluster id
  // (cluster_ids: [layer][kv head][segment][segment rows]), each cluster's key sum | value sum
  // (cluster_sums: [..][segment][cluster][2][head_dim]) and row count (cluster_counts). A decode
  // cache with the clusters estimate and the same cluster_rows takes them; one without ignores them.
  std::int32_t cluster_rows = 0;
  std::int32_t cluster_segments = 0;
  std::vector<std::uint8_t> cluster_ids;
  std::vector<float> cluster_sums;
  std::vector<std::int32_t> cluster_counts;
  // The first working set, per (layer, kv head) in that order: how many blocks, then their logical
  // ids (ascending) in working_set_blocks, and their rows ([K|V][block_tokens][head_dim] elements
  // of dtype each, in the same order) in working_set_rows.
  std::vector<std::int32_t> working_set_counts;
  std::vector<std::int32_t> working_set_blocks;
  std::vector<std::byte> working_set_rows;
  // The prefill side's copy: logical block b of (layer, kv head) starts at remote address
  // block_addresses[b] + (layer * kv_heads + kv_head) * block bytes (a host pool block holds every
  // layer and kv head of one block, as HostBlockPool's do); all inside [region_base,
  // region_base + region_bytes), the memory one remote key grants.
  std::vector<std::uint64_t> block_addresses;
  std::uint64_t region_base = 0;
  std::uint64_t region_bytes = 0;
  std::vector<std::byte> packed_rkey;
  // The first plan's lookahead queries (Cache::prefetch's q_lookahead, as floats): lookahead_rows
  // rows per layer, [layer][row][num_q_heads][head_dim], and the rows the first decode step
  // appends. The decode side makes that plan itself, so its resident set evolves exactly as a
  // single-process run's; the working set's rows serve its copies.
  std::int32_t lookahead_rows = 1;
  std::int64_t next_step_rows = 1;
  std::vector<float> lookahead_queries;
  // The engine's own bytes (for example the first generated token and the prompt's tokens for its
  // drafter); the library carries them and does not read them.
  std::vector<std::byte> user_data;

  // Elements of one block of one (layer, kv head): 2 x block_tokens x head_dim.
  std::int64_t block_elems() const noexcept { return 2 * static_cast<std::int64_t>(block_tokens) * shape.head_dim; }
};

// The message as bytes: a header (magic, version, payload size, FNV-1a checksum of the payload),
// then every field, little-endian.
std::vector<std::byte> encode_admission(const AdmissionMessage& message);
// Parses and checks the message on its own (header, checksum, every count against the shape and
// length, every address inside the region); throws oasiskv::Error naming what is wrong.
AdmissionMessage decode_admission(std::span<const std::byte> bytes);
// Whether a decoded message fits a cache of `layout` and element type `dtype`: the same shape and
// block size, a length the cache can hold, at most the budget's blocks per working set (with a
// BudgetProfile: the larger of the uniform budget and that head's), the
// cache's block sums when it keeps them (`remainder = clusters`, CacheLayout::remainder; a
// cache without that estimate ignores the message's), its run key sums when it scores by runs
// (the same run_tokens), a quantized cache refused. Throws
// oasiskv::Error naming the first mismatch.
void check_admission(const AdmissionMessage& message, const CacheLayout& layout, DType dtype);

}  // namespace v0
}  // namespace oasiskv
