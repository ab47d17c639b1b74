// The CUDA backend's kernels as host-callable operations. Declarations only: the kernels are
// templated device code in oasiskv/cuda/kernels.cuh, instantiated once in cuda/kernels.cu (for
// float, fp16_t and bf16_t) and linked from target oasiskv::cuda.
//
// Host-only: this header compiles with g++ as well as nvcc, so tests and engines need not be
// CUDA translation units. Every pointer argument is a device pointer (or a mapped pinned host
// pointer where said) unless named *_host. Every operation only enqueues work on `stream`: none
// synchronises the host or copies device -> host, so a decode step can be captured in a CUDA
// graph. Launch errors become oasiskv::Error (see check.cuh).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include <cuda_runtime_api.h>

#include "oasiskv/attention.hpp"
#include "oasiskv/config.hpp"
#include "oasiskv/dtype.hpp"
#include "oasiskv/prefetch_pipeline.hpp"
#include "oasiskv/transfer_plan.hpp"
#include "oasiskv/cuda/check.cuh"

namespace oasiskv {
inline namespace v0 {
namespace gpu {

// The sizes of a CacheLayout as a POD that kernels take by value, with the same derived
// arithmetic as CacheLayout (ring_start, pinned_slot) and the same array layouts as the CPU
// components (HostTier, DeviceTier<cpu>, SummaryStore, BlockTable residency).
struct Geometry {
  int num_layers = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int group_size = 0;
  int block_tokens = 0;
  int budget_blocks = 0;
  int sink_blocks = 0;
  int ring_blocks = 0;
  int selectable_blocks = 0;
  int fetch_cap = 0;
  int admit_stride = 0;  // admits per pair in plan buffers: the top K bounds them
  std::int64_t max_blocks = 0;
  std::int64_t block_elems = 0;
  float softmax_scale = 0.0f;
  GroupReduction reduction = GroupReduction::max;

  static Geometry from(const CacheLayout& l) noexcept {
    Geometry g;
    g.num_layers = l.config.shape.num_layers;
    g.num_q_heads = l.config.shape.num_q_heads;
    g.num_kv_heads = l.config.shape.num_kv_heads;
    g.head_dim = l.config.shape.head_dim;
    g.group_size = l.group_size;
    g.block_tokens = l.config.block_tokens;
    g.budget_blocks = l.budget_blocks;
    g.sink_blocks = l.sink_blocks;
    g.ring_blocks = l.ring_blocks;
    g.selectable_blocks = l.selectable_blocks;
    g.fetch_cap = l.fetch_cap;
    g.admit_stride = l.selectable_blocks;
    g.max_blocks = l.max_blocks;
    g.block_elems = l.block_elems;
    g.softmax_scale = l.softmax_scale;
    g.reduction = l.config.reduction;
    return g;
  }

  OASISKV_HD std::int64_t blocks_for(std::int64_t tokens) const noexcept {
    return (tokens + block_tokens - 1) / block_tokens;
  }
  OASISKV_HD std::int64_t ring_start(std::int64_t tokens) const noexcept {
    const std::int64_t start = blocks_for(tokens) - ring_blocks;
    return start > sink_blocks ? start : sink_blocks;
  }
  OASISKV_HD int pinned_slot(std::int64_t block) const noexcept {
    return block < sink_blocks ? static_cast<int>(block)
                               : sink_blocks + static_cast<int>(block % ring_blocks);
  }
  // Index of (sequence slot, layer, kv head) in every per-head array.
  OASISKV_HD std::int64_t head_index(int seq_slot, int layer, int kv_head) const noexcept {
    return (static_cast<std::int64_t>(seq_slot) * num_layers + layer) * num_kv_heads + kv_head;
  }
  // Slot id within a layer's pool (DeviceTier<cpu>::slot_id).
  OASISKV_HD std::int64_t slot_id(int seq_slot, int kv_head, int local_slot) const noexcept {
    return (static_cast<std::int64_t>(seq_slot) * num_kv_heads + kv_head) * budget_blocks + local_slot;
  }
  // Candidate blocks of prefetch for a sequence of `len` tokens: [sink_blocks, last), where the
  // next step's extra token is assumed (Cache<cpu>::prefetch).
  OASISKV_HD std::int64_t candidates_end(std::int64_t len) const noexcept {
    const std::int64_t a = blocks_for(len), b = ring_start(len + 1);
    const std::int64_t last = a < b ? a : b;
    return last > sink_blocks ? last : sink_blocks;
  }
};

// A batch on the device: entry i is sequence slot seq_slot[i] with seq_len[i] tokens (before the
// call for append, current for prefetch). Pair p = i * num_kv_heads + h.
struct DeviceBatch {
  int size = 0;
  const std::int32_t* seq_slot = nullptr;
  const std::int64_t* seq_len = nullptr;
};

// ---- append: host tier + pinned slots + summaries ----------------------------------------------

// Appends rows [row_offset[i], row_offset[i+1]) of k and v ([rows][kv_heads][head_dim]) to batch
// entry i at `layer`: writes them to the host tier (host_tier: its device-accessible base, e.g.
// the mapped pointer of pinned memory, layout HostTier), to the pinned slots (sinks and recent
// ring) of layer_pool (layout DeviceTier<cpu>), and folds the keys into the summaries (layout
// SummaryStore, same min/max semantics as SummaryStore::add_key). Does not change seq_len.
template <KvElement T>
void append(const Geometry& g, int layer, const DeviceBatch& batch, const std::int32_t* row_offset,
            const T* k, const T* v, T* host_tier, T* layer_pool, float* summaries,
            cudaStream_t stream);

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
// Same float arithmetic, in the same order, as LookaheadSelector::score: bit-identical for max and
// sum; softmax_sum uses CUDA's expf (not glibc's), so it matches to a few ulp only.
// candidates: Candidates::next_step scores prefetch's candidates [sink_blocks,
// candidates_end(len)); Candidates::current scores [sink_blocks, ring_start(len)), the blocks
// outside the pinned ones now (Cache<cpu>::observe).
enum class Candidates : std::uint8_t { next_step, current };
template <class QT>
void score_blocks(const Geometry& g, int layer, const DeviceBatch& batch, const QT* q,
                  int rows_per_seq, const float* summaries, const ScoreBuffers& out,
                  cudaStream_t stream, Candidates candidates = Candidates::next_step);

// Segment s: scores[s * stride + j], j < count[s]. Writes the min(k, count[s]) best as block
// indices first[s] + j, best first (ScoreOrder: higher score, then lower index) to
// selected[s * k + ...] and their number to selected_count[s]. k <= kMaxTopK.
inline constexpr int kMaxTopK = 4096;
void segmented_top_k(const float* scores, int stride, const std::int32_t* count,
                     const std::int32_t* first, int num_segments, int k, std::int32_t* selected,
                     std::int32_t* selected_count, cudaStream_t stream);

// ---- transfer planning ---------------------------------------------------------------------------

// Same layout as oasiskv::Admit.
struct DeviceAdmit {
  std::int32_t block = -1;
  std::int32_t slot = 0;
  std::int32_t evicted = -1;
};

// Plans of every pair: admits[p * admit_stride + a], a < admit_count[p]; kept[p * sel_stride + k],
// k < kept_count[p]; capped[p]. Any of kept, kept_count, capped may be null.
struct PlanBuffers {
  DeviceAdmit* admits = nullptr;
  std::int32_t* admit_count = nullptr;
  std::int32_t* kept = nullptr;
  std::int32_t* kept_count = nullptr;
  std::int32_t* capped = nullptr;
};

// TransferPlanner::plan followed by apply() for every pair, with the same rules and ties.
// selected/selected_count: segmented_top_k's output (stride sel_stride). steps[i]: plan index of
// batch entry i. res_block/res_last: the residency of the selectable slots, layout
// [seq slot][layer][kv head][selectable_blocks] (BlockTable), updated in place.
void plan_transfers(const Geometry& g, int layer, const DeviceBatch& batch,
                    const std::int64_t* steps, const std::int32_t* selected,
                    const std::int32_t* selected_count, int sel_stride, std::int32_t* res_block,
                    std::int64_t* res_last, const PlanBuffers& out, cudaStream_t stream);

// ---- gather copies ---------------------------------------------------------------------------------

// Copies every admit of every pair from the host tier (host_tier: device-accessible base of
// pinned mapped memory, read zero-copy) into its selectable slot of layer_pool. One launch.
template <KvElement T>
void gather_admits(const Geometry& g, int layer, const DeviceBatch& batch, const DeviceAdmit* admits,
                   const std::int32_t* admit_count, const T* host_tier, T* layer_pool,
                   cudaStream_t stream);

// Generic gather: copies[c] for c < *count (count on the device; max_count bounds the grid).
// Sources may be mapped pinned host memory (zero-copy reads) or device memory.
void gather_copies(const BlockCopy* copies, const std::int32_t* count, int max_count,
                   cudaStream_t stream);

// How a host-known list of block copies is executed.
enum class GatherMethod : std::uint8_t {
  zero_copy_kernel,  // one gather_copies launch; descriptors uploaded from pinned staging
  dma_batch,         // one cudaMemcpyBatchAsync (copy engines, no SMs)
};

// ---- attention -----------------------------------------------------------------------------------

// Reference sparse paged decode attention over a LayerView whose arrays and pool are on the
// device. q, out: [batch_size][num_q_heads][head_dim] float; accumulates in float with the same
// running-max rescaling as SoftmaxAccumulator. head_dim <= 512.
template <KvElement T>
void sparse_attention(const LayerView<T>& view, int num_q_heads, float scale, const float* q,
                      float* out, cudaStream_t stream);

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
// [selectable_blocks], res_block's layout), and counters[0] += admits, counters[1] += capped
// (summed over the batch's pairs; counters may be null).
void snapshot_plans(const Geometry& g, int layer, const DeviceBatch& batch, const std::int32_t* res_block,
                    std::int32_t* snapshot, const std::int32_t* admit_count, const std::int32_t* capped,
                    unsigned long long* counters, cudaStream_t stream);

// The CSR view of Cache<cpu>::build_view for every pair of the batch (seq_len: the lengths now),
// from snapshot_plans' snapshot: per pair the sinks, the snapshot's blocks in [sink_blocks,
// ring_start(len)) ascending, then the recent ring. counts: scratch of batch * kv_heads int32;
// indptr: batch * kv_heads + 1; slot, block, valid: at least batch * kv_heads * budget_blocks.
void build_view(const Geometry& g, const DeviceBatch& batch, const std::int32_t* snapshot, std::int32_t* counts,
                std::int32_t* indptr, std::int32_t* slot, std::int32_t* block, std::int32_t* valid,
                cudaStream_t stream);

// *counter += the number of selected blocks (segmented_top_k's output, stride k) that the CSR
// view (indptr, ascending block per pair) holds, over `pairs` pairs.
void count_resident_hits(const std::int32_t* selected, const std::int32_t* selected_count, int k, int pairs,
                         const std::int32_t* indptr, const std::int32_t* block, unsigned long long* counter,
                         cudaStream_t stream);

}  // namespace gpu
}  // namespace v0
}  // namespace oasiskv
