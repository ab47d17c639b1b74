// The caches the module binds, erased over backend and element type: CacheBase (what every bound
// call needs), ViewData (what acquire hands to Python), CacheImpl<Backend, T> over the one C++
// Cache, and the factories: make_cpu_cache (cpu_cache.cpp) and make_cuda_cache (cuda_cache.cpp
// where the module is built with CUDA, else no_cuda.cpp, which refuses with the reason).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "oasiskv/cache.hpp"
#include "oasiskv/config.hpp"
#include "oasiskv/dtype.hpp"
#include "oasiskv/statistics.hpp"
#include "oasiskv/ticket.hpp"
#include "oasiskv/view.hpp"
#include "thread_pool.hpp"

namespace oasiskv::python {

// Where a cache's arrays live: host memory, or CUDA device `device` with work on `stream` (a
// cudaStream_t as an integer; 0: the legacy default stream).
struct Placement {
  bool cuda = false;
  int device = -1;
  std::uintptr_t stream = 0;
};

// One LayerView for Python. On the host its CSR arrays are copies (small: one entry per resident
// block; the cache reuses its own for the next acquire); on CUDA they stay in device memory,
// valid until release, and slot, block and valid_tokens have room for `entry_capacity` entries of
// which the first indptr[num_pairs] are the view's (the count is on the device).
struct ViewData : ViewGeometry {
  std::uint64_t ticket = 0;
  std::uint64_t serial = 0;  // the acquire that made it (PyCache)
  Placement placement;
  // Host copies (CPU backend).
  std::vector<SeqId> seq_ids;
  std::vector<std::int64_t> seq_len;
  std::vector<std::int32_t> indptr, slot, block, valid_tokens;
  // Device arrays (CUDA backend).
  const SeqId* d_seq_ids = nullptr;
  const std::int64_t* d_seq_len = nullptr;
  const std::int32_t *d_indptr = nullptr, *d_slot = nullptr, *d_block = nullptr, *d_valid_tokens = nullptr;
  std::int64_t entry_capacity = 0;
  const void* pool = nullptr;
  std::int64_t pool_slots = 0;  // slots in the layer's pool
};

template <class T>
ViewData view_data(const LayerView<T>& v, const CacheLayout& layout, std::uint64_t ticket, const Placement& placement) {
  ViewData d;
  d.geometry() = v.geometry();
  d.ticket = ticket;
  d.placement = placement;
  d.pool = v.pool;
  d.pool_slots = layout.layer_slots(v.layer);  // layers differ in size under a budget profile
  const int pairs = v.num_pairs();
  if (placement.cuda) {
    d.d_seq_ids = v.seq_ids;
    d.d_seq_len = v.seq_len;
    d.d_indptr = v.indptr;
    d.d_slot = v.slot;
    d.d_block = v.block;
    d.d_valid_tokens = v.valid_tokens;
    d.entry_capacity = static_cast<std::int64_t>(pairs) * layout.max_budget_blocks;
    return d;
  }
  d.seq_ids.assign(v.seq_ids, v.seq_ids + v.batch_size);
  d.seq_len.assign(v.seq_len, v.seq_len + v.batch_size);
  d.indptr.assign(v.indptr, v.indptr + pairs + 1);
  const std::int32_t n = d.indptr.back();
  d.slot.assign(v.slot, v.slot + n);
  d.block.assign(v.block, v.block + n);
  d.valid_tokens.assign(v.valid_tokens, v.valid_tokens + n);
  return d;
}

class CacheBase {
 public:
  virtual ~CacheBase() = default;
  virtual DType dtype() const = 0;
  virtual const CacheLayout& layout() const = 0;
  virtual const Placement& placement() const = 0;
  virtual std::uint64_t id() const = 0;
  virtual void add_sequence(SeqId id) = 0;
  virtual void remove_sequence(SeqId id) = 0;
  virtual void truncate(SeqId id, std::int64_t length) = 0;
  virtual void fork(SeqId src, SeqId dst, std::optional<std::int64_t> length) = 0;
  virtual bool has_sequence(SeqId id) const = 0;
  virtual std::size_t num_sequences() const = 0;
  virtual std::int64_t sequence_length(SeqId id, int layer) const = 0;
  virtual void append(std::span<const SeqId> batch, int layer, std::span<const std::int32_t> rows, RowsView k,
                      RowsView v) = 0;
  virtual Ticket prefetch(std::span<const SeqId> batch, int layer, RowsView q, std::int64_t next_step_rows) = 0;
  virtual ViewData acquire(const Ticket& t) = 0;
  virtual void release(const Ticket& t) = 0;
  virtual void attend(const Ticket& t, const std::function<void(ViewData&&)>& f) = 0;
  virtual void observe(const Ticket& t, RowsView q) = 0;
  virtual void remainder(const Ticket& t, RowsView q, std::span<float> out, std::span<float> lse) = 0;
  virtual std::vector<std::vector<std::int32_t>> select_blocks(SeqId id, int layer, RowsView q) const = 0;
  virtual Statistics statistics() const = 0;
  virtual void reset_statistics() = 0;
  virtual void synchronize() = 0;
  virtual std::string layer_failure(int layer) const = 0;
  virtual void recover_layer(int layer) = 0;
  // The threads LayerView.attention runs on (the cache's CpuOptions::parallel_for; empty: the
  // calling thread).
  virtual ParallelFor parallel_for() const { return {}; }
};

// Backend's Cache<Backend, T> behind CacheBase; Options: its engine's options.
template <class Backend, KvElement T>
class CacheImpl final : public CacheBase {
 public:
  CacheImpl(const CacheConfig& config, const typename Cache<Backend, T>::Options& options, Placement placement)
      : cache_(config, options), placement_(placement) {}
  // A CPU cache whose work inside a call runs on `pool` (kept until after the cache is gone).
  CacheImpl(const CacheConfig& config, std::unique_ptr<ThreadPool> pool, typename Cache<Backend, T>::Options options,
            Placement placement)
      : pool_(std::move(pool)), cache_(config, with_pool(options, pool_.get())), placement_(placement) {}
  DType dtype() const override { return dtype_of_v<T>; }
  const CacheLayout& layout() const override { return cache_.layout(); }
  const Placement& placement() const override { return placement_; }
  std::uint64_t id() const override { return cache_.id(); }
  void add_sequence(SeqId id) override { cache_.add_sequence(id); }
  void remove_sequence(SeqId id) override { cache_.remove_sequence(id); }
  void truncate(SeqId id, std::int64_t length) override { cache_.truncate(id, length); }
  void fork(SeqId src, SeqId dst, std::optional<std::int64_t> length) override {
    if (length) {
      cache_.fork(src, dst, *length);
    } else {
      cache_.fork(src, dst);
    }
  }
  bool has_sequence(SeqId id) const override { return cache_.has_sequence(id); }
  std::size_t num_sequences() const override { return cache_.num_sequences(); }
  std::int64_t sequence_length(SeqId id, int layer) const override { return cache_.sequence_length(id, layer); }
  void append(std::span<const SeqId> batch, int layer, std::span<const std::int32_t> rows, RowsView k,
              RowsView v) override {
    cache_.append(batch, layer, rows, k, v);
  }
  Ticket prefetch(std::span<const SeqId> batch, int layer, RowsView q, std::int64_t next_step_rows) override {
    return cache_.prefetch(batch, layer, q, next_step_rows);
  }
  ViewData acquire(const Ticket& t) override {
    return view_data(cache_.acquire(t), cache_.layout(), t.id, placement_);
  }
  void release(const Ticket& t) override { cache_.release(t); }
  void attend(const Ticket& t, const std::function<void(ViewData&&)>& f) override {
    cache_.attend(t, [&](const LayerView<T>& view) { f(view_data(view, cache_.layout(), t.id, placement_)); });
  }
  void observe(const Ticket& t, RowsView q) override { cache_.observe(t, q); }
  void remainder(const Ticket& t, RowsView q, std::span<float> out, std::span<float> lse) override {
    cache_.remainder(t, q, out, lse);
  }
  std::vector<std::vector<std::int32_t>> select_blocks(SeqId id, int layer, RowsView q) const override {
    return cache_.select_blocks(id, layer, q);
  }
  Statistics statistics() const override { return cache_.statistics(); }
  void reset_statistics() override { cache_.reset_statistics(); }
  void synchronize() override { cache_.synchronize(); }
  std::string layer_failure(int layer) const override { return cache_.layer_failure(layer); }
  void recover_layer(int layer) override { cache_.recover_layer(layer); }
  ParallelFor parallel_for() const override { return pool_ ? pool_->parallel_for() : ParallelFor{}; }

 private:
  static typename Cache<Backend, T>::Options with_pool(typename Cache<Backend, T>::Options options, ThreadPool* pool) {
    if constexpr (requires { options.parallel_for; }) {
      if (pool != nullptr) options.parallel_for = pool->parallel_for();
    }
    return options;
  }

  std::unique_ptr<ThreadPool> pool_;  // declared before cache_: outlives it
  Cache<Backend, T> cache_;
  Placement placement_;
};

// The CPU backend's cache (copy_thread: CpuOptions::copy_thread; threads: its ThreadPool's, 1 for
// none).
std::unique_ptr<CacheBase> make_cpu_cache(const CacheConfig& config, DType dtype, bool copy_thread, int threads);
// The CUDA backend's cache on `device`, its compute stream `stream`; refused with the reason when
// the module has no CUDA backend or the machine no device.
std::unique_ptr<CacheBase> make_cuda_cache(const CacheConfig& config, DType dtype, int device, std::uintptr_t stream);
// Whether the module was built with the CUDA backend; the devices the runtime sees (0 without the
// backend, a driver or a GPU); the current device.
bool cuda_built() noexcept;
int cuda_device_count() noexcept;
int cuda_current_device();

}  // namespace oasiskv::python
