// The CUDA backend's kernels: instantiations of oasiskv/cuda/kernels/*.cuh and the host
// operations of oasiskv/cuda/ops.hpp. The only nvcc translation unit of the library (resource
// usage: cuda/resource-usage.txt, from cuda/resource-usage.sh).
#include "oasiskv/cuda/kernels.cuh"

#include <algorithm>
#include <climits>
#include <cstddef>
#include <string>
#include <type_traits>

#include "oasiskv/kit/transfer_plan.hpp"

// No oasiskv/error.hpp here: fmt 9.1 does not compile under nvcc 13 with -std=c++20.

namespace oasiskv {
inline namespace v0 {
namespace gpu {

static_assert(sizeof(DeviceAdmit) == sizeof(Admit) && offsetof(DeviceAdmit, block) == offsetof(Admit, block) &&
                  offsetof(DeviceAdmit, slot) == offsetof(Admit, slot) &&
                  offsetof(DeviceAdmit, evicted) == offsetof(Admit, evicted),
              "DeviceAdmit must have oasiskv::Admit's layout");
static_assert(std::is_trivially_copyable_v<CacheLayout>, "kernels take CacheLayout by value");

namespace {

// CUDA's limit on gridDim.y (and z); gridDim.x goes to 2^31 - 1.
constexpr std::int64_t kMaxGridY = 65535;
constexpr std::int64_t kMaxGridX = INT_MAX;

std::int64_t blocks_for(std::int64_t n, int per_block) { return (n + per_block - 1) / per_block; }

void require(bool ok, const std::string& what) {
  if (!ok) throw_error(what);
}

// gridDim.x of an operation over `n` batch entries or pairs.
unsigned grid_x(const char* op, const char* what, std::int64_t n) {
  require(n <= kMaxGridX, std::string(op) + ": " + std::to_string(n) + " " + what +
                              " exceed CUDA's grid limit of 2^31 - 1 thread blocks");
  return static_cast<unsigned>(n);
}

// gridDim.y of an operation: `n` units of its small dimension.
unsigned grid_y(const char* op, const char* what, std::int64_t n) {
  require(n <= kMaxGridY, std::string(op) + ": " + std::to_string(n) + " " + what +
                              " exceed CUDA's gridDim.y limit of 65,535 thread blocks");
  return static_cast<unsigned>(n < 1 ? 1 : n);
}

std::int64_t pairs_of(const CacheLayout& g, const DeviceBatch& batch) {
  return static_cast<std::int64_t>(batch.size) * g.num_kv_heads();
}

// Opts a kernel into more than 48 KB of dynamic shared memory when it needs it.
template <class Kernel>
void allow_smem(Kernel kernel, std::size_t bytes, const char* name) {
  if (bytes > 48u * 1024u) {
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)), name,
          __FILE__, __LINE__);
  }
}

}  // namespace

template <KvElement T>
void append(const CacheLayout& g, int layer, const DeviceBatch& batch, const std::int32_t* row_offset, const T* k,
            const T* v, const DeviceHostTier<T>& host_tier, T* layer_pool, float* summaries, cudaStream_t stream) {
  if (batch.size <= 0) return;
  const dim3 grid(grid_x("append", "batch entries", batch.size),
                  grid_y("append", "channel chunks (kv_heads x head_dim / 256)",
                         blocks_for(static_cast<std::int64_t>(g.num_kv_heads()) * g.head_dim(),
                                    kernels::kAppendThreads)));
  kernels::append_kernel<T><<<grid, kernels::kAppendThreads, 0, stream>>>(g, layer, batch, row_offset, k, v, host_tier,
                                                                          layer_pool, summaries);
  OASISKV_CUDA_CHECK_LAUNCH("append_kernel launch");
}

template <KvElement T>
void clone_host_block(const CacheLayout& g, T* host_base, std::int32_t from, std::int32_t to, cudaStream_t stream) {
  require(from >= 0 && from < g.pool_blocks && to >= 0 && to < g.pool_blocks && from != to,
          "clone_host_block: pool blocks " + std::to_string(from) + " -> " + std::to_string(to) + " out of range [0, " +
              std::to_string(g.pool_blocks) + ")");
  const auto grid =
      grid_x("clone_host_block", "layers x kv heads", static_cast<std::int64_t>(g.num_layers()) * g.num_kv_heads());
  kernels::clone_host_block_kernel<T><<<grid, kernels::kAppendThreads, 0, stream>>>(g, host_base, from, to);
  OASISKV_CUDA_CHECK_LAUNCH("clone_host_block_kernel launch");
}

template <class QT>
void score_blocks(const CacheLayout& g, int layer, const DeviceBatch& batch, const QT* q, int rows_per_seq,
                  const float* summaries, const ScoreBuffers& out, cudaStream_t stream, Candidates candidates,
                  int next_rows) {
  if (batch.size <= 0) return;
  require(next_rows >= 1, "score_blocks: next_rows must be >= 1, got " + std::to_string(next_rows));
  require(rows_per_seq >= 1, "score_blocks: rows_per_seq must be >= 1, got " + std::to_string(rows_per_seq));
  const std::int64_t max_candidates = g.max_blocks - g.sink_blocks;
  require(out.stride >= max_candidates, "score_blocks: stride " + std::to_string(out.stride) +
                                            " is below the candidate count " + std::to_string(max_candidates));
  const bool softmax = g.config.reduction == GroupReduction::softmax_sum;
  require(!softmax || out.bounds != nullptr, "score_blocks: softmax_sum needs the bounds scratch buffer");
  const int Q = rows_per_seq * g.group_size;
  const bool runs = g.score.kind == BlockScore::runs;
  // Staged: a tile's min/max summaries (row 2d+1) or one run of it (row d+1), and the queries'
  // scores of the tile (the run kernel's best runs even under softmax_sum).
  const std::size_t staged =
      runs ? static_cast<std::size_t>(g.head_dim()) + 1 : 2 * static_cast<std::size_t>(g.head_dim()) + 1;
  const std::size_t smem =
      sizeof(float) * (static_cast<std::size_t>(kernels::kScoreTile) * staged +
                       (softmax && !runs ? 0u : static_cast<std::size_t>(Q) * kernels::kScoreTile));
  const std::int64_t pairs = pairs_of(g, batch);
  const dim3 grid(grid_x("score_blocks", "(sequence, kv head) pairs", pairs),
                  grid_y("score_blocks", "candidate tiles of 32 blocks",
                         max_candidates > 0 ? blocks_for(max_candidates, kernels::kScoreTile) : 1));
  // The scorer is a template argument: each kernel keeps only its own lanes in registers.
  const auto launch = [&](auto kernel) {
    allow_smem(kernel, smem, "cudaFuncSetAttribute(score_kernel)");
    kernel<<<grid, kernels::kScoreThreads, smem, stream>>>(g, layer, batch, q, rows_per_seq, summaries, out,
                                                           candidates == Candidates::current, next_rows);
    OASISKV_CUDA_CHECK_LAUNCH("score_kernel launch");
  };
  switch (g.score.kind) {
    case BlockScore::quest: launch(kernels::score_kernel<QT, BlockScore::quest>); break;
    case BlockScore::spread: launch(kernels::score_kernel<QT, BlockScore::spread>); break;
    case BlockScore::runs: launch(kernels::run_score_kernel<QT>); break;
    default: require(false, "score_blocks: unknown scorer " + std::to_string(static_cast<int>(g.score.kind)));
  }
  if (softmax) {
    kernels::softmax_kernel<><<<grid.x, kernels::kSoftmaxThreads, 0, stream>>>(g, rows_per_seq, out);
    OASISKV_CUDA_CHECK_LAUNCH("softmax_kernel launch");
  }
}

void segmented_top_k(const float* scores, int stride, const std::int32_t* count, const std::int32_t* first,
                     int num_segments, int k, std::int32_t* selected, std::int32_t* selected_count,
                     cudaStream_t stream) {
  segmented_top_k(scores, stride, count, first, num_segments, k, nullptr, 1, selected, selected_count, stream);
}

void segmented_top_k(const float* scores, int stride, const std::int32_t* count, const std::int32_t* first,
                     int num_segments, int k, const HeadBudget* head_budgets, int num_kv_heads, std::int32_t* selected,
                     std::int32_t* selected_count, cudaStream_t stream) {
  if (num_segments <= 0) return;
  require(head_budgets == nullptr || num_kv_heads >= 1,
          "segmented_top_k: num_kv_heads = " + std::to_string(num_kv_heads) + " must be positive");
  require(k >= 1 && k <= kMaxTopK,
          "segmented_top_k: k = " + std::to_string(k) + " is outside [1, " + std::to_string(kMaxTopK) + "]");
  std::size_t m = 1;
  while (m < static_cast<std::size_t>(k)) m <<= 1;
  const std::size_t smem = m * sizeof(unsigned long long);
  allow_smem(kernels::topk_kernel<>, smem, "cudaFuncSetAttribute(topk_kernel)");
  kernels::topk_kernel<>
      <<<static_cast<unsigned>(num_segments), kernels::kTopKThreads, smem, stream>>>(scores, stride, count, first, k,
                                                                                     head_budgets, num_kv_heads,
                                                                                     selected, selected_count);
  OASISKV_CUDA_CHECK_LAUNCH("topk_kernel launch");
}

void plan_transfers(const CacheLayout& g, int layer, const DeviceBatch& batch, const std::int64_t* steps,
                    const std::int32_t* caps, const std::int32_t* selected, const std::int32_t* selected_count,
                    int sel_stride, std::int32_t* res_block, std::int64_t* res_last, const PlanBuffers& out,
                    cudaStream_t stream) {
  if (batch.size <= 0) return;
  require(out.admits != nullptr && out.admit_count != nullptr, "plan_transfers: admits and admit_count are required");
  require(steps != nullptr && caps != nullptr, "plan_transfers: steps and caps are required");
  const std::size_t smem = kernels::plan_smem_bytes(g.max_selectable_blocks, sel_stride);
  const unsigned grid = grid_x("plan_transfers", "(sequence, kv head) pairs", pairs_of(g, batch));
  allow_smem(kernels::plan_kernel<>, smem, "cudaFuncSetAttribute(plan_kernel)");
  kernels::plan_kernel<><<<grid, kernels::kPlanThreads, smem, stream>>>(g, layer, batch, steps, caps, selected,
                                                                        selected_count, sel_stride, res_block, res_last,
                                                                        out);
  OASISKV_CUDA_CHECK_LAUNCH("plan_kernel launch");
}

void clear_residency(const CacheLayout& g, int seq_slot, int layer, std::int32_t* res_block, std::int64_t* res_last,
                     cudaStream_t stream) {
  require(seq_slot >= -1 && seq_slot < g.config.max_sequences, "clear_residency: sequence slot " +
                                                                   std::to_string(seq_slot) + " is outside [-1, " +
                                                                   std::to_string(g.config.max_sequences) + ")");
  require(layer >= -1 && layer < g.num_layers(), "clear_residency: layer " + std::to_string(layer) +
                                                     " is outside [-1, " + std::to_string(g.num_layers()) + ")");
  require(res_block != nullptr && res_last != nullptr, "clear_residency: res_block and res_last are required");
  // An upper bound with a profile (every head at the largest top-K): the kernel strides over the
  // exact count.
  const std::int64_t total = static_cast<std::int64_t>(g.num_kv_heads()) * g.max_selectable_blocks *
                             (seq_slot < 0 ? g.config.max_sequences : 1) * (layer < 0 ? g.num_layers() : 1);
  if (total <= 0) return;
  const auto grid = static_cast<unsigned>(std::min<std::int64_t>(blocks_for(total, kernels::kClearThreads), 4096));
  kernels::clear_residency_kernel<>
      <<<grid, kernels::kClearThreads, 0, stream>>>(g, seq_slot, layer, res_block, res_last);
  OASISKV_CUDA_CHECK_LAUNCH("clear_residency_kernel launch");
}

template <KvElement T>
void truncate_rows(const CacheLayout& g, int seq_slot, int layer, std::int64_t length,
                   const DeviceHostTier<T>& host_tier, T* layer_pool, float* summaries, cudaStream_t stream) {
  require(seq_slot >= 0 && seq_slot < g.config.max_sequences && layer >= 0 && layer < g.num_layers() && length >= 0 &&
              length <= g.config.max_tokens_per_sequence,
          "truncate_rows: sequence slot " + std::to_string(seq_slot) + ", layer " + std::to_string(layer) +
              " or length " + std::to_string(length) + " out of range");
  // The ring only: the sinks did not move.
  kernels::rebuild_rows_kernel<T><<<static_cast<unsigned>(g.num_kv_heads()), kernels::kTruncateThreads, 0, stream>>>(
      g, seq_slot, seq_slot, layer, length, g.sink_blocks, host_tier, layer_pool, summaries);
  OASISKV_CUDA_CHECK_LAUNCH("rebuild_rows_kernel launch (truncate)");
}

template <KvElement T>
void fork_rows(const CacheLayout& g, int src_slot, int dst_slot, int layer, std::int64_t length,
               const DeviceHostTier<T>& host_tier, T* layer_pool, float* summaries, cudaStream_t stream) {
  require(src_slot >= 0 && src_slot < g.config.max_sequences && dst_slot >= 0 && dst_slot < g.config.max_sequences &&
              src_slot != dst_slot && layer >= 0 && layer < g.num_layers() && length >= 0 &&
              length <= g.config.max_tokens_per_sequence,
          "fork_rows: sequence slots " + std::to_string(src_slot) + " -> " + std::to_string(dst_slot) + ", layer " +
              std::to_string(layer) + " or length " + std::to_string(length) + " out of range");
  kernels::rebuild_rows_kernel<T>
      <<<static_cast<unsigned>(g.num_kv_heads()), kernels::kTruncateThreads, 0, stream>>>(g, src_slot, dst_slot, layer,
                                                                                          length, 0, host_tier,
                                                                                          layer_pool, summaries);
  OASISKV_CUDA_CHECK_LAUNCH("rebuild_rows_kernel launch (fork)");
}

template <KvElement T>
void append_run_sums(const CacheLayout& g, int layer, const DeviceBatch& batch, const std::int32_t* row_offset,
                     const T* k, float* run_sums, cudaStream_t stream) {
  if (batch.size <= 0) return;
  require(g.score.runs > 0 && run_sums != nullptr,
          "append_run_sums: the config keeps no run sums (scorer is not runs)");
  const dim3 grid(grid_x("append_run_sums", "batch entries", batch.size),
                  grid_y("append_run_sums", "channel chunks (kv_heads x head_dim / 256)",
                         blocks_for(static_cast<std::int64_t>(g.num_kv_heads()) * g.head_dim(),
                                    kernels::kAppendThreads)));
  kernels::append_run_sums_kernel<T>
      <<<grid, kernels::kAppendThreads, 0, stream>>>(g, layer, batch, row_offset, k, run_sums);
  OASISKV_CUDA_CHECK_LAUNCH("append_run_sums_kernel launch");
}

template <KvElement T>
void rebuild_run_sums(const CacheLayout& g, int src_slot, int dst_slot, int layer, std::int64_t length,
                      const DeviceHostTier<T>& host_tier, float* run_sums, cudaStream_t stream) {
  require(g.score.runs > 0 && run_sums != nullptr,
          "rebuild_run_sums: the config keeps no run sums (scorer is not runs)");
  require(src_slot >= 0 && src_slot < g.config.max_sequences && dst_slot >= 0 && dst_slot < g.config.max_sequences &&
              layer >= 0 && layer < g.num_layers() && length >= 0 && length <= g.config.max_tokens_per_sequence,
          "rebuild_run_sums: sequence slots " + std::to_string(src_slot) + " -> " + std::to_string(dst_slot) +
              ", layer " + std::to_string(layer) + " or length " + std::to_string(length) + " out of range");
  kernels::rebuild_run_sums_kernel<T>
      <<<static_cast<unsigned>(g.num_kv_heads()), kernels::kTruncateThreads, 0, stream>>>(g, src_slot, dst_slot, layer,
                                                                                          length, host_tier, run_sums);
  OASISKV_CUDA_CHECK_LAUNCH("rebuild_run_sums_kernel launch");
}

void truncate_residency(const CacheLayout& g, int seq_slot, int layer, std::int64_t cut, std::int32_t* res_block,
                        std::int64_t* res_last, cudaStream_t stream) {
  if (g.max_selectable_blocks <= 0) return;
  require(seq_slot >= 0 && seq_slot < g.config.max_sequences && layer >= 0 && layer < g.num_layers(),
          "truncate_residency: sequence slot " + std::to_string(seq_slot) + " or layer " + std::to_string(layer) +
              " out of range");
  kernels::truncate_residency_kernel<>
      <<<static_cast<unsigned>(g.num_kv_heads()), kernels::kTruncateThreads, 0, stream>>>(g, seq_slot, layer, cut,
                                                                                          res_block, res_last);
  OASISKV_CUDA_CHECK_LAUNCH("truncate_residency_kernel launch");
}

template <KvElement T>
void gather_admits(const CacheLayout& g, int layer, const DeviceBatch& batch, const DeviceAdmit* admits,
                   const std::int32_t* admit_count, const DeviceHostTier<T>& host_tier, T* layer_pool,
                   cudaStream_t stream, const T* staging) {
  if (batch.size <= 0 || g.max_selectable_blocks <= 0) return;
  const dim3 grid(grid_x("gather_admits", "(sequence, kv head) pairs", pairs_of(g, batch)),
                  grid_y("gather_admits", "admits per pair (selectable_blocks)", g.max_selectable_blocks));
  kernels::gather_admits_kernel<T><<<grid, kernels::kGatherThreads, 0, stream>>>(g, layer, batch, admits, admit_count,
                                                                                 host_tier, layer_pool, staging);
  OASISKV_CUDA_CHECK_LAUNCH("gather_admits_kernel launch");
}

void gather_copies(const BlockCopy* copies, const std::int32_t* count, int max_count, cudaStream_t stream) {
  if (max_count <= 0) return;
  kernels::gather_copies_kernel<>
      <<<static_cast<unsigned>(max_count), kernels::kGatherThreads, 0, stream>>>(copies, count);
  OASISKV_CUDA_CHECK_LAUNCH("gather_copies_kernel launch");
}

void upload_words(std::uint32_t* dst, std::span<const std::uint32_t> words, cudaStream_t stream) {
  WordBlock w;
  for (std::size_t off = 0; off < words.size(); off += kUploadWords) {
    const std::size_t n = std::min<std::size_t>(kUploadWords, words.size() - off);
    w.dst = dst + off;
    w.count = static_cast<int>(n);
    std::copy_n(words.data() + off, n, w.words);
    kernels::upload_words_kernel<><<<1, 256, 0, stream>>>(w);
    OASISKV_CUDA_CHECK_LAUNCH("upload_words_kernel launch");
  }
}

void snapshot_plans(const CacheLayout& g, int layer, const DeviceBatch& batch, const std::int32_t* res_block,
                    std::int32_t* snapshot, const std::int32_t* admit_count, const std::int32_t* capped,
                    unsigned long long* counters, cudaStream_t stream) {
  if (batch.size <= 0) return;
  kernels::snapshot_kernel<>
      <<<grid_x("snapshot_plans", "batch entries", batch.size), kernels::kViewThreads, 0, stream>>>(g, layer, batch,
                                                                                                    res_block, snapshot,
                                                                                                    admit_count, capped,
                                                                                                    counters);
  OASISKV_CUDA_CHECK_LAUNCH("snapshot_kernel launch");
}

void build_view(const CacheLayout& g, int layer, const DeviceBatch& batch, const std::int32_t* snapshot,
                std::int32_t* counts, std::int32_t* indptr, std::int32_t* slot, std::int32_t* block,
                std::int32_t* valid, cudaStream_t stream) {
  if (batch.size <= 0) return;
  const unsigned pairs = grid_x("build_view", "(sequence, kv head) pairs", pairs_of(g, batch));
  kernels::view_count_kernel<><<<pairs, kernels::kViewThreads, 0, stream>>>(g, batch, snapshot, counts);
  OASISKV_CUDA_CHECK_LAUNCH("view_count_kernel launch");
  const std::size_t smem =
      sizeof(std::int32_t) * static_cast<std::size_t>(kernels::view_row_ints(g.max_selectable_blocks));
  allow_smem(kernels::view_fill_kernel<>, smem, "cudaFuncSetAttribute(view_fill_kernel)");
  kernels::view_fill_kernel<>
      <<<pairs, kernels::kViewThreads, smem, stream>>>(g, layer, batch, snapshot, counts, indptr, slot, block, valid);
  OASISKV_CUDA_CHECK_LAUNCH("view_fill_kernel launch");
}

void count_resident_hits(const std::int32_t* selected, const std::int32_t* selected_count, int k, int pairs,
                         const std::int32_t* indptr, const std::int32_t* block, unsigned long long* counter,
                         cudaStream_t stream) {
  if (pairs <= 0) return;
  kernels::count_hits_kernel<>
      <<<static_cast<unsigned>(pairs), kernels::kViewThreads, 0, stream>>>(selected, selected_count, k, indptr, block,
                                                                           counter);
  OASISKV_CUDA_CHECK_LAUNCH("count_hits_kernel launch");
}

template <KvElement T>
void append_moments(const CacheLayout& g, int layer, const DeviceBatch& batch, const std::int32_t* row_offset,
                    const T* k, const T* v, float* moments, cudaStream_t stream) {
  if (batch.size <= 0) return;
  require(g.remainder.moment_vectors > 0 && moments != nullptr,
          "append_moments: the config keeps no block sums (remainder is not clusters)");
  const dim3 grid(grid_x("append_moments", "batch entries", batch.size),
                  grid_y("append_moments", "channel chunks (kv_heads x head_dim / 256)",
                         blocks_for(static_cast<std::int64_t>(g.num_kv_heads()) * g.head_dim(),
                                    kernels::kMomentThreads)));
  kernels::append_moments_kernel<T>
      <<<grid, kernels::kMomentThreads, 0, stream>>>(g, layer, batch, row_offset, k, v, moments);
  OASISKV_CUDA_CHECK_LAUNCH("append_moments_kernel launch");
}

template <KvElement T>
void rebuild_moments(const CacheLayout& g, int src_slot, int dst_slot, int layer, std::int64_t length,
                     const DeviceHostTier<T>& host_tier, float* moments, cudaStream_t stream) {
  require(g.remainder.moment_vectors > 0 && moments != nullptr,
          "rebuild_moments: the config keeps no block sums (remainder is not clusters)");
  require(src_slot >= 0 && src_slot < g.config.max_sequences && dst_slot >= 0 && dst_slot < g.config.max_sequences &&
              layer >= 0 && layer < g.num_layers() && length >= 0 && length <= g.config.max_tokens_per_sequence,
          "rebuild_moments: sequence slots " + std::to_string(src_slot) + " -> " + std::to_string(dst_slot) +
              ", layer " + std::to_string(layer) + " or length " + std::to_string(length) + " out of range");
  kernels::rebuild_moments_kernel<T>
      <<<static_cast<unsigned>(g.num_kv_heads()), kernels::kMomentThreads, 0, stream>>>(g, src_slot, dst_slot, layer,
                                                                                        length, host_tier, moments);
  OASISKV_CUDA_CHECK_LAUNCH("rebuild_moments_kernel launch");
}

template <KvElement T>
void cluster_segment(const CacheLayout& g, int seq_slot, int layer, std::int64_t segment,
                     const DeviceHostTier<T>& host_tier, const DeviceClusters& clusters, float* scratch,
                     cudaStream_t stream) {
  require(clusters.sums != nullptr && clusters.k >= 1 && clusters.k <= 256 && scratch != nullptr,
          "cluster_segment: no cluster arrays, or " + std::to_string(clusters.k) +
              " clusters per segment (one-byte ids: 1..256)");
  require(seq_slot >= 0 && seq_slot < g.config.max_sequences && layer >= 0 && layer < g.num_layers() && segment >= 0 &&
              segment < clusters.segments,
          "cluster_segment: sequence slot " + std::to_string(seq_slot) + ", layer " + std::to_string(layer) +
              " or segment " + std::to_string(segment) + " out of range");
  kernels::cluster_segment_kernel<T>
      <<<static_cast<unsigned>(g.num_kv_heads()), kernels::kClusterThreads, 0, stream>>>(g, seq_slot, layer, segment,
                                                                                         host_tier, clusters, scratch);
  OASISKV_CUDA_CHECK_LAUNCH("cluster_segment_kernel launch");
}

template <class QT>
void remainder(const CacheLayout& g, int layer, const DeviceBatch& batch, const std::int32_t* indptr,
               const std::int32_t* block, const QT* q, int rows_per_seq, const float* moments, float* out, float* lse,
               const DeviceClusters& clusters, cudaStream_t stream) {
  if (batch.size <= 0) return;
  require(g.remainder.moment_vectors > 0 && moments != nullptr,
          "remainder: the config keeps no block sums (remainder is not clusters)");
  require(rows_per_seq >= 1, "remainder: rows_per_seq must be >= 1, got " + std::to_string(rows_per_seq));
  // Value-sum pointers, q, acc, weights, the reduction, and a segment's resident rows per cluster.
  const std::size_t smem =
      sizeof(float) * (2 * kernels::kRemainderThreads + 2 * static_cast<std::size_t>(g.head_dim()) +
                       kernels::kRemainderThreads + 32) +
      sizeof(std::int32_t) * static_cast<std::size_t>(clusters.clustered != nullptr ? clusters.k : 0);
  const dim3 grid(grid_x("remainder", "(sequence, kv head) pairs", pairs_of(g, batch)),
                  grid_y("remainder", "query rows x group size",
                         static_cast<std::int64_t>(rows_per_seq) * g.group_size));
  allow_smem(kernels::remainder_kernel<QT>, smem, "cudaFuncSetAttribute(remainder_kernel)");
  kernels::remainder_kernel<QT><<<grid, kernels::kRemainderThreads, smem, stream>>>(g, layer, batch, indptr, block, q,
                                                                                    rows_per_seq, moments, out, lse,
                                                                                    clusters);
  OASISKV_CUDA_CHECK_LAUNCH("remainder_kernel launch");
}

template <KvElement T>
void append_quantized(const CacheLayout& g, int layer, const DeviceBatch& batch, const std::int32_t* row_offset,
                      const DeviceHostTier<T>& host_tier, const float* summaries, std::uint8_t* codes,
                      cudaStream_t stream) {
  if (batch.size <= 0) return;
  require(g.remainder.quantized_block_bytes > 0 && codes != nullptr,
          "append_quantized: the config keeps no codes (remainder not quantized)");
  const dim3 grid(grid_x("append_quantized", "batch entries", batch.size),
                  grid_y("append_quantized", "kv heads", g.num_kv_heads()));
  kernels::append_quantized_kernel<T>
      <<<grid, kernels::kQuantizedThreads, 0, stream>>>(g, layer, batch, row_offset, host_tier, summaries, codes);
  OASISKV_CUDA_CHECK_LAUNCH("append_quantized_kernel launch");
}

template <KvElement T>
void rebuild_quantized(const CacheLayout& g, int src_slot, int dst_slot, int layer, std::int64_t length,
                       const DeviceHostTier<T>& host_tier, const float* summaries, std::uint8_t* codes,
                       cudaStream_t stream) {
  require(g.remainder.quantized_block_bytes > 0 && codes != nullptr,
          "rebuild_quantized: the config keeps no codes (remainder not quantized)");
  require(src_slot >= 0 && src_slot < g.config.max_sequences && dst_slot >= 0 && dst_slot < g.config.max_sequences &&
              layer >= 0 && layer < g.num_layers() && length >= 0 && length <= g.config.max_tokens_per_sequence,
          "rebuild_quantized: sequence slots " + std::to_string(src_slot) + " -> " + std::to_string(dst_slot) +
              ", layer " + std::to_string(layer) + " or length " + std::to_string(length) + " out of range");
  kernels::rebuild_quantized_kernel<T>
      <<<static_cast<unsigned>(g.num_kv_heads()), kernels::kQuantizedThreads, 0, stream>>>(g, src_slot, dst_slot, layer,
                                                                                           length, host_tier, summaries,
                                                                                           codes);
  OASISKV_CUDA_CHECK_LAUNCH("rebuild_quantized_kernel launch");
}

template <class QT>
void remainder_quantized(const CacheLayout& g, int layer, const DeviceBatch& batch, const std::int32_t* indptr,
                         const std::int32_t* block, const QT* q, int rows_per_seq, const float* summaries,
                         const std::uint8_t* codes, float* out, float* lse, cudaStream_t stream) {
  if (batch.size <= 0) return;
  require(g.remainder.quantized_block_bytes > 0 && codes != nullptr,
          "remainder_quantized: the config keeps no codes (remainder not quantized)");
  require(rows_per_seq >= 1, "remainder_quantized: rows_per_seq must be >= 1, got " + std::to_string(rows_per_seq));
  const std::size_t smem =
      sizeof(float) * (3 * static_cast<std::size_t>(g.head_dim()) + static_cast<std::size_t>(g.block_tokens()) + 32);
  const dim3 grid(grid_x("remainder_quantized", "(sequence, kv head) pairs", pairs_of(g, batch)),
                  grid_y("remainder_quantized", "query rows x group size",
                         static_cast<std::int64_t>(rows_per_seq) * g.group_size));
  allow_smem(kernels::remainder_quantized_kernel<QT>, smem, "cudaFuncSetAttribute(remainder_quantized_kernel)");
  kernels::remainder_quantized_kernel<QT>
      <<<grid, kernels::kQuantizedThreads, smem, stream>>>(g, layer, batch, indptr, block, q, rows_per_seq, summaries,
                                                           codes, out, lse);
  OASISKV_CUDA_CHECK_LAUNCH("remainder_quantized_kernel launch");
}

namespace reference {

template <KvElement T>
void sparse_attention(const LayerView<T>& view, int num_q_heads, float scale, const float* q, float* out,
                      cudaStream_t stream) {
  if (view.batch_size <= 0) return;
  require(view.head_dim <= kAttentionThreads * kAttentionMaxChunks,
          "reference::sparse_attention: head_dim " + std::to_string(view.head_dim) + " is above 512");
  require(view.num_kv_heads > 0 && num_q_heads % view.num_kv_heads == 0, "reference::sparse_attention: num_q_heads " +
                                                                             std::to_string(num_q_heads) +
                                                                             " is not a multiple of num_kv_heads");
  const dim3 grid(grid_x("reference::sparse_attention", "batch entries", view.batch_size),
                  grid_y("reference::sparse_attention", "query heads", num_q_heads));
  attention_kernel<T><<<grid, kAttentionThreads, 0, stream>>>(view, num_q_heads, scale, q, out);
  OASISKV_CUDA_CHECK_LAUNCH("reference attention_kernel launch");
}

}  // namespace reference

#define OASISKV_INSTANTIATE(T)                                                                                         \
  template void append<T>(const CacheLayout&, int, const DeviceBatch&, const std::int32_t*, const T*, const T*,        \
                          const DeviceHostTier<T>&, T*, float*, cudaStream_t);                                         \
  template void clone_host_block<T>(const CacheLayout&, T*, std::int32_t, std::int32_t, cudaStream_t);                 \
  template void score_blocks<T>(const CacheLayout&, int, const DeviceBatch&, const T*, int, const float*,              \
                                const ScoreBuffers&, cudaStream_t, Candidates, int);                                   \
  template void gather_admits<T>(const CacheLayout&, int, const DeviceBatch&, const DeviceAdmit*, const std::int32_t*, \
                                 const DeviceHostTier<T>&, T*, cudaStream_t, const T*);                                \
  template void truncate_rows<T>(const CacheLayout&, int, int, std::int64_t, const DeviceHostTier<T>&, T*, float*,     \
                                 cudaStream_t);                                                                        \
  template void fork_rows<T>(const CacheLayout&, int, int, int, std::int64_t, const DeviceHostTier<T>&, T*, float*,    \
                             cudaStream_t);                                                                            \
  template void append_run_sums<T>(const CacheLayout&, int, const DeviceBatch&, const std::int32_t*, const T*, float*, \
                                   cudaStream_t);                                                                      \
  template void rebuild_run_sums<T>(const CacheLayout&, int, int, int, std::int64_t, const DeviceHostTier<T>&, float*, \
                                    cudaStream_t);                                                                     \
  template void reference::sparse_attention<T>(const LayerView<T>&, int, float, const float*, float*, cudaStream_t);   \
  template void append_moments<T>(const CacheLayout&, int, const DeviceBatch&, const std::int32_t*, const T*,          \
                                  const T*, float*, cudaStream_t);                                                     \
  template void rebuild_moments<T>(const CacheLayout&, int, int, int, std::int64_t, const DeviceHostTier<T>&, float*,  \
                                   cudaStream_t);                                                                      \
  template void remainder<T>(const CacheLayout&, int, const DeviceBatch&, const std::int32_t*, const std::int32_t*,    \
                             const T*, int, const float*, float*, float*, const DeviceClusters&, cudaStream_t);        \
  template void cluster_segment<T>(const CacheLayout&, int, int, std::int64_t, const DeviceHostTier<T>&,               \
                                   const DeviceClusters&, float*, cudaStream_t);                                       \
  template void append_quantized<T>(const CacheLayout&, int, const DeviceBatch&, const std::int32_t*,                  \
                                    const DeviceHostTier<T>&, const float*, std::uint8_t*, cudaStream_t);              \
  template void rebuild_quantized<T>(const CacheLayout&, int, int, int, std::int64_t, const DeviceHostTier<T>&,        \
                                     const float*, std::uint8_t*, cudaStream_t);                                       \
  template void remainder_quantized<T>(const CacheLayout&, int, const DeviceBatch&, const std::int32_t*,               \
                                       const std::int32_t*, const T*, int, const float*, const std::uint8_t*, float*,  \
                                       float*, cudaStream_t);

OASISKV_INSTANTIATE(float)
OASISKV_INSTANTIATE(fp16_t)
OASISKV_INSTANTIATE(bf16_t)
#undef OASISKV_INSTANTIATE

}  // namespace gpu
}  // namespace v0
}  // namespace oasiskv
