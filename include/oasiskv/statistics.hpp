// Statistics: what the cache moved and how well the resident set matched the true queries.
#pragma once

#include <cstdint>
#include <vector>

namespace oasiskv {
inline namespace v0 {

struct LayerStatistics {
  std::uint64_t plans = 0;            // (sequence, kv head) plans made by prefetch
  std::uint64_t blocks_selected = 0;  // blocks in those plans' selections
  std::uint64_t blocks_fetched = 0;   // blocks queued for copy host -> device tier
  std::uint64_t bytes_fetched = 0;
  std::uint64_t remote_blocks_fetched = 0;  // of those, read from another process (Cache::admit)
  std::uint64_t remote_bytes_fetched = 0;
  std::uint64_t admits_capped = 0;  // selected, not resident, over the fetch cap
  std::uint64_t acquires = 0;
  std::int64_t acquire_wait_ns = 0;        // time acquire blocked on copies
  std::int64_t copy_ns = 0;                // time the copies of this layer took to run (CPU backend; 0 on CUDA)
  std::uint64_t observed_true_blocks = 0;  // |S_true| summed over observe calls
  std::uint64_t observed_hits = 0;         // |S_true and resident| summed

  // Share of the true query's top-K blocks that were resident; 1 when nothing was observed.
  double recall() const noexcept {
    return observed_true_blocks == 0 ? 1.0
                                     : static_cast<double>(observed_hits) / static_cast<double>(observed_true_blocks);
  }
  LayerStatistics& operator+=(const LayerStatistics& o) noexcept {
    plans += o.plans;
    blocks_selected += o.blocks_selected;
    blocks_fetched += o.blocks_fetched;
    bytes_fetched += o.bytes_fetched;
    remote_blocks_fetched += o.remote_blocks_fetched;
    remote_bytes_fetched += o.remote_bytes_fetched;
    admits_capped += o.admits_capped;
    acquires += o.acquires;
    acquire_wait_ns += o.acquire_wait_ns;
    copy_ns += o.copy_ns;
    observed_true_blocks += o.observed_true_blocks;
    observed_hits += o.observed_hits;
    return *this;
  }
};

struct Statistics {
  std::vector<LayerStatistics> layers;
  // The host pool now: its blocks, those held by some sequence, and their bytes.
  std::uint64_t host_blocks_total = 0;
  std::uint64_t host_blocks_in_use = 0;
  std::uint64_t host_bytes_in_use = 0;
  LayerStatistics total() const noexcept {
    LayerStatistics t;
    for (const auto& l : layers) t += l;
    return t;
  }
};

}  // namespace v0
}  // namespace oasiskv
