// Remote reads of the CUDA engine (Cache<cuda>::admit, oasiskv/remote_blocks.hpp). Debian's UCX
// reads host memory only, and the blocks a plan admits are known on the device, so for a plan
// holding an admitted sequence the copy stream runs, in order: the plan's admits copied back to
// pinned memory; a host function (cudaLaunchHostFunc) that reads the remote ones into pinned
// staging through the sequence's source; the gather kernel, which takes those blocks from the
// staging. The host function calls no CUDA API; it returns its buffer to a pool the engine
// reuses. A failed read is recorded for the sequence (acquire throws naming it). Host-only.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "oasiskv/cuda/ops.hpp"
#include "oasiskv/cuda/pinned_region.hpp"
#include "oasiskv/error.hpp"
#include "oasiskv/remote_blocks.hpp"

namespace oasiskv {
inline namespace v0 {
namespace gpu::detail {

// Where one admitted sequence's remote blocks are. Immutable once made (jobs share it).
struct RemoteBlocks {
  std::shared_ptr<RemoteBlockSource> source;
  std::vector<std::uint64_t> addresses;  // per logical block
  std::vector<char> remote;              // per logical block: kept in the other process
  // During the admission only: the working set's rows of remote blocks, by (layer, kv head,
  // block), which the first plans take instead of reading them.
  std::map<std::tuple<int, int, std::int32_t>, std::size_t> staged_at;
  std::vector<std::byte> staged;
};

// Failed reads, per sequence slot and generation; written by host functions, read by acquire.
class RemoteFailures {
 public:
  void record(int slot, std::uint32_t generation, std::string why) {
    std::lock_guard lock(mutex_);
    failures_.try_emplace(slot, generation, std::move(why));
  }
  std::string find(int slot, std::uint32_t generation) const {
    std::lock_guard lock(mutex_);
    const auto it = failures_.find(slot);
    return it != failures_.end() && it->second.first == generation ? it->second.second : std::string();
  }
  void clear(int slot) {
    std::lock_guard lock(mutex_);
    failures_.erase(slot);
  }

 private:
  mutable std::mutex mutex_;
  std::map<int, std::pair<std::uint32_t, std::string>> failures_;
};

// Pinned buffers of jobs: taken on the engine's thread (which may allocate), given back by the
// host function (which may not call CUDA).
class PinnedBuffers {
 public:
  std::unique_ptr<PinnedRegion> take(std::size_t bytes) {
    {
      std::lock_guard lock(mutex_);
      for (auto it = free_.begin(); it != free_.end(); ++it) {
        if ((*it)->bytes() >= bytes) {
          auto out = std::move(*it);
          free_.erase(it);
          return out;
        }
      }
    }
    auto out = std::make_unique<PinnedRegion>(bytes, 256);
    if (!out->pinned()) fail("Cache<cuda>: {} bytes of staging for remote reads could not be pinned and mapped", bytes);
    return out;
  }
  void give_back(std::unique_ptr<PinnedRegion> buffer) {
    std::lock_guard lock(mutex_);
    free_.push_back(std::move(buffer));
  }

 private:
  std::mutex mutex_;
  std::vector<std::unique_ptr<PinnedRegion>> free_;
};

// One start_copies' remote reads. Its buffer: admit counts [pairs], admits [pairs][K], then the
// staging [pairs][K][block bytes] (256-byte aligned).
struct RemoteJob {
  struct Entry {
    int pair_first = 0;  // its first (sequence, kv head) pair in the plan's batch
    int slot = 0;
    std::uint32_t generation = 0;
    std::shared_ptr<const RemoteBlocks> blocks;
  };
  int layer = 0, kv_heads = 0, selectable = 0;
  std::size_t block_bytes = 0;
  int pairs = 0;
  std::vector<Entry> entries;
  std::unique_ptr<PinnedRegion> buffer;
  RemoteFailures* failures = nullptr;
  PinnedBuffers* buffers = nullptr;
  std::atomic<std::uint64_t>* blocks_read = nullptr;  // the layer's counter

  static std::size_t admits_offset(int pairs) noexcept { return align(static_cast<std::size_t>(pairs) * 4); }
  static std::size_t staging_offset(int pairs, int selectable) noexcept {
    return align(admits_offset(pairs) +
                 static_cast<std::size_t>(pairs) * static_cast<std::size_t>(selectable) * sizeof(DeviceAdmit));
  }
  static std::size_t bytes_for(int pairs, int selectable, std::size_t block_bytes) noexcept {
    return staging_offset(pairs, selectable) +
           static_cast<std::size_t>(pairs) * static_cast<std::size_t>(selectable) * block_bytes;
  }
  static std::size_t align(std::size_t n) noexcept { return (n + 255) / 256 * 256; }

  // cudaLaunchHostFunc's callback: runs once, then gives the buffer back and deletes the job.
  static void run(void* self) noexcept {
    std::unique_ptr<RemoteJob> job(static_cast<RemoteJob*>(self));
    job->read_all();
    job->buffers->give_back(std::move(job->buffer));
  }

 private:
  void read_all() noexcept {
    std::byte* base = buffer->data();
    const auto* counts = reinterpret_cast<const std::int32_t*>(base);
    const auto* admits = reinterpret_cast<const DeviceAdmit*>(base + admits_offset(pairs));
    std::byte* staging = base + staging_offset(pairs, selectable);
    std::vector<RemoteBlockRead> reads;
    for (const Entry& e : entries) {
      if (!failures->find(e.slot, e.generation).empty()) continue;  // one failure per sequence
      reads.clear();
      for (int h = 0; h < kv_heads; ++h) {
        const int p = e.pair_first + h;
        for (int a = 0; a < counts[p]; ++a) {
          const DeviceAdmit adm =
              admits[static_cast<std::size_t>(p) * static_cast<std::size_t>(selectable) + static_cast<std::size_t>(a)];
          const auto b = static_cast<std::size_t>(adm.block);
          if (b >= e.blocks->remote.size() || !e.blocks->remote[b]) continue;
          std::byte* dst = staging + (static_cast<std::size_t>(p) * static_cast<std::size_t>(selectable) +
                                      static_cast<std::size_t>(a)) *
                                         block_bytes;
          if (const auto it = e.blocks->staged_at.find(std::tuple(layer, h, adm.block));
              it != e.blocks->staged_at.end()) {
            std::memcpy(dst, e.blocks->staged.data() + it->second, block_bytes);
            continue;
          }
          const auto head =
              static_cast<std::uint64_t>(layer) * static_cast<std::uint64_t>(kv_heads) + static_cast<std::uint64_t>(h);
          reads.push_back(RemoteBlockRead{dst, e.blocks->addresses[b] + head * block_bytes, block_bytes});
        }
      }
      if (reads.empty()) continue;
      blocks_read->fetch_add(reads.size(), std::memory_order_relaxed);  // as the CPU engine: reads issued
      try {
        e.blocks->source->read(reads);
      } catch (const std::exception& x) {
        failures->record(e.slot, e.generation, x.what());
      } catch (...) {
        failures->record(e.slot, e.generation, "a remote read failed");
      }
    }
  }
};

}  // namespace gpu::detail
}  // namespace v0
}  // namespace oasiskv
