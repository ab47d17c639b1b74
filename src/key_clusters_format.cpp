// The block sums' memory of `remainder = clusters` (oasiskv/kit/key_clusters_format.hpp).
#include "oasiskv/kit/key_clusters_format.hpp"

#include "oasiskv/detail/checked.hpp"
#include "oasiskv/error.hpp"

namespace oasiskv {
inline namespace v0 {

RemainderGeometry clusters_geometry(const CacheConfig& c, std::int64_t max_blocks) {
  const ModelShape& s = c.shape;
  const std::int64_t segment_rows = static_cast<std::int64_t>(kClusterSegmentBlocks) * c.block_tokens;
  const int r = c.remainder_cluster_rows;
  if (r > segment_rows || segment_rows % r != 0 || segment_rows / r > 256) {
    fail(
        "CacheConfig: remainder_cluster_rows must be a power of two in [4, {}] (the rows of a {}-block segment) "
        "giving at most 256 clusters a segment, got {}",
        segment_rows, kClusterSegmentBlocks, r);
  }
  using detail::checked_product;
  RemainderGeometry g;
  g.moment_vectors = 2;  // key sum | value sum
  g.moment_stride = checked_product("CacheConfig: moment floats per kv head (blocks x moment vectors x head_dim)",
                                    max_blocks | 1, g.moment_vectors, s.head_dim);  // odd: see moment_stride
  g.moment_floats =
      checked_product("CacheConfig: moment floats (sequences x layers x kv heads x moment floats per kv head)",
                      c.max_sequences, s.num_layers, s.num_kv_heads, g.moment_stride);
  checked_product("CacheConfig: moment bytes", g.moment_floats, 4);
  return g;
}

}  // namespace v0
}  // namespace oasiskv
