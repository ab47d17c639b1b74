// What both backends' key clusters (`remainder = clusters`) share: the k-means rounds, which the
// CPU (oasiskv/cpu/detail/remainder/key_clusters.hpp) and CUDA (oasiskv/cuda/ops.hpp,
// kClusterRounds) clusterings must both run to compute the same ids, and the memory of the block
// sums the estimate keeps (clusters_geometry, src/key_clusters_format.cpp). Segments of
// kClusterSegmentBlocks blocks (config.hpp) are what gets clustered.
#pragma once

#include <cstdint>

#include "oasiskv/config.hpp"
#include "oasiskv/remainder_geometry.hpp"

namespace oasiskv {
inline namespace v0 {

// Lloyd rounds of a segment's k-means: measured (README, "key clusters"): 8 rounds.
inline constexpr int kKeyClusterRounds = 8;

// The block sums of `remainder = clusters` for `config` with max_blocks blocks a sequence
// (CacheLayout::max_blocks): moment_vectors, moment_stride and moment_floats, every other field 0.
// Checks that remainder_cluster_rows fits the segment (its range alone is CacheLayout::from's) and
// every size, throwing oasiskv::Error naming the bad value.
RemainderGeometry clusters_geometry(const CacheConfig& config, std::int64_t max_blocks);

}  // namespace v0
}  // namespace oasiskv
