// Device buffers of CudaEngine (oasiskv/cuda/engine.hpp): per-prefetch plan records, per-layer
// view arrays, scoring scratch, query staging, and the packing of host values into the 32-bit
// words that gpu::upload_words sends as kernel parameters. Host-only.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "oasiskv/config.hpp"
#include "oasiskv/cuda/device_memory.hpp"
#include "oasiskv/cuda/ops.hpp"
#include "oasiskv/view.hpp"

namespace oasiskv {
inline namespace v0 {
namespace gpu::detail {

// Words of one call's metadata: at most 2 + 2 + 2 words per sequence and one per (sequence, kv
// head) (a plan's admit caps), plus alignment.
inline std::size_t meta_words(const CacheLayout& l) noexcept {
  return static_cast<std::size_t>(l.config.max_sequences) * (6 + static_cast<std::size_t>(l.num_kv_heads())) + 16;
}
inline std::size_t pairs_of(const CacheLayout& l) noexcept {
  return static_cast<std::size_t>(l.config.max_sequences) * static_cast<std::size_t>(l.num_kv_heads());
}

// Host values packed as 32-bit words, each array 8-byte aligned.
struct Words {
  std::vector<std::uint32_t> words;
  template <class V>
  std::size_t add(const std::vector<V>& v) {
    static_assert(sizeof(V) % 4 == 0);
    if (words.size() % 2 != 0) words.push_back(0);
    const std::size_t off = words.size();
    words.resize(off + v.size() * (sizeof(V) / 4));
    if (!v.empty()) std::memcpy(words.data() + off, v.data(), v.size() * sizeof(V));
    return off;
  }
};
template <class V>
V* word_at(const DeviceBuffer<std::uint32_t>& meta, std::size_t word) noexcept {
  return reinterpret_cast<V*>(meta.data() + word);
}

// The device buffers of one prefetch: its metadata, plan (admits) and post-plan residency. In
// use from prefetch until the Cache frees its ticket (dead, every plan started or dropped).
struct PlanRecord {
  explicit PlanRecord(const CacheLayout& l)
      : meta(meta_words(l)),
        admits(pairs_of(l) * static_cast<std::size_t>(std::max(l.max_selectable_blocks, 1))),
        admit_count(pairs_of(l)),
        capped(pairs_of(l)),
        snapshot(pairs_of(l) * static_cast<std::size_t>(std::max(l.max_selectable_blocks, 1))) {}

  bool busy = false;
  std::uint64_t ticket = 0;
  int layer = 0;
  int size = 0;                       // batch entries
  DeviceBuffer<std::uint32_t> meta;   // seq_slot, seq_len, steps, caps (per pair)
  std::size_t o_slot = 0, o_len = 0;  // word offsets in meta
  DeviceBuffer<DeviceAdmit> admits;
  DeviceBuffer<std::int32_t> admit_count, capped, snapshot;
  Event copied;
  bool copied_recorded = false;
  unsigned long long copied_capture = 0;
  // The entries' sequence slots and generations (host), and whether a copy of this plan reads
  // remote blocks on the host (acquire then waits for it on the host: remote_reads.hpp).
  std::vector<int> host_slots;
  std::vector<std::uint32_t> host_generations;
  bool remote_reads = false;

  DeviceBatch batch(int n, int first = 0) const {
    return DeviceBatch{n, word_at<const std::int32_t>(meta, o_slot) + first,
                       word_at<const std::int64_t>(meta, o_len) + first};
  }
};

// The view arrays of one layer (valid while its ticket is acquired).
struct ViewBuffers {
  explicit ViewBuffers(const CacheLayout& l)
      : meta(meta_words(l)),
        counts(pairs_of(l)),
        indptr(pairs_of(l) + 1),
        slot(pairs_of(l) * static_cast<std::size_t>(l.max_budget_blocks)),
        block(pairs_of(l) * static_cast<std::size_t>(l.max_budget_blocks)),
        valid(pairs_of(l) * static_cast<std::size_t>(l.max_budget_blocks)) {}
  DeviceBuffer<std::uint32_t> meta;
  DeviceBuffer<std::int32_t> counts, indptr, slot, block, valid;
  const SeqId* seq_ids = nullptr;
  const std::int64_t* seq_len = nullptr;
  const std::int32_t* seq_slot = nullptr;
  int batch_size = 0;
};

// Scoring and top-K scratch of one stream.
struct Scratch {
  Scratch(const CacheLayout& l, int max_query_rows)
      : stride(static_cast<int>(std::max<std::int64_t>(1, l.max_blocks - l.sink_blocks))),
        scores(pairs_of(l) * static_cast<std::size_t>(stride)),
        count(pairs_of(l)),
        first(pairs_of(l)),
        sel(pairs_of(l) * static_cast<std::size_t>(std::max(l.max_selectable_blocks, 1))),
        sel_count(pairs_of(l)) {
    if (l.config.reduction == GroupReduction::softmax_sum) {
      bounds = DeviceBuffer<float>(pairs_of(l) * static_cast<std::size_t>(max_query_rows) *
                                   static_cast<std::size_t>(l.group_size) * static_cast<std::size_t>(stride));
    }
  }
  ScoreBuffers buffers() const {
    return ScoreBuffers{scores.data(), count.data(), first.data(), bounds.data(), stride};
  }
  int stride = 1;
  DeviceBuffer<float> scores, bounds;
  DeviceBuffer<std::int32_t> count, first, sel, sel_count;
};

// Lookahead queries copied on the compute stream at prefetch, so the engine may overwrite its own
// buffer right after prefetch returns while scoring waits on the copy stream. A ring: reusing an
// entry makes the compute stream wait until the scoring that read it ran. An event is only waited
// on in the capture context it was recorded in (waits across a capture boundary are invalid);
// across the boundary join() and the graph launch on the compute stream order the two uses.
struct QueryStaging {
  QueryStaging(const CacheLayout& l, int max_query_rows, int entries) {
    const std::size_t bytes = static_cast<std::size_t>(l.config.max_sequences) *
                              static_cast<std::size_t>(max_query_rows) * static_cast<std::size_t>(l.q_row_elems) *
                              sizeof(float);
    for (int i = 0; i < entries; ++i) ring.push_back(std::make_unique<Entry>(bytes));
  }
  struct Entry {
    explicit Entry(std::size_t bytes) : data(bytes) {}
    DeviceBuffer<std::byte> data;
    Event consumed;  // recorded on the copy stream after the scoring that read `data`
    bool used = false;
    unsigned long long capture = 0;  // the capture `consumed` was recorded in (0: eager)
  };
  Entry& next() {
    Entry& e = *ring[cursor];
    cursor = (cursor + 1) % ring.size();
    return e;
  }
  std::vector<std::unique_ptr<Entry>> ring;
  std::size_t cursor = 0;
};

}  // namespace gpu::detail
}  // namespace v0
}  // namespace oasiskv
