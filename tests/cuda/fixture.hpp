// A CPU backend and a CUDA backend side by side, fed the same rows: the CPU components (HostTier,
// SummaryStore, DeviceTier<cpu>, LookaheadSelector, TransferPlanner) define what the kernels must
// produce.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/cuda_support.hpp"
#include "oasiskv/oasiskv.hpp"
#include "oasiskv/cuda/components.cuh"
#include "oasiskv/cuda/ops.cuh"

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

template <KvElement T>
struct Twin {
  explicit Twin(const CacheConfig& config)
      : L(CacheLayout::from(config)),
        g(gpu::Geometry::from(L)),
        host(L),
        summ(L),
        dev(L),
        ghost(L),
        gsumm(summ.bytes_reserved() / sizeof(float)),
        gdev(L),
        len(static_cast<std::size_t>(config.max_sequences * config.shape.num_layers), 0) {
    REQUIRE(ghost.pinned());
    OASISKV_CUDA_CHECK(cudaMemset(gdev.layer_pool(0), 0, gdev.bytes_reserved()));
  }

  std::int64_t& length(int s, int layer) { return len[static_cast<std::size_t>(s * L.config.shape.num_layers + layer)]; }

  // Appends rows[i] random rows to sequence slot slots[i] at `layer`, on both backends (the CPU
  // side is Cache<cpu>::append's loop).
  void append(std::mt19937_64& rng, const std::vector<int>& slots, int layer, const std::vector<int>& rows,
              cudaStream_t stream) {
    const int H = L.config.shape.num_kv_heads, d = L.config.shape.head_dim;
    const std::int64_t bt = L.config.block_tokens;
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
          T* hb = host.block(s, layer, h, b);
          std::memcpy(hb + off * d, key, sizeof(T) * static_cast<std::size_t>(d));
          std::memcpy(hb + (bt + off) * d, val, sizeof(T) * static_cast<std::size_t>(d));
          summ.add_key(s, layer, h, pos, key);
          if (pinned) {
            T* slot = dev.slot(layer, dev.slot_id(s, h, L.pinned_slot(b)));
            std::memcpy(slot + off * d, key, sizeof(T) * static_cast<std::size_t>(d));
            std::memcpy(slot + (bt + off) * d, val, sizeof(T) * static_cast<std::size_t>(d));
          }
        }
      }
      length(s, layer) = end;
    }

    auto dk = upload(k), dv = upload(v);
    auto doff = upload(offset);
    auto dslot = upload(seq_slot);
    auto dlen = upload(seq_len);
    gpu::DeviceBatch batch{static_cast<int>(slots.size()), dslot.data(), dlen.data()};
    gpu::append<T>(g, layer, batch, doff.data(), dk.data(), dv.data(), ghost.device_base(), gdev.layer_pool(layer),
                   gsumm.data(), stream);
    OASISKV_CUDA_CHECK(cudaStreamSynchronize(stream));
  }

  void check_equal_state() {
    OASISKV_CUDA_CHECK(cudaDeviceSynchronize());
    CHECK(std::memcmp(host.block(0, 0, 0, 0), ghost.base(), host.bytes_reserved()) == 0);
    const auto s = download(gsumm, gsumm.size());
    CHECK(std::memcmp(summ.block(0, 0, 0, 0), s.data(), summ.bytes_reserved()) == 0);
    const auto pool = download(gdev.layer_pool(0), gdev.bytes_reserved() / sizeof(T));
    CHECK(std::memcmp(dev.layer_pool(0), pool.data(), dev.bytes_reserved()) == 0);
  }

  CacheLayout L;
  gpu::Geometry g;
  HostTier<T> host;
  SummaryStore summ;
  DeviceTier<cpu, T> dev;
  gpu::PinnedHostTier<T> ghost;
  gpu::DeviceBuffer<float> gsumm;
  DeviceTier<cuda, T> gdev;
  std::vector<std::int64_t> len;
};

}  // namespace oasiskv::gpu_test
