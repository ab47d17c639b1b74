// The CUDA backend's kernels: instantiations of oasiskv/cuda/kernels.cuh and the host operations
// of oasiskv/cuda/ops.cuh. The only nvcc translation unit of the library (resource usage:
// cuda/resource-usage.txt, from cuda/resource-usage.sh).
#include "oasiskv/cuda/kernels.cuh"

#include <algorithm>
#include <string>

// No oasiskv/error.hpp here: fmt 9.1 does not compile under nvcc 13 with -std=c++20.

namespace oasiskv {
inline namespace v0 {
namespace gpu {

namespace {

unsigned blocks_for(std::int64_t n, int per_block) {
  return static_cast<unsigned>((n + per_block - 1) / per_block);
}

// Opts a kernel into more than 48 KB of dynamic shared memory when it needs it.
template <class Kernel>
void allow_smem(Kernel kernel, std::size_t bytes, const char* name) {
  if (bytes > 48u * 1024u) {
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
          name, __FILE__, __LINE__);
  }
}

void require(bool ok, const std::string& what) {
  if (!ok) throw_error(what);
}

}  // namespace

template <KvElement T>
void append(const Geometry& g, int layer, const DeviceBatch& batch, const std::int32_t* row_offset,
            const T* k, const T* v, T* host_tier, T* layer_pool, float* summaries,
            cudaStream_t stream) {
  if (batch.size <= 0) return;
  const int threads = 256;
  const dim3 grid(blocks_for(static_cast<std::int64_t>(g.num_kv_heads) * g.head_dim, threads),
                  static_cast<unsigned>(batch.size));
  kernels::append_kernel<T><<<grid, threads, 0, stream>>>(g, layer, batch, row_offset, k, v, host_tier,
                                                           layer_pool, summaries);
  OASISKV_CUDA_CHECK_LAUNCH("append_kernel launch");
}

template <class QT>
void score_blocks(const Geometry& g, int layer, const DeviceBatch& batch, const QT* q,
                  int rows_per_seq, const float* summaries, const ScoreBuffers& out,
                  cudaStream_t stream, Candidates candidates) {
  if (batch.size <= 0) return;
  require(rows_per_seq >= 1, "score_blocks: rows_per_seq must be >= 1, got " + std::to_string(rows_per_seq));
  require(out.stride >= g.max_blocks - g.sink_blocks,
          "score_blocks: stride " + std::to_string(out.stride) + " is below the candidate count " +
              std::to_string(g.max_blocks - g.sink_blocks));
  const bool softmax = g.reduction == GroupReduction::softmax_sum;
  require(!softmax || out.bounds != nullptr, "score_blocks: softmax_sum needs the bounds scratch buffer");
  const int Q = rows_per_seq * g.group_size;
  const std::size_t smem = sizeof(float) * (static_cast<std::size_t>(kernels::kScoreTile) * (2 * g.head_dim + 1) +
                                            (softmax ? 0u : static_cast<std::size_t>(Q) * kernels::kScoreTile));
  allow_smem(kernels::score_kernel<QT>, smem, "cudaFuncSetAttribute(score_kernel)");
  const int pairs = batch.size * g.num_kv_heads;
  const std::int64_t max_candidates = g.max_blocks - g.sink_blocks;
  const dim3 grid(max_candidates > 0 ? blocks_for(max_candidates, kernels::kScoreTile) : 1u,
                  static_cast<unsigned>(pairs));
  kernels::score_kernel<QT><<<grid, kernels::kScoreThreads, smem, stream>>>(g, layer, batch, q, rows_per_seq,
                                                                            summaries, out,
                                                                            candidates == Candidates::current);
  OASISKV_CUDA_CHECK_LAUNCH("score_kernel launch");
  if (softmax) {
    kernels::softmax_kernel<><<<static_cast<unsigned>(pairs), kernels::kSoftmaxThreads, 0, stream>>>(
        g, rows_per_seq, out);
    OASISKV_CUDA_CHECK_LAUNCH("softmax_kernel launch");
  }
}

void segmented_top_k(const float* scores, int stride, const std::int32_t* count,
                     const std::int32_t* first, int num_segments, int k, std::int32_t* selected,
                     std::int32_t* selected_count, cudaStream_t stream) {
  if (num_segments <= 0) return;
  require(k >= 1 && k <= kMaxTopK,
          "segmented_top_k: k = " + std::to_string(k) + " is outside [1, " + std::to_string(kMaxTopK) + "]");
  std::size_t m = 1;
  while (m < static_cast<std::size_t>(k)) m <<= 1;
  const std::size_t smem = m * sizeof(unsigned long long);
  allow_smem(kernels::topk_kernel<>, smem, "cudaFuncSetAttribute(topk_kernel)");
  kernels::topk_kernel<><<<static_cast<unsigned>(num_segments), kernels::kTopKThreads, smem, stream>>>(
      scores, stride, count, first, k, selected, selected_count);
  OASISKV_CUDA_CHECK_LAUNCH("topk_kernel launch");
}

void plan_transfers(const Geometry& g, int layer, const DeviceBatch& batch,
                    const std::int64_t* steps, const std::int32_t* selected,
                    const std::int32_t* selected_count, int sel_stride, std::int32_t* res_block,
                    std::int64_t* res_last, const PlanBuffers& out, cudaStream_t stream) {
  if (batch.size <= 0) return;
  require(out.admits != nullptr && out.admit_count != nullptr, "plan_transfers: admits and admit_count are required");
  const std::size_t smem = kernels::plan_smem_bytes(g.selectable_blocks, sel_stride);
  allow_smem(kernels::plan_kernel<>, smem, "cudaFuncSetAttribute(plan_kernel)");
  kernels::plan_kernel<><<<static_cast<unsigned>(batch.size * g.num_kv_heads), kernels::kPlanThreads, smem,
                         stream>>>(g, layer, batch, steps, selected, selected_count, sel_stride, res_block,
                                   res_last, out);
  OASISKV_CUDA_CHECK_LAUNCH("plan_kernel launch");
}

template <KvElement T>
void gather_admits(const Geometry& g, int layer, const DeviceBatch& batch, const DeviceAdmit* admits,
                   const std::int32_t* admit_count, const T* host_tier, T* layer_pool,
                   cudaStream_t stream) {
  if (batch.size <= 0 || g.admit_stride <= 0) return;
  const dim3 grid(static_cast<unsigned>(g.admit_stride), static_cast<unsigned>(batch.size * g.num_kv_heads));
  kernels::gather_admits_kernel<T><<<grid, kernels::kGatherThreads, 0, stream>>>(g, layer, batch, admits,
                                                                                 admit_count, host_tier,
                                                                                 layer_pool);
  OASISKV_CUDA_CHECK_LAUNCH("gather_admits_kernel launch");
}

void gather_copies(const BlockCopy* copies, const std::int32_t* count, int max_count, cudaStream_t stream) {
  if (max_count <= 0) return;
  kernels::gather_copies_kernel<><<<static_cast<unsigned>(max_count), kernels::kGatherThreads, 0, stream>>>(
      copies, count);
  OASISKV_CUDA_CHECK_LAUNCH("gather_copies_kernel launch");
}

template <KvElement T>
void sparse_attention(const LayerView<T>& view, int num_q_heads, float scale, const float* q,
                      float* out, cudaStream_t stream) {
  if (view.batch_size <= 0) return;
  require(view.head_dim <= kernels::kAttentionThreads * kernels::kAttentionMaxChunks,
          "sparse_attention: head_dim " + std::to_string(view.head_dim) + " is above 512");
  require(view.num_kv_heads > 0 && num_q_heads % view.num_kv_heads == 0,
          "sparse_attention: num_q_heads " + std::to_string(num_q_heads) + " is not a multiple of num_kv_heads");
  const dim3 grid(static_cast<unsigned>(num_q_heads), static_cast<unsigned>(view.batch_size));
  kernels::attention_kernel<T><<<grid, kernels::kAttentionThreads, 0, stream>>>(view, num_q_heads, scale, q, out);
  OASISKV_CUDA_CHECK_LAUNCH("attention_kernel launch");
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

void snapshot_plans(const Geometry& g, int layer, const DeviceBatch& batch, const std::int32_t* res_block,
                    std::int32_t* snapshot, const std::int32_t* admit_count, const std::int32_t* capped,
                    unsigned long long* counters, cudaStream_t stream) {
  if (batch.size <= 0) return;
  kernels::snapshot_kernel<><<<static_cast<unsigned>(batch.size), kernels::kViewThreads, 0, stream>>>(
      g, layer, batch, res_block, snapshot, admit_count, capped, counters);
  OASISKV_CUDA_CHECK_LAUNCH("snapshot_kernel launch");
}

void build_view(const Geometry& g, const DeviceBatch& batch, const std::int32_t* snapshot, std::int32_t* counts,
                std::int32_t* indptr, std::int32_t* slot, std::int32_t* block, std::int32_t* valid,
                cudaStream_t stream) {
  if (batch.size <= 0) return;
  const auto pairs = static_cast<unsigned>(batch.size * g.num_kv_heads);
  kernels::view_count_kernel<><<<pairs, kernels::kViewThreads, 0, stream>>>(g, batch, snapshot, counts);
  OASISKV_CUDA_CHECK_LAUNCH("view_count_kernel launch");
  const std::size_t smem = sizeof(std::int32_t) * static_cast<std::size_t>(g.selectable_blocks);
  allow_smem(kernels::view_fill_kernel<>, smem, "cudaFuncSetAttribute(view_fill_kernel)");
  kernels::view_fill_kernel<><<<pairs, kernels::kViewThreads, smem, stream>>>(g, batch, snapshot, counts, indptr,
                                                                              slot, block, valid);
  OASISKV_CUDA_CHECK_LAUNCH("view_fill_kernel launch");
}

void count_resident_hits(const std::int32_t* selected, const std::int32_t* selected_count, int k, int pairs,
                         const std::int32_t* indptr, const std::int32_t* block, unsigned long long* counter,
                         cudaStream_t stream) {
  if (pairs <= 0) return;
  kernels::count_hits_kernel<><<<static_cast<unsigned>(pairs), kernels::kViewThreads, 0, stream>>>(
      selected, selected_count, k, indptr, block, counter);
  OASISKV_CUDA_CHECK_LAUNCH("count_hits_kernel launch");
}

#define OASISKV_INSTANTIATE(T)                                                                          \
  template void append<T>(const Geometry&, int, const DeviceBatch&, const std::int32_t*, const T*,      \
                          const T*, T*, T*, float*, cudaStream_t);                                      \
  template void score_blocks<T>(const Geometry&, int, const DeviceBatch&, const T*, int, const float*, \
                                const ScoreBuffers&, cudaStream_t, Candidates);                         \
  template void gather_admits<T>(const Geometry&, int, const DeviceBatch&, const DeviceAdmit*,          \
                                 const std::int32_t*, const T*, T*, cudaStream_t);                      \
  template void sparse_attention<T>(const LayerView<T>&, int, float, const float*, float*, cudaStream_t);

OASISKV_INSTANTIATE(float)
OASISKV_INSTANTIATE(fp16_t)
OASISKV_INSTANTIATE(bf16_t)
#undef OASISKV_INSTANTIATE

}  // namespace gpu
}  // namespace v0
}  // namespace oasiskv
