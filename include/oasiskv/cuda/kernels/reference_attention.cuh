// REFERENCE sparse paged decode attention (nvcc only), for tests and benchmarks: not a
// production kernel. One thread block per (sequence, query head) walks the view's rows one at a
// time with a block-wide dot product; an engine brings its own attention kernel over the same
// LayerView (e.g. a FlashInfer-style paged decode kernel).
#pragma once

#include <cstdint>

#include "oasiskv/cuda/kernels/common.cuh"
#include "oasiskv/view.hpp"

namespace oasiskv {
inline namespace v0 {
namespace gpu {
namespace reference {

inline constexpr int kAttentionThreads = 128;
inline constexpr int kAttentionMaxChunks = 4;  // head_dim <= 512

// Grid: (batch, num_q_heads). Rows in ascending token order, as sparse_attention_reference; the
// q.k dot product is a block reduction, so logits match the CPU to float rounding, not bitwise.
template <class T>
__global__ void __launch_bounds__(kAttentionThreads)
    attention_kernel(LayerView<T> view, int num_q_heads, float scale, const float* q, float* out) {
  __shared__ float part[2][kAttentionThreads / 32];
  const int i = static_cast<int>(blockIdx.x);
  const int gq = static_cast<int>(blockIdx.y);
  const int d = view.head_dim;
  const int group = num_q_heads / view.num_kv_heads;
  const int p = i * view.num_kv_heads + gq / group;
  const float* qv = q + (static_cast<std::int64_t>(i) * num_q_heads + gq) * d;
  const int tid = static_cast<int>(threadIdx.x);
  float qr[kAttentionMaxChunks], acc[kAttentionMaxChunks];
#pragma unroll
  for (int u = 0; u < kAttentionMaxChunks; ++u) {
    const int c = tid + u * kAttentionThreads;
    qr[u] = c < d ? qv[c] : 0.0f;
    acc[u] = 0.0f;
  }
  float mx = -INFINITY, sum = 0.0f;
  int buf = 0;
  for (std::int32_t e = view.indptr[p]; e < view.indptr[p + 1]; ++e) {
    const T* kb = view.pool + static_cast<std::int64_t>(view.slot[e]) * view.slot_stride;
    const T* vb = kb + static_cast<std::int64_t>(view.block_tokens) * d;
    const std::int32_t valid = view.valid_tokens[e];
    for (std::int32_t r = 0; r < valid; ++r) {
      const T* kr = kb + static_cast<std::int64_t>(r) * d;
      const T* vr = vb + static_cast<std::int64_t>(r) * d;
      float partial = 0.0f;
#pragma unroll
      for (int u = 0; u < kAttentionMaxChunks; ++u) {
        const int c = tid + u * kAttentionThreads;
        if (c < d) partial += qr[u] * kernels::to_f(kr[c]);
      }
      for (int o = 16; o > 0; o >>= 1) partial += __shfl_xor_sync(0xffffffffu, partial, o);
      if (tid % 32 == 0) part[buf][tid / 32] = partial;
      __syncthreads();
      float s = 0.0f;
#pragma unroll
      for (int w = 0; w < kAttentionThreads / 32; ++w) s += part[buf][w];
      buf ^= 1;  // the next row writes the other buffer: one barrier per row suffices
      s *= scale;
      if (s > mx) {
        const float rr = expf(mx - s);
        sum *= rr;
#pragma unroll
        for (int u = 0; u < kAttentionMaxChunks; ++u) acc[u] *= rr;
        mx = s;
      }
      const float w = expf(s - mx);
      sum += w;
#pragma unroll
      for (int u = 0; u < kAttentionMaxChunks; ++u) {
        const int c = tid + u * kAttentionThreads;
        if (c < d) acc[u] += w * kernels::to_f(vr[c]);
      }
    }
  }
  float* o = out + (static_cast<std::int64_t>(i) * num_q_heads + gq) * d;
#pragma unroll
  for (int u = 0; u < kAttentionMaxChunks; ++u) {
    const int c = tid + u * kAttentionThreads;
    if (c < d) o[c] = sum > 0.0f ? acc[u] / sum : 0.0f;
  }
}

}  // namespace reference
}  // namespace gpu
}  // namespace v0
}  // namespace oasiskv
