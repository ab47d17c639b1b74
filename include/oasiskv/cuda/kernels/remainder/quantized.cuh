// `remainder = quantized` on the device (nvcc only; the host side: cuda/detail/remainder/
// quantized.hpp). encode_quantized_kernel codes blocks from their host rows as
// src/quantized_rows.cpp does (the same bytes: IEEE-rounded subtract, divide and round to nearest
// even), after every append, truncate and fork, so every block with rows has codes (the CPU codes
// only full blocks and codes a partial one when it meets it: the same bytes); and
// remainder_quantized_kernel attends over the decoded rows of the blocks a view leaves out.
#pragma once

#include <cstdint>

#include "oasiskv/cuda/kernels/common.cuh"
#include "oasiskv/kit/quantized_rows.hpp"  // the code format

namespace oasiskv {
inline namespace v0 {
namespace gpu {
namespace kernels {

// ---- RemainderEstimate::quantized (oasiskv/kit/quantized_rows.hpp's format) ----

inline constexpr int kQuantizedThreads = 128;

// Byte offsets of a block's key codes and value codes (its value scales start at 0).
struct QuantizedParts {
  std::int64_t groups, code_bytes, key_codes, value_codes;
};
__device__ __forceinline__ QuantizedParts quantized_parts(int bt, int d, int bits) {
  QuantizedParts p;
  p.groups = (d + kQuantizedValueGroup - 1) / kQuantizedValueGroup;
  p.code_bytes = (static_cast<std::int64_t>(bt) * d * bits + 7) / 8;
  p.key_codes = static_cast<std::int64_t>(bt) * p.groups * 2 * 4;
  p.value_codes = p.key_codes + p.code_bytes;
  return p;
}

__device__ __forceinline__ float quantized_step(float hi, float lo, float levels) {
  const float step = __fdiv_rn(__fsub_rn(hi, lo), levels);
  return isfinite(step) ? step : __fsub_rn(__fdiv_rn(hi, levels), __fdiv_rn(lo, levels));
}

__device__ __forceinline__ unsigned quantized_code(float x, float lo, float step, float levels) {
  if (!(step > 0.0f)) return 0u;
  const float c = rintf(__fdiv_rn(__fsub_rn(x, lo), step));
  return static_cast<unsigned>(fminf(fmaxf(c, 0.0f), levels));
}

// Code e of a block's stream (32-bit: a block holds far fewer than 2^28 codes).
__device__ __forceinline__ unsigned code_at(const std::uint8_t* p, int e, int bits) {
  const int bit = e * bits;
  const int shift = bit & 7;
  unsigned v = static_cast<unsigned>(p[bit >> 3]) >> shift;
  if (shift + bits > 8) v |= static_cast<unsigned>(p[(bit >> 3) + 1]) << (8 - shift);
  return v & ((1u << bits) - 1u);
}

// One thread block codes the first n rows of a host block (hb: [K | V][bt][d]) with the key
// summary ([max | min][d]) into out. Every byte is written by one thread (the codes overlapping it),
// so no two threads write one byte; the value scales are written first and read back after a barrier.
template <class T>
__device__ void encode_quantized_block(const T* hb, int n, int bt, int d, int bits, const float* summary,
                                       std::uint8_t* out) {
  const QuantizedParts p = quantized_parts(bt, d, bits);
  const float levels = static_cast<float>((1 << bits) - 1);
  float* scales = reinterpret_cast<float*>(out);
  const int tid = static_cast<int>(threadIdx.x), nt = static_cast<int>(blockDim.x);
  for (std::int64_t u = tid; u < static_cast<std::int64_t>(bt) * p.groups; u += nt) {
    const int r = static_cast<int>(u / p.groups), g0 = static_cast<int>(u % p.groups) * kQuantizedValueGroup;
    float lo = 0.0f, step = 0.0f;
    if (r < n) {
      const T* v = hb + (static_cast<std::int64_t>(bt) + r) * d;
      const int g1 = min(d, g0 + kQuantizedValueGroup);
      lo = to_f(v[g0]);
      float hi = lo;
      for (int c = g0 + 1; c < g1; ++c) lo = fmin_cpu(lo, to_f(v[c])), hi = fmax_cpu(hi, to_f(v[c]));
      step = quantized_step(hi, lo, levels);
    }
    scales[u * 2] = lo;
    scales[u * 2 + 1] = step;
  }
  __syncthreads();  // the scales, for the value codes below
  const int elems = n * d, code_bytes = static_cast<int>(p.code_bytes);
  for (int j = tid; j < 2 * code_bytes; j += nt) {
    const bool value = j >= code_bytes;
    const int byte = value ? j - code_bytes : j;
    unsigned x = 0;
    for (int e = byte * 8 / bits; e <= (byte * 8 + 7) / bits && e < elems; ++e) {
      const int r = e / d, c = e % d;
      unsigned code;
      if (value) {
        const float* sc = scales + (static_cast<std::int64_t>(r) * p.groups + c / kQuantizedValueGroup) * 2;
        code = quantized_code(to_f(hb[(static_cast<std::int64_t>(bt) + r) * d + c]), sc[0], sc[1], levels);
      } else {
        code = quantized_code(to_f(hb[static_cast<std::int64_t>(r) * d + c]), summary[d + c],
                              quantized_step(summary[c], summary[d + c], levels), levels);
      }
      const int shift = e * bits - byte * 8;  // where the code starts, relative to the byte
      x |= shift >= 0 ? code << shift : code >> (-shift);
    }
    out[(value ? p.value_codes : p.key_codes) + byte] = static_cast<std::uint8_t>(x & 0xffu);
  }
  // The padding to 4 bytes past the value codes.
  const std::int64_t end = p.value_codes + p.code_bytes;
  for (std::int64_t j = end + tid; j < (end + 3) / 4 * 4; j += nt) out[j] = 0;
}

// Grid: (batch entry, kv head). After append_kernel (same stream): the blocks the append of rows
// [row_offset[i], row_offset[i + 1]) touched, coded from the host tier (a partial one: its rows).
template <class T>
__global__ void __launch_bounds__(kQuantizedThreads)
    append_quantized_kernel(CacheLayout g, int layer, DeviceBatch batch, const std::int32_t* row_offset,
                            DeviceHostTier<T> host, const float* summaries, std::uint8_t* codes) {
  const int i = static_cast<int>(blockIdx.x), h = static_cast<int>(blockIdx.y);
  const int s = batch.seq_slot[i];
  const std::int64_t bt = g.block_tokens();
  const std::int64_t from = batch.seq_len[i], to = from + (row_offset[i + 1] - row_offset[i]);
  for (std::int64_t b = from / bt; b * bt < to; ++b) {
    const int n = static_cast<int>(to - b * bt < bt ? to - b * bt : bt);
    encode_quantized_block(host.block(g, s, layer, h, b), n, static_cast<int>(bt), g.head_dim(),
                           g.config.remainder_bits, summaries + g.summary_offset(s, layer, h, b),
                           codes + g.quantized_offset(s, layer, h, b));
    __syncthreads();  // the next block reuses nothing, but keep the blocks' writes in order
  }
}

// Grid: kv heads. (dst_slot, layer) at `length`: codes of blocks [0, length / block_tokens) copied
// from src_slot when it differs (a fork), the partial block's coded from its host rows.
template <class T>
__global__ void __launch_bounds__(kQuantizedThreads)
    rebuild_quantized_kernel(CacheLayout g, int src_slot, int dst_slot, int layer, std::int64_t length,
                             DeviceHostTier<T> host, const float* summaries, std::uint8_t* codes) {
  const int h = static_cast<int>(blockIdx.x);
  const std::int64_t bt = g.block_tokens();
  const std::int64_t cut = length / bt;
  if (src_slot != dst_slot) {
    const std::uint8_t* from = codes + g.quantized_offset(src_slot, layer, h, 0);
    std::uint8_t* to = codes + g.quantized_offset(dst_slot, layer, h, 0);
    for (std::int64_t e = threadIdx.x; e < cut * g.remainder.quantized_block_bytes; e += blockDim.x) to[e] = from[e];
  }
  if (length % bt == 0) return;
  encode_quantized_block(host.block(g, dst_slot, layer, h, cut), static_cast<int>(length - cut * bt),
                         static_cast<int>(bt), g.head_dim(), g.config.remainder_bits,
                         summaries + g.summary_offset(dst_slot, layer, h, cut),
                         codes + g.quantized_offset(dst_slot, layer, h, cut));
}

// Grid as remainder_kernel's: one state per thread block, over the blocks of [0, blocks_for(len))
// the view's pair leaves out, one block at a time: its key steps and score offset
// (quantized_score_offset), each row's score from its decoded key (threads over rows), the running
// max and sum as flash decoding keeps them, the decoded values weighted in (threads over channels).
// Shared memory: q[d], acc[d], steps[d], scores[block_tokens], 32 floats.
template <class QT>
__global__ void __launch_bounds__(kQuantizedThreads)
    remainder_quantized_kernel(CacheLayout g, int layer, DeviceBatch batch, const std::int32_t* indptr,
                               const std::int32_t* view_block, const QT* q, int rows, const float* summaries,
                               const std::uint8_t* codes, float* out, float* lse) {
  extern __shared__ float smem[];
  const int d = g.head_dim(), H = g.num_kv_heads(), G = g.group_size;
  const int bt = g.block_tokens(), bits = g.config.remainder_bits;
  float* qs = smem;
  float* acc = qs + d;
  float* steps = acc + d;
  float* scores = steps + d;
  float* red = scores + bt;
  const int p = static_cast<int>(blockIdx.x);
  const int i = p / H, h = p % H;
  const int r = static_cast<int>(blockIdx.y) / G;
  const std::int64_t state =
      (static_cast<std::int64_t>(i) * rows + r) * g.num_q_heads() + h * G + static_cast<int>(blockIdx.y) % G;
  const int tid = static_cast<int>(threadIdx.x), nt = static_cast<int>(blockDim.x);
  for (int c = tid; c < d; c += nt) {
    qs[c] = to_f(q[state * d + c]);
    acc[c] = 0.0f;
  }
  const int s = batch.seq_slot[i];
  const std::int64_t len = batch.seq_len[i];
  const std::int64_t nb = g.blocks_for(len);
  const std::int32_t lo = indptr[p], hi = indptr[p + 1];
  const float levels = static_cast<float>((1 << bits) - 1);
  const float scale = g.softmax_scale;
  const QuantizedParts parts = quantized_parts(bt, d, bits);
  float m = -INFINITY, total = 0.0f;
  std::int32_t next = lo;  // the view's blocks are ascending
  __syncthreads();
  for (std::int64_t b = 0; b < nb; ++b) {
    if (next < hi && view_block[next] == b) {  // resident (every thread takes the same branch)
      ++next;
      continue;
    }
    const int n = static_cast<int>(len - b * bt < bt ? len - b * bt : bt);
    const float* summary = summaries + g.summary_offset(s, layer, h, b);
    const std::uint8_t* code = codes + g.quantized_offset(s, layer, h, b);
    const float* vscale = reinterpret_cast<const float*>(code);
    float noise = 0.0f;
    for (int c = tid; c < d; c += nt) {
      steps[c] = quantized_step(summary[c], summary[d + c], levels);
      const float st = summary[c] / levels - summary[d + c] / levels;  // quantized_key_noise
      noise += qs[c] * qs[c] * (st * st / 12.0f);
    }
    const float offset = 0.5f * scale * scale * block_sum(noise, red);  // its barriers publish steps
    float top = -INFINITY;
    for (int row = tid; row < n; row += nt) {
      float dot = 0.0f;
      for (int c = 0; c < d; ++c) {
        const float k =
            summary[d + c] + static_cast<float>(code_at(code + parts.key_codes, row * d + c, bits)) * steps[c];
        dot += qs[c] * k;
      }
      scores[row] = dot * scale - offset;
      top = fmaxf(top, scores[row]);
    }
    top = block_max(top, red);
    const float fresh = fmaxf(m, top);
    const float rescale = m == -INFINITY ? 0.0f : expf(m - fresh);
    float mine = 0.0f;
    for (int row = tid; row < n; row += nt) {
      scores[row] = expf(scores[row] - fresh);
      mine += scores[row];
    }
    total = total * rescale + block_sum(mine, red);  // its barriers publish the weights
    for (int c = tid; c < d; c += nt) {
      float x = acc[c] * rescale;
      const int gi = c / kQuantizedValueGroup;
      for (int row = 0; row < n; ++row) {
        const float* sc = vscale + (static_cast<std::int64_t>(row) * parts.groups + gi) * 2;
        const float v = sc[0] + static_cast<float>(code_at(code + parts.value_codes, row * d + c, bits)) * sc[1];
        x += scores[row] * v;
      }
      acc[c] = x;
    }
    m = fresh;
    __syncthreads();  // steps and scores are rewritten by the next block
  }
  const bool empty = m == -INFINITY || !(total > 0.0f);
  for (int c = tid; c < d; c += nt) out[state * d + c] = empty ? 0.0f : acc[c] / total;
  if (tid == 0) lse[state] = empty ? -INFINITY : m + logf(total);
}

}  // namespace kernels
}  // namespace gpu
}  // namespace v0
}  // namespace oasiskv
