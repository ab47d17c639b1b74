// The CUDA backend's kernels as host-callable operations. Declarations only: the kernels are
// templated device code in oasiskv/cuda/kernels/*.cuh, instantiated once in cuda/kernels.cu (for
// float, fp16_t and bf16_t) and linked from target oasiskv::cuda.
//
// Host-only: this header compiles with g++ as well as nvcc, so tests and engines need not be
// CUDA translation units. Every pointer argument is a device pointer (or a mapped pinned host
// pointer where said). Every operation only enqueues work on `stream`: none synchronises the
// host or copies device -> host, so a decode step can be captured in a CUDA graph. Bad
// arguments and launch errors become oasiskv::Error (see check.hpp).
//
// Geometry: every operation takes the cache's CacheLayout (oasiskv/config.hpp), which kernels
// receive by value; its OASISKV_HD members (ring_start, slot_id, residency_offset, ...) are the
// one definition of the array layouts, shared with the CPU backend:
//   host tier   a pool: [pool block][layer][kv head][K|V][block_tokens][head_dim], reached through
//               the block map [sequence slot][logical block] -> pool block (DeviceHostTier)
//   summaries   [sequence slot][layer][kv head][block][max|min][head_dim] floats
//   run sums    [sequence slot][layer][kv head] run_stride floats of [block][run][head_dim] (scorer
//               runs: each run's key sum, CacheLayout::run_offset)
//   moments     [sequence slot][layer][kv head] moment_stride floats of [block][key sum | value sum
//               (| key sum of squares)][head_dim] (CacheLayout::moment_offset; remainder estimate)
//   layer pool  slot_id(seq slot, layer, kv head, local slot) * block_elems (one pool per layer)
//   residency   [sequence slot][layer][kv head][selectable_blocks] (res_block int32, res_last int64)
// Per-pair rows of admits, selections and snapshots have max_selectable_blocks entries. With a
// budget profile (CacheLayout::profiled) each kv head has its own budget, top-K, fetch cap and
// slot and residency offsets; the layout's head_budgets and layer_pools must then point at
// device copies of the BudgetTable (kernels read them; Cache<cuda> makes them), and a host
// wrapper below reads none of them.
//
// Grids: the (batch entry, kv head) pairs or batch entries are on gridDim.x (up to 2^31 - 1);
// the small dimension (candidate tiles, admits, channel chunks, query heads) is on gridDim.y,
// which CUDA limits to 65,535: an operation whose y would exceed it throws oasiskv::Error.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include <cuda_runtime_api.h>

#include "oasiskv/config.hpp"
#include "oasiskv/cuda/check.hpp"
#include "oasiskv/dtype.hpp"
#include "oasiskv/kit/block_copy.hpp"
#include "oasiskv/kit/key_clusters_format.hpp"
#include "oasiskv/view.hpp"

namespace oasiskv {
inline namespace v0 {
namespace gpu {

// A batch on the device: entry i is sequence slot seq_slot[i] with seq_len[i] tokens (before the
// call for append, current for scoring and planning). Pair p = i * num_kv_heads + h.
struct DeviceBatch {
  int size = 0;
  const std::int32_t* seq_slot = nullptr;
  const std::int64_t* seq_len = nullptr;
};

// The host tier as kernels see it: the pool's device-accessible base (the mapped pointer of the
// pinned pool) and the block map in device memory ([max_sequences][max_blocks] pool block ids,
// HostBlockPool's map). Entries a kernel reads are mapped ones.
template <class T>
struct DeviceHostTier {
  T* base = nullptr;
  const std::int32_t* block_map = nullptr;
  OASISKV_HD T* block(const CacheLayout& g, int seq_slot, int layer, int kv_head, std::int64_t block) const noexcept {
    return base + g.host_block_offset(block_map[g.block_map_index(seq_slot, block)], layer, kv_head);
  }
};

// ---- append: host tier + pinned slots + summaries ----------------------------------------------

// Appends rows [row_offset[i], row_offset[i+1]) of k and v ([rows][kv_heads][head_dim]) to batch
// entry i at `layer`: writes them to the host tier (its blocks must be mapped, see HostBlockPool),
// to the pinned slots (sinks and recent ring) of layer_pool, and folds the keys into the summaries
// (the block's first row resets its summary, later rows take the channel-wise max and min). Does
// not change seq_len.
template <KvElement T>
void append(const CacheLayout& g, int layer, const DeviceBatch& batch, const std::int32_t* row_offset, const T* k,
            const T* v, const DeviceHostTier<T>& host_tier, T* layer_pool, float* summaries, cudaStream_t stream);
// Copy on write: every (layer, kv head) block of pool block `to` = that of pool block `from`.
template <KvElement T>
void clone_host_block(const CacheLayout& g, T* host_base, std::int32_t from, std::int32_t to, cudaStream_t stream);

// ---- truncate ------------------------------------------------------------------------------------

// After (seq_slot, layer) dropped its rows from `length` on (host rows unchanged below it): the
// summary of the block that becomes partial is refolded from its host rows in order (bit-identical
// to a sequence that never had the dropped rows), and the recent ring of the new length is copied
// from the host tier into its pinned slots. Run it on the stream that appends (it touches what
// append touches).
template <KvElement T>
void truncate_rows(const CacheLayout& g, int seq_slot, int layer, std::int64_t length,
                   const DeviceHostTier<T>& host_tier, T* layer_pool, float* summaries, cudaStream_t stream);
// A fork at `layer`: dst_slot (whose block map already shares src_slot's blocks) gets src_slot's
// summaries of the blocks before length / block_tokens, the partial block's summary refolded from
// its first rows, and its sinks and recent ring copied from the host tier into its pinned slots.
template <KvElement T>
void fork_rows(const CacheLayout& g, int src_slot, int dst_slot, int layer, std::int64_t length,
               const DeviceHostTier<T>& host_tier, T* layer_pool, float* summaries, cudaStream_t stream);

// ---- run key sums (CacheConfig::scorer runs) ----------------------------------------------------

// run_sums: [sequence slot][layer][kv head] of CacheLayout::run_stride floats, block b's at
// run_offset: [run][head_dim], each run of run_tokens rows' key sum. append's companion: folds the
// same rows' keys (same arguments as append) into their runs, in row order, a run's first row
// resetting it: bit-identical to the CPU's SummaryStore. Run it on append's stream.
template <KvElement T>
void append_run_sums(const CacheLayout& g, int layer, const DeviceBatch& batch, const std::int32_t* row_offset,
                     const T* k, float* run_sums, cudaStream_t stream);
// truncate_rows' and fork_rows' companion: dst_slot's run sums of blocks [0, length / block_tokens)
// copied from src_slot when src_slot != dst_slot (a fork), the partial block's refolded from its
// host rows. src_slot == dst_slot: a truncate.
template <KvElement T>
void rebuild_run_sums(const CacheLayout& g, int src_slot, int dst_slot, int layer, std::int64_t length,
                      const DeviceHostTier<T>& host_tier, float* run_sums, cudaStream_t stream);

// Frees the selectable slots of (seq_slot, layer) that hold a block >= cut (residency layout as
// clear_residency's). Run it on the stream that plans.
void truncate_residency(const CacheLayout& g, int seq_slot, int layer, std::int64_t cut, std::int32_t* res_block,
                        std::int64_t* res_last, cudaStream_t stream);

// ---- remainder moments (CacheConfig::remainder not none) -----------------------------------------

// moments: [sequence slot][layer][kv head] of CacheLayout::remainder.moment_stride floats, block b of a head at
// moment_offset: [key sum | value sum (| key sum of squares: the variance estimate)][head_dim].
// append's companion: folds the same rows (same arguments as append) into their blocks' moments, in
// row order, a block's first row resetting them: bit-identical to the CPU's SummaryStore. Run it
// on append's stream.
template <KvElement T>
void append_moments(const CacheLayout& g, int layer, const DeviceBatch& batch, const std::int32_t* row_offset,
                    const T* k, const T* v, float* moments, cudaStream_t stream);
// truncate_rows' and fork_rows' companion: dst_slot's moments of blocks [0, length / block_tokens)
// copied from src_slot when src_slot != dst_slot (a fork), the partial block's refolded from its
// host rows. src_slot == dst_slot: a truncate.
template <KvElement T>
void rebuild_moments(const CacheLayout& g, int src_slot, int dst_slot, int layer, std::int64_t length,
                     const DeviceHostTier<T>& host_tier, float* moments, cudaStream_t stream);

// ---- scoring ------------------------------------------------------------------------------------

// Scores of the candidate blocks of every pair: scores[p * stride + j] for block first[p] + j,
// j < count[p]. `bounds` is scratch for GroupReduction::softmax_sum, at least
// pairs * rows_per_seq * group_size * stride floats (may be null for max and sum).
struct ScoreBuffers {
  float* scores = nullptr;
  std::int32_t* count = nullptr;
  std::int32_t* first = nullptr;
  float* bounds = nullptr;
  int stride = 0;  // >= max_blocks - sink_blocks
};

// q: [batch * rows_per_seq][num_q_heads][head_dim] lookahead rows, element type QT (float or T).
// summaries: the min/max summaries for BlockScore quest and spread; under runs, the run key sums
// (append_run_sums' layout).
// Same float arithmetic, in the same order, as LookaheadSelector::score: bit-identical for max and
// sum; softmax_sum uses CUDA's expf (not glibc's), so it matches to a few ulp only.
// candidates: Candidates::next_step scores [sink_blocks, next_step_candidates_end(len, next_rows))
// (a plan for a next step that appends next_rows rows); Candidates::current scores [sink_blocks,
// current_candidates_end(len)), the blocks outside the pinned ones now (what the true query would
// select).
enum class Candidates : std::uint8_t { next_step, current };
template <class QT>
void score_blocks(const CacheLayout& g, int layer, const DeviceBatch& batch, const QT* q, int rows_per_seq,
                  const float* summaries, const ScoreBuffers& out, cudaStream_t stream,
                  Candidates candidates = Candidates::next_step, int next_rows = 1);

// Segment s: scores[s * stride + j], j < count[s]. Writes the min(k, count[s]) best as block
// indices first[s] + j, best first, to selected[s * k + ...] and their number to
// selected_count[s]. Order (ScoreOrder's): higher score first; equal scores go to the lower
// index; -0.0 == +0.0; a NaN ranks below every number (below -inf), NaNs among themselves by
// index. k <= kMaxTopK.
inline constexpr int kMaxTopK = 4096;
void segmented_top_k(const float* scores, int stride, const std::int32_t* count, const std::int32_t* first,
                     int num_segments, int k, std::int32_t* selected, std::int32_t* selected_count,
                     cudaStream_t stream);
// The same with a top-K per kv head: segment s (pair s of a batch) takes at most
// head_budgets[s % num_kv_heads].selectable_blocks (<= k, still the stride); head_budgets is one
// layer's row of a profiled layout's device table (CacheLayout::head_budgets + layer x kv heads),
// or null for k everywhere.
void segmented_top_k(const float* scores, int stride, const std::int32_t* count, const std::int32_t* first,
                     int num_segments, int k, const HeadBudget* head_budgets, int num_kv_heads, std::int32_t* selected,
                     std::int32_t* selected_count, cudaStream_t stream);

// ---- transfer planning ---------------------------------------------------------------------------

// Same layout as oasiskv::Admit.
struct DeviceAdmit {
  std::int32_t block = -1;
  std::int32_t slot = 0;
  std::int32_t evicted = -1;
};

// Plans of every pair: admits[p * max_selectable_blocks + a], a < admit_count[p];
// kept[p * sel_stride + k], k < kept_count[p]; capped[p]. Any of kept, kept_count, capped may be
// null.
struct PlanBuffers {
  DeviceAdmit* admits = nullptr;
  std::int32_t* admit_count = nullptr;
  std::int32_t* kept = nullptr;
  std::int32_t* kept_count = nullptr;
  std::int32_t* capped = nullptr;
};

// TransferPlanner::plan followed by apply() for every pair, with the same rules and ties.
// selected/selected_count: segmented_top_k's output (stride sel_stride). steps[i]: the step that
// batch entry i's kept and admitted slots are stamped with; caps[p]: the admit cap of pair p =
// (entry p / kv_heads, kv head p % kv_heads) (the host computes it with CacheLayout::admit_cap,
// per kv head with a profile; a negative cap counts as 0). res_block/res_last: the residency
// (layout above), updated in place.
void plan_transfers(const CacheLayout& g, int layer, const DeviceBatch& batch, const std::int64_t* steps,
                    const std::int32_t* caps, const std::int32_t* selected, const std::int32_t* selected_count,
                    int sel_stride, std::int32_t* res_block, std::int64_t* res_last, const PlanBuffers& out,
                    cudaStream_t stream);

// Empties the selectable slots of (seq_slot, layer): res_block = kNoBlock (-1), res_last = -1 for
// every kv head. seq_slot = -1: every sequence slot; layer = -1: every layer (both -1: the whole
// residency). One kernel (capturable); throws oasiskv::Error for a slot or layer out of range.
void clear_residency(const CacheLayout& g, int seq_slot, int layer, std::int32_t* res_block, std::int64_t* res_last,
                     cudaStream_t stream);

// ---- gather copies ---------------------------------------------------------------------------------

// Copies every admit of every pair from the host tier (pinned mapped memory, read zero-copy)
// into its selectable slot of layer_pool. One launch. Blocks the host map marks kRemoteBlock come
// from staging[p * max_selectable_blocks + a] (mapped pinned memory the host filled first).
template <KvElement T>
void gather_admits(const CacheLayout& g, int layer, const DeviceBatch& batch, const DeviceAdmit* admits,
                   const std::int32_t* admit_count, const DeviceHostTier<T>& host_tier, T* layer_pool,
                   cudaStream_t stream, const T* staging = nullptr);

// Generic gather: copies[c] for c < *count (copies and count device-accessible; max_count bounds
// the grid). Sources and destinations are device memory, or mapped pinned host memory (read
// zero-copy).
void gather_copies(const BlockCopy* copies, const std::int32_t* count, int max_count, cudaStream_t stream);

// ---- Cache<cuda> helpers ----------------------------------------------------------------------

// Writes words[0, count) to dst (device) from kernel parameters: no host staging, so nothing is
// read from host memory when the kernel runs, and a captured CUDA graph holds the values
// themselves. One launch per kUploadWords words (a launch's parameters stay under 4 KB).
inline constexpr int kUploadWords = 1000;
struct WordBlock {
  std::uint32_t* dst = nullptr;
  int count = 0;
  std::uint32_t words[kUploadWords];
};
void upload_words(std::uint32_t* dst, std::span<const std::uint32_t> words, cudaStream_t stream);

// After plan_transfers: snapshot[i] = the residency of batch entry i at `layer` ([kv head]
// [max_selectable_blocks], a head's row padded with kNoBlock past its selectable slots), and
// counters[0] += admits, counters[1] += capped
// (summed over the batch's pairs; counters may be null, capped may be null).
void snapshot_plans(const CacheLayout& g, int layer, const DeviceBatch& batch, const std::int32_t* res_block,
                    std::int32_t* snapshot, const std::int32_t* admit_count, const std::int32_t* capped,
                    unsigned long long* counters, cudaStream_t stream);

// The CSR view of Cache<cpu>::build_view for every pair of the batch (seq_len: the lengths now),
// from snapshot_plans' snapshot: per pair the sinks, the snapshot's blocks in [sink_blocks,
// ring_start(len)) ascending, then the recent ring. counts: scratch of batch * kv_heads int32;
// indptr: batch * kv_heads + 1; slot, block, valid: at least batch * kv_heads * max_budget_blocks.
// Slot ids are those of `layer`'s pool.
void build_view(const CacheLayout& g, int layer, const DeviceBatch& batch, const std::int32_t* snapshot,
                std::int32_t* counts, std::int32_t* indptr, std::int32_t* slot, std::int32_t* block,
                std::int32_t* valid, cudaStream_t stream);

// *counter += the number of selected blocks (segmented_top_k's output, stride k) that the CSR
// view (indptr, ascending block per pair) holds, over `pairs` pairs.
void count_resident_hits(const std::int32_t* selected, const std::int32_t* selected_count, int k, int pairs,
                         const std::int32_t* indptr, const std::int32_t* block, unsigned long long* counter,
                         cudaStream_t stream);

// ---- RemainderEstimate::quantized: block codes (oasiskv/kit/quantized_rows.hpp) ----------------------

// codes: CacheLayout::remainder.quantized_bytes bytes, block b of a head at CacheLayout::quantized_offset.
// append's companion (after it, same stream): every block the append of rows [row_offset[i],
// row_offset[i+1]) to batch entry i touched, coded from the host tier and the summaries.
template <KvElement T>
void append_quantized(const CacheLayout& g, int layer, const DeviceBatch& batch, const std::int32_t* row_offset,
                      const DeviceHostTier<T>& host_tier, const float* summaries, std::uint8_t* codes,
                      cudaStream_t stream);
// truncate_rows' and fork_rows' companion: dst_slot's codes of blocks [0, length / block_tokens)
// copied from src_slot (when it differs), the partial block coded from its host rows.
template <KvElement T>
void rebuild_quantized(const CacheLayout& g, int src_slot, int dst_slot, int layer, std::int64_t length,
                       const DeviceHostTier<T>& host_tier, const float* summaries, std::uint8_t* codes,
                       cudaStream_t stream);
// remainder's quantized form: the attention state of each (row, query head) over the decoded rows
// of the blocks the view leaves out (arguments as remainder's). Agrees with the CPU to float
// rounding.
template <class QT>
void remainder_quantized(const CacheLayout& g, int layer, const DeviceBatch& batch, const std::int32_t* indptr,
                         const std::int32_t* block, const QT* q, int rows_per_seq, const float* summaries,
                         const std::uint8_t* codes, float* out, float* lse, cudaStream_t stream);

// ---- RemainderEstimate::clusters: key clusters per segment (cpu/detail/remainder/key_clusters.hpp) -----------

// The device copy of KeyClusters' arrays, in its layout: a unit is one (sequence slot, layer, kv
// head, segment of kClusterSegmentBlocks blocks), numbered ((slot x layers + layer) x kv_heads +
// head) x segments + segment. Null pointers: the estimate is not clusters.
struct DeviceClusters {
  float* sums = nullptr;              // [unit][cluster][key sum | value sum][head_dim]
  std::int32_t* counts = nullptr;     // [unit][cluster] rows
  std::uint8_t* ids = nullptr;        // [unit][segment rows] each row's cluster
  std::uint8_t* clustered = nullptr;  // [unit] 1 when the unit holds a clustering
  int k = 0;                          // clusters per segment
  int segment_rows = 0;
  std::int64_t segments = 0;  // per (sequence slot, layer, kv head)
  OASISKV_HD std::int64_t unit(const CacheLayout& g, int slot, int layer, int kv_head,
                               std::int64_t segment) const noexcept {
    return ((static_cast<std::int64_t>(slot) * g.num_layers() + layer) * g.num_kv_heads() + kv_head) * segments +
           segment;
  }
};

// k-means rounds: the CPU clustering's too (oasiskv/kit/key_clusters_format.hpp).
inline constexpr int kClusterRounds = kKeyClusterRounds;

// KeyClusters::cluster on the device: segment `segment` of (seq_slot, layer), every kv head (one
// thread block each), clustered from its host rows as src/cpu/key_clusters.cpp does, bit for bit (the
// same start, rounds, row order of every sum, and IEEE-rounded operations without contraction):
// ids, key and value sums, counts, then the unit marked clustered. scratch: kv_heads x segment
// rows x head_dim floats (the keys as floats while the rounds read them).
template <KvElement T>
void cluster_segment(const CacheLayout& g, int seq_slot, int layer, std::int64_t segment,
                     const DeviceHostTier<T>& host_tier, const DeviceClusters& clusters, float* scratch,
                     cudaStream_t stream);

// ---- remainder estimate ------------------------------------------------------------------------

// Cache::remainder on the device: for every batch entry i of a built view (batch: the view's
// sequence slots and lengths; indptr, block: its CSR arrays, blocks ascending per pair), row r <
// rows_per_seq and query head g, the `remainder = clusters` attention state (config.hpp; the
// CPU's centroid_state) over the blocks of [0, blocks_for(len)) that the view does not hold:
// out[(i * rows_per_seq + r) * num_q_heads + g][head_dim], lse[same state] (-inf and 0 when there
// is none). q: [batch * rows_per_seq][num_q_heads][head_dim], QT float or the cache's element type.
// The same formula as the CPU backend; expf/logf and the summation order differ, so the results
// agree to float rounding (not bit for bit). Throws oasiskv::Error when the config keeps no block
// sums. A clustered segment's blocks count through its clusters: each weighted by its rows
// outside the view's blocks (KeyClusters::add_estimate_blocks).
template <class QT>
void remainder(const CacheLayout& g, int layer, const DeviceBatch& batch, const std::int32_t* indptr,
               const std::int32_t* block, const QT* q, int rows_per_seq, const float* moments, float* out, float* lse,
               const DeviceClusters& clusters, cudaStream_t stream);

// ---- reference attention (tests and benchmarks) -----------------------------------------------

namespace reference {

// A REFERENCE sparse paged decode attention, for tests and benchmarks: not a production kernel
// (one thread block per query head, rows one at a time; an engine brings its own attention,
// e.g. FlashInfer's paged decode, over the same LayerView). view: a LayerView whose arrays and
// pool are on the device. q, out: [batch_size][num_q_heads][head_dim] float; accumulates in float
// with the same running-max rescaling as SoftmaxAccumulator, so it matches
// sparse_attention_reference to float rounding. head_dim <= 512.
template <KvElement T>
void sparse_attention(const LayerView<T>& view, int num_q_heads, float scale, const float* q, float* out,
                      cudaStream_t stream);

}  // namespace reference

}  // namespace gpu
}  // namespace v0
}  // namespace oasiskv
