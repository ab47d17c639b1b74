// A tighter dense CPU decode attention than oasiskv::dense_attention_reference, as the yardstick
// for "a dense attention step" on this machine: each K and V row is converted once per kv head and
// used by the whole query group (the reference re-reads it for every query head), fp16 converts
// through a 64K-entry table, and dot products and updates run on 8 independent lanes so the
// compiler vectorises them. Single-threaded, like every other benchmark here.
#pragma once

#include <oasiskv/dtype.hpp>

#include <cstdint>
#include <vector>

namespace oasiskv::bench {

// k, v: [len][num_kv_heads][head_dim]; q, out: [num_q_heads][head_dim]; scratch is resized.
void dense_attention_tight(const fp16_t* k, const fp16_t* v, std::int64_t len, int num_q_heads,
                           int num_kv_heads, int head_dim, float scale, const float* q, float* out,
                           std::vector<float>& scratch);

}  // namespace oasiskv::bench
