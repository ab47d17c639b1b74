// Attention on the CPU: softmax(q.K * scale) V of float query rows over key/value rows in float,
// fp16 or bf16, for an engine that runs its attention on the CPU. Two levels:
//   - over a LayerView (cpu_attend): causal by token position, GQA, one or several query rows
//     per sequence; what an engine calls inside Cache::attend;
//   - over runs of rows (KvRows) an engine lays out itself: one query row per GQA group over
//     per-kv-head segment lists (cpu_attend_query_row: a dense cache, a view plus scratch rows),
//     causal query rows over one run (cpu_attend_causal: prefill), or the fold of rows into a
//     running softmax (cpu_attend_fold).
//
// Tiled like flash attention: 64 rows at a time are converted to float in L1, scored for every
// head of a GQA group and folded into a running max / sum / output per head, so each key and value
// is read from memory once per group. At the level in use (oasiskv/cpu/isa.hpp), head dims 32,
// 64, 80, 96, 128, 192 and 256 run tiles with a polynomial exp (relative error ~2e-7): of 8-float
// AVX2 + FMA + F16C vectors at avx2, of 16-float AVX-512 vectors at avx512 (twice the rows a cycle;
// the sums in another order, so other bits); other head dims, and the scalar level, run a portable
// online softmax one row at a time. Either agrees with
// reference_attention.hpp to float rounding, not bit for bit. Results do not depend on the
// threads: each query row's heads are split into the same parts whatever else is in the call.
//
// Threads: a ParallelFor (oasiskv/cpu/parallel_for.hpp; none: the calling thread). Where a kv
// head has at least 1,024 rows to read, its rows are split into parts = clamp(rows / 512, 1,
// threads) ranges that run as separate tasks, and their states are merged in order
// (flash-decoding); the parts, and so the bits, depend on parallel.threads.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "oasiskv/cpu/parallel_for.hpp"
#include "oasiskv/dtype.hpp"
#include "oasiskv/view.hpp"

namespace oasiskv {
inline namespace v0 {

// `rows` consecutive key and value rows, `stride` elements apart (row r of the keys at
// keys + r * stride).
template <class T>
struct KvRows {
  const T* keys = nullptr;
  const T* values = nullptr;
  std::int64_t rows = 0;
  std::int64_t stride = 0;
};

// Running softmax of `heads` query vectors: max scaled score, sum of exp, unnormalised output
// [heads][head_dim]. (attention_state.hpp's merge_state works on finished outputs and
// log-sum-exps instead.)
struct SoftmaxState {
  std::vector<float> max, sum, acc;
  void reset(int heads, int head_dim);
  // Folds another state of the same heads over different rows into this one.
  void merge(const SoftmaxState& other, int head_dim);
  // out[h][i] = acc / sum (zeros without rows); lse (optional, [heads]): max + log(sum), the
  // log-sum-exp of the scaled scores (-inf without rows), the state merge_state takes.
  void finish(int head_dim, float* out, float* lse = nullptr) const;
};

// Folds rows [first, last) of the concatenated segments into `state` (reset for `heads` heads)
// for the query heads q ([heads][head_dim]), scores q.k * scale.
template <class T>
void cpu_attend_fold(const float* q, int heads, int head_dim, float scale, std::span<const KvRows<T>> segments,
                     std::int64_t first, std::int64_t last, SoftmaxState& state);

// Attention of one query row (q: [kv_heads * group][head_dim]) where kv head h reads the segments
// segments[indptr[h] .. indptr[h + 1]). out: like q. lse (optional, [kv_heads * group]): each
// head's log-sum-exp of its scaled scores. Threads as the header says.
template <class T>
void cpu_attend_query_row(const float* q, int kv_heads, int group, int head_dim, float scale,
                          std::span<const KvRows<T>> segments, std::span<const std::int32_t> indptr, float* out,
                          float* lse = nullptr, const ParallelFor& parallel = {});

// Causal attention of several query rows over one run of rows: row r (q + r * q_stride: `heads`
// vectors of head_dim, one GQA group) attends to rows [0, positions[r]] of kv; its output goes to
// out + r * out_stride. Each tile of keys is converted once for all the rows (prefill). Runs on
// the calling thread.
template <class T>
void cpu_attend_causal(const float* q, std::int64_t q_stride, int rows, const std::int32_t* positions, int heads,
                       int head_dim, float scale, const KvRows<T>& kv, float* out, std::int64_t out_stride);

// Attention over a LayerView. q: [batch_size * rows][num_q_heads][head_dim]; row r of sequence i
// sits at position view.seq_len[i] - rows + r and sees the view's rows at positions up to its own
// (block * block_tokens + row within the block). Query head g uses kv head
// g / (num_q_heads / num_kv_heads). out: like q. lse (optional, [batch_size * rows][num_q_heads]):
// the log-sum-exp of the scaled scores; a row that sees no key gets -inf and zeros. Each
// (sequence, row) computes what cpu_attend_query_row would, and all of them share one run of the
// threads. Throws Error naming the value for bad arguments (num_q_heads not a positive multiple of
// num_kv_heads, rows < 1, a seq_len below rows, a non-finite scale, null q or out), before
// writing anything.
template <class T>
void cpu_attend(const LayerView<T>& view, const float* q, int num_q_heads, int rows, float scale, float* out,
                float* lse = nullptr, const ParallelFor& parallel = {});

}  // namespace v0
}  // namespace oasiskv
