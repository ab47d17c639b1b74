// The CUDA kernels and the CPU backend side by side, fed the same rows. The CPU side is plain
// memory in CacheLayout's layouts (host tier, slot pool) plus SummaryStore; the CPU components
// (SummaryStore::add_key, LookaheadSelector, TransferPlanner) define what the kernels must
// produce. The GPU side: the host tier in a PinnedRegion (mapped: the kernels read and write it
// zero-copy), summaries and slot pool in device memory, zero-filled on the twin's stream.
#pragma once

#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/cuda_support.hpp"
#include "oasiskv/config.hpp"
#include "oasiskv/dtype.hpp"
#include "oasiskv/cpu/detail/summary_store.hpp"
#include "oasiskv/cuda/device_memory.hpp"
#include "oasiskv/cuda/ops.hpp"
#include "oasiskv/cuda/pinned_region.hpp"

namespace oasiskv::gpu_test {

inline CacheConfig test_config(std::mt19937_64& rng, GroupReduction reduction) {
  CacheConfig c;
  const int heads[] = {1, 2, 4};
  const int groups[] = {1, 2, 4};
  const int dims[] = {16, 64, 128};
  c.shape.num_layers = 2;
  c.shape.num_kv_heads = heads[rng() % 3];
  c.shape.num_q_heads = c.shape.num_kv_heads * groups[rng() % 3];
  c.shape.head_dim = dims[rng() % 3];
  c.block_tokens = 16;
  c.budget_tokens = 16 * static_cast<int>(8 + rng() % 12);
  c.sink_tokens = 16;
  c.recent_tokens = 32;
  c.fetch_ratio = (rng() % 2) ? 1.0 : 0.25;
  c.max_sequences = 3;
  c.max_tokens_per_sequence = 1024;
  c.reduction = reduction;
  return c;
}

// Every layer's slot pool: [layer][slots_per_layer][block_elems] elements.
inline std::size_t pool_elements(const CacheLayout& L) {
  return static_cast<std::size_t>(L.num_layers()) * static_cast<std::size_t>(L.slots_per_layer) *
         static_cast<std::size_t>(L.block_elems);
}

template <KvElement T>
struct Twin {
  Twin(const CacheConfig& config, cudaStream_t s)
      : L(CacheLayout::from(config)),
        stream(s),
        host(static_cast<std::size_t>(L.host_tier_elements)),
        pool(pool_elements(L)),
        summ(L),
        ghost(static_cast<std::size_t>(L.host_tier_elements) * sizeof(T), static_cast<std::size_t>(L.block_elems) * sizeof(T)),
        gsumm(static_cast<std::size_t>(L.summary_floats)),
        gpool(pool_elements(L)),
        gmap(upload(identity_block_map(L), s)),
        len(static_cast<std::size_t>(config.max_sequences * config.shape.num_layers), 0) {
    REQUIRE(ghost.pinned());  // fresh anonymous memory: zero, as `host`
    gsumm.fill_async(0, stream);
    gpool.fill_async(0, stream);
  }

  std::int64_t& length(int s, int layer) { return len[static_cast<std::size_t>(s * L.num_layers() + layer)]; }

  // The host tier with the identity block map (identity_block_map), on both sides.
  T* host_block(int s, int layer, int h, std::int64_t b) {
    return host.data() + L.host_block_offset(static_cast<std::int32_t>(L.block_map_index(s, b)), layer, h);
  }
  T* pool_slot(int layer, std::int32_t slot_id) {
    return pool.data() + (static_cast<std::int64_t>(layer) * L.slots_per_layer + slot_id) * L.block_elems;
  }
  T* ghost_base() const { return reinterpret_cast<T*>(ghost.data()); }
  gpu::DeviceHostTier<T> ghost_device() const { return {reinterpret_cast<T*>(ghost.device_data()), gmap.data()}; }
  T* gpool_layer(int layer) const { return gpool.data() + static_cast<std::int64_t>(layer) * L.slots_per_layer * L.block_elems; }

  // Appends rows[i] random rows to sequence slot slots[i] at `layer`, on both backends (the CPU
  // side is the CPU engine's append: host tier, pinned slots, SummaryStore::add_key).
  void append(std::mt19937_64& rng, const std::vector<int>& slots, int layer, const std::vector<int>& rows) {
    const int H = L.num_kv_heads(), d = L.head_dim();
    const std::int64_t bt = L.block_tokens();
    std::vector<std::int32_t> offset{0};
    for (int r : rows) offset.push_back(offset.back() + r);
    const auto total = static_cast<std::size_t>(offset.back());
    std::normal_distribution<float> dist(0.0f, 1.0f);
    std::vector<T> k(total * static_cast<std::size_t>(H * d)), v(k.size());
    for (auto& x : k) x = from_float<T>(dist(rng));
    for (auto& x : v) x = from_float<T>(dist(rng));
    std::vector<std::int32_t> seq_slot(slots.begin(), slots.end());
    std::vector<std::int64_t> seq_len;
    for (int s : slots) seq_len.push_back(length(s, layer));

    std::int64_t row = 0;
    for (std::size_t i = 0; i < slots.size(); ++i) {
      const int s = slots[i];
      const std::int64_t start = length(s, layer), end = start + rows[i];
      const std::int64_t ring_first = L.ring_start(end);
      for (std::int64_t pos = start; pos < end; ++pos, ++row) {
        const std::int64_t b = pos / bt, off = pos % bt;
        const bool pinned = b < L.sink_blocks || b >= ring_first;
        for (int h = 0; h < H; ++h) {
          const T* key = k.data() + (row * H + h) * d;
          const T* val = v.data() + (row * H + h) * d;
          T* hb = host_block(s, layer, h, b);
          std::memcpy(hb + off * d, key, sizeof(T) * static_cast<std::size_t>(d));
          std::memcpy(hb + (bt + off) * d, val, sizeof(T) * static_cast<std::size_t>(d));
          summ.add_key(s, layer, h, pos, key);
          if (pinned) {
            T* slot = pool_slot(layer, L.slot_id(s, h, L.pinned_slot(b)));
            std::memcpy(slot + off * d, key, sizeof(T) * static_cast<std::size_t>(d));
            std::memcpy(slot + (bt + off) * d, val, sizeof(T) * static_cast<std::size_t>(d));
          }
        }
      }
      length(s, layer) = end;
    }

    auto dk = upload(k, stream), dv = upload(v, stream);
    auto doff = upload(offset, stream);
    auto dslot = upload(seq_slot, stream);
    auto dlen = upload(seq_len, stream);
    gpu::DeviceBatch batch{static_cast<int>(slots.size()), dslot.data(), dlen.data()};
    gpu::append<T>(L, layer, batch, doff.data(), dk.data(), dv.data(), ghost_device(), gpool_layer(layer),
                   gsumm.data(), stream);
    OASISKV_CUDA_CHECK(cudaStreamSynchronize(stream));  // before the inputs are freed
  }

  // Host tier, summaries and every slot of every layer equal on both sides.
  void check_equal_state() {
    const auto s = download(gsumm, stream);  // synchronises the stream: the host tier is final too
    CHECK(std::memcmp(host.data(), ghost_base(), host.size() * sizeof(T)) == 0);
    CHECK(std::memcmp(summ.block(0, 0, 0, 0), s.data(), summ.bytes_reserved()) == 0);
    const auto p = download(gpool, stream);
    CHECK(std::memcmp(pool.data(), p.data(), pool.size() * sizeof(T)) == 0);
  }

  CacheLayout L;
  cudaStream_t stream;
  std::vector<T> host;  // CPU host tier
  std::vector<T> pool;  // CPU slot pool, every layer
  SummaryStore summ;
  gpu::PinnedRegion ghost;
  gpu::DeviceBuffer<float> gsumm;
  gpu::DeviceBuffer<T> gpool;
  gpu::DeviceBuffer<std::int32_t> gmap;
  std::vector<std::int64_t> len;
};

}  // namespace oasiskv::gpu_test
