// Cache<cuda, T> beside Cache<cpu, T>, driven by the same calls on the same values: the CUDA
// Cache tests compare views, slot contents, attention and statistics. Host-only.
#pragma once

#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <type_traits>
#include <vector>

#include "cuda/cuda_support.hpp"
#include "oasiskv/cuda/cache.hpp"
#include "oasiskv/oasiskv.hpp"
#include "support.hpp"

namespace oasiskv::gpu_test {

// The remainder stores of a twin's caches (the engines hold them behind their seams), or null when
// the estimate is another.
template <KvElement T>
const detail::ClustersRemainder<T>* cpu_clusters(const Cache<cpu, T>& c) {
  return dynamic_cast<const detail::ClustersRemainder<T>*>(c.backend().remainder_store());
}
template <KvElement T>
const gpu::detail::DeviceClustersRemainder<T>* gpu_clusters(const Cache<cuda, T>& c) {
  return dynamic_cast<const gpu::detail::DeviceClustersRemainder<T>*>(c.backend().remainder_store());
}
template <KvElement T>
const detail::QuantizedRemainder<T>* cpu_quantized(const Cache<cpu, T>& c) {
  return dynamic_cast<const detail::QuantizedRemainder<T>*>(c.backend().remainder_store());
}
template <KvElement T>
const gpu::detail::DeviceQuantizedRemainder<T>* gpu_quantized(const Cache<cuda, T>& c) {
  return dynamic_cast<const gpu::detail::DeviceQuantizedRemainder<T>*>(c.backend().remainder_store());
}

// A device view's arrays, on the host (stream-ordered download).
struct HostView {
  int batch = 0, heads = 0;
  std::vector<SeqId> ids;
  std::vector<std::int64_t> len;
  std::vector<std::int32_t> indptr, slot, block, valid;
};

// The view's arrays copied with copy(pointer, count) -> std::vector (host or device memory).
template <class T, class Copy>
HostView copy_view(const LayerView<T>& v, Copy&& copy) {
  HostView h;
  h.batch = v.batch_size;
  h.heads = v.num_kv_heads;
  const auto B = static_cast<std::size_t>(v.batch_size);
  h.ids = copy(v.seq_ids, B);
  h.len = copy(v.seq_len, B);
  h.indptr = copy(v.indptr, static_cast<std::size_t>(v.num_pairs()) + 1);
  const auto n = static_cast<std::size_t>(h.indptr.back());
  h.slot = copy(v.slot, n);
  h.block = copy(v.block, n);
  h.valid = copy(v.valid_tokens, n);
  return h;
}

template <class T>
HostView fetch_view(const LayerView<T>& v, cudaStream_t s) {
  return copy_view(v, [&](const auto* p, std::size_t n) { return download(p, n, s); });
}

template <class T>
HostView host_view(const LayerView<T>& v) {
  return copy_view(v, [](const auto* p, std::size_t n) {
    return std::vector<std::remove_cv_t<std::remove_pointer_t<decltype(p)>>>(p, p + n);
  });
}

inline void check_same_view(const HostView& a, const HostView& b) {
  REQUIRE(a.batch == b.batch);
  CHECK(a.ids == b.ids);
  CHECK(a.len == b.len);
  REQUIRE(a.indptr == b.indptr);
  CHECK(a.block == b.block);
  CHECK(a.slot == b.slot);
  CHECK(a.valid == b.valid);
}

inline void check_same_statistics(const Statistics& a, const Statistics& b) {
  REQUIRE(a.layers.size() == b.layers.size());
  for (std::size_t l = 0; l < a.layers.size(); ++l) {
    INFO("layer " << l);
    const auto& x = a.layers[l];
    const auto& y = b.layers[l];
    CHECK(x.plans == y.plans);
    CHECK(x.blocks_selected == y.blocks_selected);
    CHECK(x.blocks_fetched == y.blocks_fetched);
    CHECK(x.bytes_fetched == y.bytes_fetched);
    CHECK(x.admits_capped == y.admits_capped);
    CHECK(x.acquires == y.acquires);
    CHECK(x.observed_true_blocks == y.observed_true_blocks);
    CHECK(x.observed_hits == y.observed_hits);
  }
}

inline void check_close(const std::vector<float>& got, const std::vector<float>& expected, float tol) {
  REQUIRE(got.size() == expected.size());
  float worst = 0.0f;
  for (std::size_t j = 0; j < got.size(); ++j) {
    worst = std::max(worst, std::fabs(got[j] - expected[j]) / std::max(1.0f, std::fabs(expected[j])));
  }
  INFO("worst relative difference " << worst);
  CHECK(worst <= tol);
}

template <class T>
float attention_tolerance() {
  return std::is_same_v<T, float> ? 2e-5f : 1e-3f;
}

// Makes `stream` wait a few milliseconds (a host function on the stream): work queued behind it
// runs late, so an ordering bug between the cache's streams shows up as wrong data.
inline void delay_stream(cudaStream_t stream, int microseconds = 3000) {
  OASISKV_CUDA_CHECK(cudaLaunchHostFunc(
      stream,
      [](void* us) { std::this_thread::sleep_for(std::chrono::microseconds(reinterpret_cast<std::intptr_t>(us))); },
      reinterpret_cast<void*>(static_cast<std::intptr_t>(microseconds))));
}

// Host rows and a device copy that stays alive as long as the Rows.
template <class V>
struct Rows {
  std::vector<V> host;
  std::unique_ptr<gpu::DeviceBuffer<V>> device;
  std::int64_t rows = 0;
  RowsView host_view() const { return RowsView{host.data(), dtype_of_v<V>, rows}; }
  RowsView device_view() const { return RowsView{device->data(), dtype_of_v<V>, rows}; }
};
template <class V>
Rows<V> make_rows(std::mt19937_64& rng, std::int64_t rows, int width, cudaStream_t stream, float scale = 1.0f) {
  Rows<V> r;
  r.rows = rows;
  r.host = test::random_rows<V>(rng, static_cast<std::size_t>(rows * width), scale);
  r.device = std::make_unique<gpu::DeviceBuffer<V>>(upload(r.host, stream));
  return r;
}

// Every entry of the device view holds, in its valid rows, the CPU host tier's block.
template <KvElement T>
void check_slot_contents(const Cache<cpu, T>& cpu_cache, const Cache<cuda, T>& gpu_cache, const LayerView<T>& gv,
                         const HostView& hv, cudaStream_t s) {
  const auto& L = cpu_cache.layout();
  const int d = L.head_dim(), bt = L.block_tokens();
  const auto pool = download(gv.pool, static_cast<std::size_t>(L.layer_slots(gv.layer) * L.block_elems), s);
  (void)gpu_cache;
  int mismatches = 0;
  for (int i = 0; i < hv.batch; ++i) {
    const int slot = cpu_cache.block_table().find(hv.ids[static_cast<std::size_t>(i)]);
    REQUIRE(slot >= 0);
    for (int h = 0; h < hv.heads; ++h) {
      const auto p = static_cast<std::size_t>(i * hv.heads + h);
      for (std::int32_t e = hv.indptr[p]; e < hv.indptr[p + 1]; ++e) {
        const auto ue = static_cast<std::size_t>(e);
        const T* ref = cpu_cache.host_tier().block(slot, gv.layer, h, hv.block[ue]);
        const T* got = pool.data() + static_cast<std::int64_t>(hv.slot[ue]) * L.block_elems;
        const std::size_t n = static_cast<std::size_t>(hv.valid[ue]) * static_cast<std::size_t>(d) * sizeof(T);
        const std::int64_t v_off = static_cast<std::int64_t>(bt) * d;
        const bool ok = std::memcmp(got, ref, n) == 0 && std::memcmp(got + v_off, ref + v_off, n) == 0;
        if (!ok && ++mismatches <= 5) {
          INFO("layer " << gv.layer << ", sequence " << hv.ids[static_cast<std::size_t>(i)] << ", kv head " << h << ", block "
                        << hv.block[ue] << ", slot " << hv.slot[ue]);
          CHECK(ok);
        }
      }
    }
  }
  CHECK(mismatches == 0);
}

// The CPU cache and the CUDA cache, driven by the same calls.
template <KvElement T>
struct Twin {
  Twin(const CacheConfig& c, CudaOptions options = {})
      : config(c), cpu_cache(c), gpu_cache(c, with_stream(options, stream.get())) {}
  // Both caches with budgets by layer and kv head.
  Twin(const CacheConfig& c, const BudgetProfile& profile, CudaOptions options = {})
      : config(c), cpu_cache(c, profile), gpu_cache(c, profile, with_stream(options, stream.get())) {}
  static CudaOptions with_stream(CudaOptions o, cudaStream_t s) {
    o.compute_stream = s;
    return o;
  }
  CacheConfig config;
  gpu::Stream stream;
  Cache<cpu, T> cpu_cache;
  Cache<cuda, T> gpu_cache;
  bool float_queries = false;
  std::vector<std::shared_ptr<void>> keep;  // device inputs stay alive until the twin ends

  cudaStream_t s() const { return stream.get(); }
  int row_width() const { return config.shape.num_kv_heads * config.shape.head_dim; }
  int q_width() const { return config.shape.num_q_heads * config.shape.head_dim; }
  template <class V>
  Rows<V> rows(std::mt19937_64& rng, std::int64_t n, int width, float scale = 1.0f) {
    return make_rows<V>(rng, n, width, s(), scale);
  }
  template <class V>
  void hold(Rows<V>& r) {
    keep.push_back(std::shared_ptr<gpu::DeviceBuffer<V>>(std::move(r.device)));
  }

  void add(SeqId id) {
    cpu_cache.add_sequence(id);
    gpu_cache.add_sequence(id);
  }
  void remove(SeqId id) {
    cpu_cache.remove_sequence(id);
    gpu_cache.remove_sequence(id);
  }
  void append(std::mt19937_64& rng, const std::vector<SeqId>& batch, int layer, const std::vector<std::int32_t>& n) {
    std::int64_t total = 0;
    for (auto x : n) total += x;
    auto k = rows<T>(rng, total, row_width());
    auto v = rows<T>(rng, total, row_width());
    cpu_cache.append(batch, layer, n, k.host_view(), v.host_view());
    gpu_cache.append(batch, layer, n, k.device_view(), v.device_view());
    hold(k);
    hold(v);
  }
  // Queries: float or T, alternating.
  template <class F>
  auto with_queries(std::mt19937_64& rng, std::int64_t n, F&& f) {
    float_queries = !float_queries;
    if (float_queries) {
      auto q = rows<float>(rng, n, q_width(), 2.0f);
      auto r = f(q.host_view(), q.device_view());
      hold(q);
      return r;
    }
    auto q = rows<T>(rng, n, q_width(), 2.0f);
    auto r = f(q.host_view(), q.device_view());
    hold(q);
    return r;
  }
  std::pair<Ticket, Ticket> prefetch(std::mt19937_64& rng, const std::vector<SeqId>& batch, int layer, int R) {
    return with_queries(rng, R * static_cast<std::int64_t>(batch.size()), [&](RowsView hq, RowsView dq) {
      const Ticket a = cpu_cache.prefetch(batch, layer, hq);
      const Ticket b = gpu_cache.prefetch(batch, layer, dq);
      CHECK(a.sequences == b.sequences);
      // Generations are unique in the process (a ticket can never match another cache's slot):
      // each ticket carries its own cache's current version of every sequence.
      REQUIRE(a.generations.size() == b.generations.size());
      for (std::size_t i = 0; i < a.sequences.size(); ++i) {
        CHECK(a.generations[i] == cpu_cache.block_table().version(cpu_cache.block_table().find(a.sequences[i])));
        CHECK(b.generations[i] == gpu_cache.block_table().version(gpu_cache.block_table().find(b.sequences[i])));
      }
      CHECK(a.plans == b.plans);
      return std::pair{a, b};
    });
  }
  // acquire both, compare views, slot contents and attention; observe; release both.
  void attend(std::mt19937_64& rng, const std::pair<Ticket, Ticket>& t) {
    const auto& sh = config.shape;
    const float scale = 1.0f / std::sqrt(static_cast<float>(sh.head_dim));
    const LayerView<T> cv = cpu_cache.acquire(t.first);
    const LayerView<T> gv = gpu_cache.acquire(t.second);
    auto q = rows<float>(rng, cv.batch_size, q_width());
    gpu::DeviceBuffer<float> dout(q.host.size());
    gpu::reference::sparse_attention<T>(gv, sh.num_q_heads, scale, q.device->data(), dout.data(), s());
    const HostView want = host_view(cv);
    const HostView got = fetch_view(gv, s());
    check_same_view(want, got);
    check_slot_contents(cpu_cache, gpu_cache, gv, got, s());
    std::vector<float> expected(q.host.size());
    sparse_attention_reference(cv, sh.num_q_heads, scale, q.host.data(), expected.data());
    check_close(download(dout, s()), expected, attention_tolerance<T>());
    with_queries(rng, cv.batch_size, [&](RowsView hq, RowsView dq) {
      cpu_cache.observe(t.first, hq);
      gpu_cache.observe(t.second, dq);
      return 0;
    });
    cpu_cache.release(t.first);
    gpu_cache.release(t.second);
  }
};

}  // namespace oasiskv::gpu_test
