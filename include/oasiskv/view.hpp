// LayerView: the resident working set of one layer as a paged KV cache with one kv head per
// "request" (CSR over (sequence, kv head) pairs), the contract of the engine's attention
// callback. Reference attentions over it: oasiskv/reference_attention.hpp.
#pragma once

#include <cstdint>

#include "oasiskv/dtype.hpp"

namespace oasiskv {
inline namespace v0 {

using SeqId = std::uint64_t;

// A view's shape, apart from its arrays: what a copy of a view (the Python binding's, the tests'
// host copies) carries over as one piece. A slot is K[block_tokens][head_dim] then V, at
// pool + slot * slot_stride.
struct ViewGeometry {
  int layer = 0;
  int batch_size = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int block_tokens = 0;
  std::int64_t slot_stride = 0;

  int num_pairs() const noexcept { return batch_size * num_kv_heads; }
  ViewGeometry& geometry() noexcept { return *this; }
  const ViewGeometry& geometry() const noexcept { return *this; }
};

// Pair p = i * num_kv_heads + h is kv head h of the batch's sequence i. Its resident blocks are
// entries [indptr[p], indptr[p+1]), in ascending logical block order. Entry e: the slot
// `slot[e]` of `pool` holds logical block `block[e]`, whose first `valid_tokens[e]` rows are
// tokens block[e] * block_tokens + r, at keys(e) and values(e). Valid from acquire until release.
template <class T>
struct LayerView : ViewGeometry {
  const SeqId* seq_ids = nullptr;         // [batch_size]
  const std::int64_t* seq_len = nullptr;  // [batch_size] tokens of each sequence at this layer
  const std::int32_t* indptr = nullptr;   // [batch_size * num_kv_heads + 1]
  const std::int32_t* slot = nullptr;
  const std::int32_t* block = nullptr;
  const std::int32_t* valid_tokens = nullptr;
  const T* pool = nullptr;

  const T* keys(std::int32_t entry) const noexcept { return pool + slot[entry] * slot_stride; }
  const T* values(std::int32_t entry) const noexcept {
    return keys(entry) + static_cast<std::int64_t>(block_tokens) * head_dim;
  }
};

}  // namespace v0
}  // namespace oasiskv
