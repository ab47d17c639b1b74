// The fast path's attention: one GQA group of query heads over key/value rows given as segments
// (a dense cache's whole context, or the blocks of an OasisKV LayerView), rows in float or fp16.
//
// Tiled like flash attention: 64 rows at a time are converted to float in L1, scored for every
// head of the group, and folded into a running max / sum / output per head with a vectorised
// exp, so each key and value is read from memory once per group. The reference path keeps
// attend_heads (llama_model.hpp): this one sums in another order and its exp is a polynomial
// (relative error ~2e-7), so the two agree to float rounding, not bit for bit.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include <oasiskv/dtype.hpp>

namespace smollm2 {

// `rows` consecutive key and value rows, `stride` elements apart.
template <class T>
struct KvRows {
  const T* keys = nullptr;
  const T* values = nullptr;
  std::int64_t rows = 0;
  std::int64_t stride = 0;
};

// Running softmax of `heads` query vectors: max score, sum of exp, unnormalised output [heads][d].
struct AttentionState {
  std::vector<float> max, sum, acc;
  void reset(int heads, int head_dim);
  // Folds another state over different rows into this one.
  void merge(const AttentionState& other, int head_dim);
  // out[h][i] = acc / sum; lse (optional, [heads]): max + log(sum), the log-sum-exp of the scaled
  // scores (-inf without rows), the state oasiskv::merge_state takes.
  void finish(int head_dim, float* out, float* lse = nullptr) const;
};

// Folds rows [first, last) of the concatenated segments into `state` for the query heads q
// ([heads][head_dim], scaled by 1/sqrt(head_dim) inside).
template <class T>
void attend_rows(const float* q, int heads, int head_dim, std::span<const KvRows<T>> segments, std::int64_t first,
                 std::int64_t last, AttentionState& state);

// Attention of one query row (q: [kv_heads * group][head_dim]) where kv head h reads the segments
// segments[indptr[h] .. indptr[h + 1]). Splits each head's rows over the engine's threads when
// they are many. out: like q. lse (optional, [kv_heads * group]): each head's log-sum-exp of its
// scaled scores (AttentionState::finish).
template <class T>
void attend_query_row(const float* q, int kv_heads, int group, int head_dim, std::span<const KvRows<T>> segments,
                      std::span<const std::int32_t> indptr, float* out, float* lse = nullptr);

// Causal attention of several query rows over one segment: row r (q + r * q_stride: `heads`
// vectors of head_dim, one GQA group) attends to rows [0, positions[r]] of kv; its output goes to
// out + r * out_stride. Each tile of keys is converted once for all the rows (prefill).
template <class T>
void attend_causal(const float* q, std::int64_t q_stride, int rows, const std::int32_t* positions, int heads,
                   int head_dim, const KvRows<T>& kv, float* out, std::int64_t out_stride);

}  // namespace smollm2
