// RemainderGeometry: the memory of the remainder estimate a CacheConfig names
// (CacheConfig::remainder), held as one member of CacheLayout (CacheLayout::remainder). Each
// estimate's codec computes its own fields, next to the codec both backends read:
// clusters_geometry (oasiskv/kit/key_clusters_format.hpp) the block sums of `remainder = clusters`,
// quantized_geometry (oasiskv/kit/quantized_rows.hpp) the block codes of `remainder = quantized`;
// every field of an estimate not in use is 0. Both backends size their stores from it and address
// them with CacheLayout::moment_offset and CacheLayout::quantized_offset.
#pragma once

#include <cstdint>

namespace oasiskv {
inline namespace v0 {

struct RemainderGeometry {
  // The block sums of `remainder = clusters`: per (sequence slot, layer, kv head) moment_stride
  // floats of [block][moment_vectors][head_dim], the vectors being key sum | value sum.
  std::int64_t moment_floats = 0;  // every (sequence slot, layer, kv head)'s
  // Odd blocks (as CacheLayout::summary_stride: the heads' current blocks in distinct cache sets)
  // x moment_vectors x head_dim.
  std::int64_t moment_stride = 0;
  int moment_vectors = 0;  // 2 with clusters (key sum | value sum), else 0
  // `remainder = quantized`: bytes of one block's codes (oasiskv::quantized_block_bytes) and of
  // every (sequence slot, layer, kv head, block)'s.
  std::int64_t quantized_block_bytes = 0;
  std::int64_t quantized_bytes = 0;
};

}  // namespace v0
}  // namespace oasiskv
