// LayerView.attention: the attention of query rows over a host LayerView's resident blocks, for
// Python engines on the CPU (oasiskv.transformers), which would otherwise gather every resident
// row into a tensor each step and pay a dozen framework calls a layer around it.
//
// Row r of the R rows of sequence i sits at position seq_len[i] - R + r and sees the keys at
// positions up to its own (causal by position: block * block_tokens + row within the block).
// Query head g uses kv head g / (num_q_heads / num_kv_heads). Scores are q.k * scale in float,
// softmax with a running maximum per block, as reference_attention.hpp's accumulator; lse is the
// log-sum-exp of the scaled scores (-inf for a row that sees no key, whose output is zeros), the
// state merge_state takes.
//
// The kernel (view_attention_kernel.inc) is plain C++ compiled twice, for the baseline ISA and
// for AVX2 + FMA, and the copy the CPU supports runs: the module stays buildable for any x86-64
// CPU. So that the AVX2 copy cannot lend its code to the baseline one through a shared inline
// function, the kernel sees only this header's plain struct and its own internal helpers.
#pragma once

#include <cstdint>

namespace oasiskv::python {

struct ViewAttentionArgs {
  // The view (ViewData's host arrays) and its pool.
  int batch_size = 0, num_kv_heads = 0, head_dim = 0, block_tokens = 0;
  const std::int64_t* seq_len = nullptr;
  const std::int32_t *indptr = nullptr, *slot = nullptr, *block = nullptr, *valid_tokens = nullptr;
  const void* pool = nullptr;
  std::int64_t slot_stride = 0;
  int dtype = 0;  // the pool's element: 0 float32, 1 float16, 2 bfloat16 (DType's order)
  // The query rows and the results.
  const float* q = nullptr;  // [batch_size * rows][num_q_heads][head_dim]
  int rows = 1;              // per sequence
  int num_q_heads = 0;
  float scale = 1.0f;
  float* out = nullptr;  // like q
  float* lse = nullptr;  // [batch_size * rows][num_q_heads]
};

// Scratch floats one thread of the kernel needs (and `rows` ints).
std::int64_t view_attention_scratch(const ViewAttentionArgs& args);

// Runs on the calling thread. (Threads started per call were measured slower, not faster: at
// 1,024 tokens a layer's call takes ~0.1-0.2 ms, and under torch a new thread competes with
// torch's own spinning workers for the cores.)
void view_attention(const ViewAttentionArgs& args);

namespace detail {
// The kernel over pairs [first, last) of the flattened (sequence, kv head) range, with
// view_attention_scratch(args) floats and `rows` ints of scratch; one definition per ISA.
void view_attention_baseline(const ViewAttentionArgs& args, int first, int last, float* scratch, int* seen_by_row);
void view_attention_avx2(const ViewAttentionArgs& args, int first, int last, float* scratch, int* seen_by_row);
}  // namespace detail

}  // namespace oasiskv::python
