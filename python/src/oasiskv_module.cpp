// The Python module `oasiskv._oasiskv` (nanobind): the C++ Cache<cpu, T> with the same names, arrays
// taken through DLPack / the buffer protocol without copies, oasiskv::Error as oasiskv.Error.
//
// Rules this file keeps:
// - Every array argument is checked here before the C++ call (device, dtype, shape, C-contiguity),
//   and a bad one raises oasiskv.Error naming the argument and the value. Nothing is converted or
//   copied: an array that does not fit is refused.
// - Calls that can take long (append, prefetch, acquire/attend's wait, observe, select_blocks,
//   truncate, fork) release the GIL. One recursive mutex per cache serialises the C++ calls (the
//   C++ Cache is single-threaded); it is taken after the GIL is released, so a thread that waits for
//   it never holds the GIL. attend's callback runs with the GIL re-acquired, and may call the same
//   cache (observe, statistics) from inside: the mutex is recursive.
// - A LayerView keeps the Python Cache alive (the slot pool it points into is the cache's), its CSR
//   arrays are copies owned by the view (the cache reuses its own for the next acquire), and every
//   attribute access checks that its ticket is still acquired: after release it raises
//   oasiskv.Error. Arrays handed out before the release cannot be revoked; they stay valid memory
//   (the pool lives as long as the cache, which they keep alive), but their slots may be
//   overwritten by later copies.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "oasiskv/oasiskv.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using oasiskv::CacheConfig;
using oasiskv::CacheLayout;
using oasiskv::DType;
using oasiskv::fail;
using oasiskv::RowsView;
using oasiskv::SeqId;
using oasiskv::Statistics;
using oasiskv::Ticket;

// ---- views: what acquire hands to Python ------------------------------------------------------

// A copy of one LayerView's CSR arrays (small: one entry per resident block) plus the pool address.
struct ViewData {
  std::uint64_t ticket = 0;
  std::uint64_t serial = 0;  // the acquire that made it (PyCache::acquired_)
  int layer = 0, batch_size = 0, num_kv_heads = 0, head_dim = 0, block_tokens = 0;
  std::vector<SeqId> seq_ids;
  std::vector<std::int64_t> seq_len;
  std::vector<std::int32_t> indptr, slot, block, valid_tokens;
  const void* pool = nullptr;
  std::int64_t slot_stride = 0;
  std::int64_t pool_slots = 0;  // slots in the layer's pool
};

template <class T>
ViewData copy_view(const oasiskv::LayerView<T>& v, const CacheLayout& layout, std::uint64_t ticket) {
  ViewData d;
  d.ticket = ticket;
  d.layer = v.layer;
  d.batch_size = v.batch_size;
  d.num_kv_heads = v.num_kv_heads;
  d.head_dim = v.head_dim;
  d.block_tokens = v.block_tokens;
  d.seq_ids.assign(v.seq_ids, v.seq_ids + v.batch_size);
  d.seq_len.assign(v.seq_len, v.seq_len + v.batch_size);
  const int pairs = v.num_pairs();
  d.indptr.assign(v.indptr, v.indptr + pairs + 1);
  const std::int32_t n = d.indptr.back();
  d.slot.assign(v.slot, v.slot + n);
  d.block.assign(v.block, v.block + n);
  d.valid_tokens.assign(v.valid_tokens, v.valid_tokens + n);
  d.pool = v.pool;
  d.slot_stride = v.slot_stride;
  d.pool_slots = layout.layer_slots(v.layer);  // layers differ in size under a budget profile
  return d;
}

// ---- the cache, erased over its element type --------------------------------------------------

class CacheBase {
 public:
  virtual ~CacheBase() = default;
  virtual DType dtype() const = 0;
  virtual const CacheLayout& layout() const = 0;
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
};

template <class T>
class CacheImpl final : public CacheBase {
 public:
  explicit CacheImpl(const CacheConfig& config) : cache_(config) {}
  DType dtype() const override { return oasiskv::dtype_of_v<T>; }
  const CacheLayout& layout() const override { return cache_.layout(); }
  std::uint64_t id() const override { return cache_.id(); }
  void add_sequence(SeqId id) override { cache_.add_sequence(id); }
  void remove_sequence(SeqId id) override { cache_.remove_sequence(id); }
  void truncate(SeqId id, std::int64_t length) override { cache_.truncate(id, length); }
  void fork(SeqId src, SeqId dst, std::optional<std::int64_t> length) override {
    if (length) cache_.fork(src, dst, *length);
    else cache_.fork(src, dst);
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
    const auto view = cache_.acquire(t);
    return copy_view(view, cache_.layout(), t.id);
  }
  void release(const Ticket& t) override { cache_.release(t); }
  void attend(const Ticket& t, const std::function<void(ViewData&&)>& f) override {
    cache_.attend(t, [&](const oasiskv::LayerView<T>& view) { f(copy_view(view, cache_.layout(), t.id)); });
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

 private:
  oasiskv::Cache<oasiskv::cpu, T> cache_;
};

// ---- dtype names ----------------------------------------------------------------------------

DType parse_dtype(const std::string& name) {
  if (name == "float32" || name == "f32" || name == "fp32" || name == "float") return DType::f32;
  if (name == "float16" || name == "f16" || name == "fp16" || name == "half") return DType::f16;
  if (name == "bfloat16" || name == "bf16") return DType::bf16;
  fail("Cache: dtype '{}' is not one of 'float32', 'float16', 'bfloat16'", name);
}

const char* numpy_name(DType t) {
  switch (t) {
    case DType::f32: return "float32";
    case DType::f16: return "float16";
    case DType::bf16: return "bfloat16";
  }
  return "?";
}

std::string dlpack_name(nb::dlpack::dtype t) {
  using nb::dlpack::dtype_code;
  std::string base;
  switch (static_cast<dtype_code>(t.code)) {
    case dtype_code::Int: base = "int"; break;
    case dtype_code::UInt: base = "uint"; break;
    case dtype_code::Float: base = "float"; break;
    case dtype_code::Bfloat: base = "bfloat"; break;
    case dtype_code::Complex: base = "complex"; break;
    case dtype_code::Bool: return "bool";
    default: base = fmt::format("dlpack-code-{}-", t.code); break;
  }
  std::string name = base + std::to_string(t.bits);
  if (t.lanes != 1) name += fmt::format("x{}", t.lanes);
  return name;
}

// The DType of an array's element type, if it is one the cache takes. bf16 also as uint16 (numpy
// has no bfloat16: raw bits), only where the cache's dtype is bf16.
std::optional<DType> array_dtype(nb::dlpack::dtype t, DType cache_dtype) {
  using nb::dlpack::dtype_code;
  if (t.lanes != 1) return std::nullopt;
  const auto code = static_cast<dtype_code>(t.code);
  if (code == dtype_code::Float && t.bits == 32) return DType::f32;
  if (code == dtype_code::Float && t.bits == 16) return DType::f16;
  if (code == dtype_code::Bfloat && t.bits == 16) return DType::bf16;
  if (code == dtype_code::UInt && t.bits == 16 && cache_dtype == DType::bf16) return DType::bf16;
  return std::nullopt;
}

std::string shape_text(const std::vector<std::int64_t>& s) {
  std::string out = "(";
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + (s.size() == 1 ? ",)" : ")");
}

const char* device_name(int device_type) {
  switch (device_type) {
    case nb::device::cpu::value: return "cpu";
    case nb::device::cuda::value: return "cuda";
    case nb::device::cuda_host::value: return "cuda_host";
    case nb::device::cuda_managed::value: return "cuda_managed";
    case nb::device::rocm::value: return "rocm";
    case nb::device::metal::value: return "metal";
    default: return "another device";
  }
}

using Array = nb::ndarray<nb::ro>;

// Converts a Python object into a checked RowsView: an array on the CPU (cuda_host memory is host
// memory too), C-contiguous, dtype one of `allowed`, shape (rows, heads, head_dim) with rows as
// given (or any, if rows < 0). Keeps the array alive in `keep`.
RowsView rows_argument(nb::handle obj, const char* call, const char* name, std::int64_t rows, int heads, int head_dim,
                       DType cache_dtype, bool allow_float32, Array& keep) {
  if (!nb::try_cast(obj, keep, /*convert=*/false)) {
    fail("{}: {} is a {}, expected an array (numpy, or an object with __dlpack__)", call, name,
         nb::inst_name(obj).c_str());
  }
  const Array& a = keep;
  if (a.device_type() != nb::device::cpu::value && a.device_type() != nb::device::cuda_host::value) {
    fail("{}: {} is on {} (device id {}); this cache (CPU backend) takes host arrays", call, name,
         device_name(a.device_type()), a.device_id());
  }
  const auto dt = array_dtype(a.dtype(), cache_dtype);
  const bool ok = dt && (*dt == cache_dtype || (allow_float32 && *dt == DType::f32));
  if (!ok) {
    fail("{}: {} has dtype {}, expected {}{}", call, name, dlpack_name(a.dtype()), numpy_name(cache_dtype),
         allow_float32 && cache_dtype != DType::f32 ? " (the cache's dtype) or float32"
         : cache_dtype == DType::bf16              ? " (the cache's dtype; numpy: uint16 bit patterns)"
                                                   : " (the cache's dtype)");
  }
  std::vector<std::int64_t> shape(a.ndim());
  for (std::size_t i = 0; i < a.ndim(); ++i) shape[i] = static_cast<std::int64_t>(a.shape(i));
  const bool shape_ok = a.ndim() == 3 && (rows < 0 || shape[0] == rows) && shape[1] == heads && shape[2] == head_dim;
  if (!shape_ok) {
    fail("{}: {} has shape {}, expected ({}, {}, {}) ([rows][{}][head_dim])", call, name, shape_text(shape),
         rows < 0 ? std::string("rows") : std::to_string(rows), heads, head_dim,
         std::string_view(name) == "k" || std::string_view(name) == "v" ? "num_kv_heads" : "num_q_heads");
  }
  // C order, in elements; a dimension of extent 1 may have any stride.
  std::int64_t expected = 1;
  for (std::size_t i = a.ndim(); i-- > 0;) {
    if (shape[i] != 1 && a.stride(i) != expected) {
      std::vector<std::int64_t> strides(a.ndim());
      for (std::size_t j = 0; j < a.ndim(); ++j) strides[j] = a.stride(j);
      fail("{}: {} is not C-contiguous (shape {}, strides {} in elements); pass numpy.ascontiguousarray({})", call,
           name, shape_text(shape), shape_text(strides), name);
    }
    expected *= shape[i];
  }
  return RowsView{a.data(), *dt, shape[0]};
}

// ---- the Python-facing classes ----------------------------------------------------------------

class PyCache;

class PyLayerView {
 public:
  PyLayerView(ViewData data, nb::object cache_obj, PyCache* cache)
      : data_(std::move(data)), cache_obj_(std::move(cache_obj)), cache_(cache) {}
  const ViewData& checked(const char* what) const;
  bool valid() const;
  const ViewData& raw() const { return data_; }
  nb::handle cache_object() const { return cache_obj_; }

 private:
  ViewData data_;
  nb::object cache_obj_;  // keeps the cache (and the slot pool the views point into) alive
  PyCache* cache_;
};

class PyCache {
 public:
  PyCache(const CacheConfig& config, const std::string& dtype) {
    switch (parse_dtype(dtype)) {
      case DType::f32: impl_ = std::make_unique<CacheImpl<float>>(config); break;
      case DType::f16: impl_ = std::make_unique<CacheImpl<oasiskv::fp16_t>>(config); break;
      case DType::bf16: impl_ = std::make_unique<CacheImpl<oasiskv::bf16_t>>(config); break;
    }
    acquired_.assign(static_cast<std::size_t>(impl_->layout().num_layers()), 0);
  }

  CacheBase& impl() { return *impl_; }
  const CacheBase& impl() const { return *impl_; }

  // Runs f with the GIL released and the cache's mutex held.
  template <class F>
  auto locked(F&& f) {
    nb::gil_scoped_release release;
    std::lock_guard lock(mutex_);
    return f();
  }

  std::uint64_t mark_acquired(int layer) {
    const std::uint64_t s = ++serial_;
    acquired_[static_cast<std::size_t>(layer)] = s;
    return s;
  }
  void mark_released(int layer) { acquired_[static_cast<std::size_t>(layer)] = 0; }
  bool is_acquired(int layer, std::uint64_t serial) const {
    return layer >= 0 && static_cast<std::size_t>(layer) < acquired_.size() &&
           acquired_[static_cast<std::size_t>(layer)] == serial;
  }

 private:
  std::unique_ptr<CacheBase> impl_;
  std::recursive_mutex mutex_;
  std::vector<std::uint64_t> acquired_;  // per layer: the serial of the acquired view, 0 if none
  std::uint64_t serial_ = 0;
};

bool PyLayerView::valid() const { return cache_->is_acquired(data_.layer, data_.serial); }

const ViewData& PyLayerView::checked(const char* what) const {
  if (!valid()) {
    fail("LayerView.{}: the view of ticket {} (layer {}) was released; a view is valid from acquire until release",
         what, data_.ticket, data_.layer);
  }
  return data_;
}

template <class T>
nb::object numpy_1d(const std::vector<T>& v, nb::handle owner) {
  const std::size_t shape[1] = {v.size()};
  return nb::ndarray<nb::numpy, const T, nb::ndim<1>>(v.data(), 1, shape, owner).cast();
}

nb::dlpack::dtype element_dlpack(DType t) {
  switch (t) {
    case DType::f32: return nb::dtype<float>();
    case DType::f16: return nb::dlpack::dtype{static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float), 16, 1};
    case DType::bf16: return nb::dtype<std::uint16_t>();  // numpy has no bfloat16: raw bits
  }
  return nb::dtype<float>();
}

// A read-only numpy view of the layer's slot pool (or part of it), owned by the cache object.
nb::object pool_array(DType t, nb::handle cache_obj, const void* data, std::vector<std::size_t> shape,
                      std::vector<std::int64_t> strides) {
  return nb::ndarray<nb::numpy, nb::ro>(data, shape.size(), shape.data(), cache_obj, strides.data(), element_dlpack(t))
      .cast();
}

std::size_t element_size(DType t) { return oasiskv::dtype_size(t); }

Ticket checked_ticket(nb::handle obj, const char* call) {
  Ticket* t = nullptr;
  if (!nb::try_cast(obj, t, false) || t == nullptr) {
    fail("{}: expected an oasiskv.Ticket (from prefetch), got a {}", call, nb::inst_name(obj).c_str());
  }
  return *t;
}

std::string statistics_repr(const Statistics& s) {
  const auto t = s.total();
  return fmt::format(
      "Statistics(layers={}, plans={}, blocks_selected={}, blocks_fetched={}, bytes_fetched={}, admits_capped={}, "
      "acquires={}, acquire_wait_ms={:.3f}, recall={:.4f}, host_blocks_in_use={}/{}, host_bytes_in_use={})",
      s.layers.size(), t.plans, t.blocks_selected, t.blocks_fetched, t.bytes_fetched, t.admits_capped, t.acquires,
      static_cast<double>(t.acquire_wait_ns) / 1e6, t.recall(), s.host_blocks_in_use, s.host_blocks_total,
      s.host_bytes_in_use);
}

nb::object make_view(ViewData&& data, nb::handle cache_obj, PyCache& cache) {
  data.serial = cache.mark_acquired(data.layer);
  return nb::cast(PyLayerView(std::move(data), nb::borrow(cache_obj), &cache));
}

}  // namespace

NB_MODULE(_oasiskv, m) {
  m.doc() = "OasisKV: a tiered sparse KV cache for LLM decode (CPU backend)";
  m.attr("__version__") = std::string(oasiskv::version_string());
  m.attr("version_major") = oasiskv::version_major();
  m.attr("version_minor") = oasiskv::version_minor();
  m.attr("version_patch") = oasiskv::version_patch();
  nb::exception<oasiskv::Error>(m, "Error");

  // ---- CacheConfig ----
  auto cfg = nb::class_<CacheConfig>(m, "CacheConfig", "What the engine chooses; every field is a keyword.");
  cfg.def(
      "__init__",
      [](CacheConfig* self, int num_layers, int num_q_heads, int num_kv_heads, int head_dim, int block_tokens,
         int budget_tokens, int sink_tokens, int recent_tokens, double fetch_ratio, int max_sequences,
         std::int64_t max_tokens_per_sequence, std::int64_t host_pool_blocks, const std::string& reduction,
         float softmax_scale, const std::string& remainder, float remainder_sigma, const std::string& scorer,
         float spread_alpha, float mass_sigma) {
        CacheConfig c;
        c.shape = oasiskv::ModelShape{num_layers, num_q_heads, num_kv_heads, head_dim};
        c.block_tokens = block_tokens;
        c.budget_tokens = budget_tokens;
        c.sink_tokens = sink_tokens;
        c.recent_tokens = recent_tokens;
        c.fetch_ratio = fetch_ratio;
        c.max_sequences = max_sequences;
        c.max_tokens_per_sequence = max_tokens_per_sequence;
        c.host_pool_blocks = host_pool_blocks;
        c.reduction = oasiskv::parse_reduction(reduction);
        c.softmax_scale = softmax_scale;
        c.remainder = oasiskv::parse_remainder(remainder);
        c.remainder_sigma = remainder_sigma;
        c.scorer = oasiskv::parse_block_score(scorer);
        c.spread_alpha = spread_alpha;
        c.mass_sigma = mass_sigma;
        new (self) CacheConfig(c);
      },
      nb::kw_only(), "num_layers"_a = 0, "num_q_heads"_a = 0, "num_kv_heads"_a = 0, "head_dim"_a = 0,
      "block_tokens"_a = CacheConfig{}.block_tokens, "budget_tokens"_a = CacheConfig{}.budget_tokens,
      "sink_tokens"_a = CacheConfig{}.sink_tokens, "recent_tokens"_a = CacheConfig{}.recent_tokens,
      "fetch_ratio"_a = CacheConfig{}.fetch_ratio, "max_sequences"_a = CacheConfig{}.max_sequences,
      "max_tokens_per_sequence"_a = CacheConfig{}.max_tokens_per_sequence,
      "host_pool_blocks"_a = CacheConfig{}.host_pool_blocks, "reduction"_a = "sum",
      "softmax_scale"_a = CacheConfig{}.softmax_scale, "remainder"_a = "none",
      "remainder_sigma"_a = CacheConfig{}.remainder_sigma, "scorer"_a = "quest",
      "spread_alpha"_a = CacheConfig{}.spread_alpha, "mass_sigma"_a = CacheConfig{}.mass_sigma);
  cfg.def_prop_rw("num_layers", [](const CacheConfig& c) { return c.shape.num_layers; },
                  [](CacheConfig& c, int v) { c.shape.num_layers = v; });
  cfg.def_prop_rw("num_q_heads", [](const CacheConfig& c) { return c.shape.num_q_heads; },
                  [](CacheConfig& c, int v) { c.shape.num_q_heads = v; });
  cfg.def_prop_rw("num_kv_heads", [](const CacheConfig& c) { return c.shape.num_kv_heads; },
                  [](CacheConfig& c, int v) { c.shape.num_kv_heads = v; });
  cfg.def_prop_rw("head_dim", [](const CacheConfig& c) { return c.shape.head_dim; },
                  [](CacheConfig& c, int v) { c.shape.head_dim = v; });
  cfg.def_rw("block_tokens", &CacheConfig::block_tokens)
      .def_rw("budget_tokens", &CacheConfig::budget_tokens)
      .def_rw("sink_tokens", &CacheConfig::sink_tokens)
      .def_rw("recent_tokens", &CacheConfig::recent_tokens)
      .def_rw("fetch_ratio", &CacheConfig::fetch_ratio)
      .def_rw("max_sequences", &CacheConfig::max_sequences)
      .def_rw("max_tokens_per_sequence", &CacheConfig::max_tokens_per_sequence)
      .def_rw("host_pool_blocks", &CacheConfig::host_pool_blocks)
      .def_rw("softmax_scale", &CacheConfig::softmax_scale)
      .def_rw("remainder_sigma", &CacheConfig::remainder_sigma)
      .def_rw("remainder_cluster_rows", &CacheConfig::remainder_cluster_rows)
      .def_rw("remainder_bits", &CacheConfig::remainder_bits)
      .def_rw("spread_alpha", &CacheConfig::spread_alpha)
      .def_rw("mass_sigma", &CacheConfig::mass_sigma);
  cfg.def_prop_rw("scorer", [](const CacheConfig& c) { return std::string(oasiskv::block_score_name(c.scorer)); },
                  [](CacheConfig& c, const std::string& s) { c.scorer = oasiskv::parse_block_score(s); });
  cfg.def_prop_rw("remainder", [](const CacheConfig& c) { return std::string(oasiskv::remainder_name(c.remainder)); },
                  [](CacheConfig& c, const std::string& r) { c.remainder = oasiskv::parse_remainder(r); });
  cfg.def_prop_rw("reduction", [](const CacheConfig& c) { return std::string(oasiskv::reduction_name(c.reduction)); },
                  [](CacheConfig& c, const std::string& r) { c.reduction = oasiskv::parse_reduction(r); });
  cfg.def("validate", [](const CacheConfig& c) { (void)CacheLayout::from(c); },
          "Raises oasiskv.Error naming the first bad value (the Cache constructor does the same).");
  cfg.def("__repr__", [](const CacheConfig& c) {
    return fmt::format(
        "CacheConfig(num_layers={}, num_q_heads={}, num_kv_heads={}, head_dim={}, block_tokens={}, budget_tokens={}, "
        "sink_tokens={}, recent_tokens={}, fetch_ratio={}, max_sequences={}, max_tokens_per_sequence={}, "
        "host_pool_blocks={}, reduction='{}', softmax_scale={}, remainder='{}', remainder_sigma={}, scorer='{}', "
        "spread_alpha={}, mass_sigma={})",
        c.shape.num_layers, c.shape.num_q_heads, c.shape.num_kv_heads, c.shape.head_dim, c.block_tokens,
        c.budget_tokens, c.sink_tokens, c.recent_tokens, c.fetch_ratio, c.max_sequences, c.max_tokens_per_sequence,
        c.host_pool_blocks, oasiskv::reduction_name(c.reduction), c.softmax_scale,
        oasiskv::remainder_name(c.remainder), c.remainder_sigma, oasiskv::block_score_name(c.scorer), c.spread_alpha,
        c.mass_sigma);
  });

  // ---- Ticket ----
  nb::class_<Ticket>(m, "Ticket", "The handle of one prefetch: acquire / attend / release / observe take it.")
      .def_ro("id", &Ticket::id)
      .def_ro("cache", &Ticket::cache)
      .def_ro("layer", &Ticket::layer)
      .def_ro("sequences", &Ticket::sequences)
      .def_ro("generations", &Ticket::generations)
      .def_ro("plans", &Ticket::plans)
      .def("__repr__", [](const Ticket& t) {
        return fmt::format("Ticket(id={}, cache={}, layer={}, sequences=[{}])", t.id, t.cache, t.layer,
                           fmt::join(t.sequences, ", "));
      });

  // ---- Statistics ----
  nb::class_<oasiskv::LayerStatistics>(m, "LayerStatistics")
      .def_ro("plans", &oasiskv::LayerStatistics::plans)
      .def_ro("blocks_selected", &oasiskv::LayerStatistics::blocks_selected)
      .def_ro("blocks_fetched", &oasiskv::LayerStatistics::blocks_fetched)
      .def_ro("bytes_fetched", &oasiskv::LayerStatistics::bytes_fetched)
      .def_ro("remote_blocks_fetched", &oasiskv::LayerStatistics::remote_blocks_fetched)
      .def_ro("remote_bytes_fetched", &oasiskv::LayerStatistics::remote_bytes_fetched)
      .def_ro("admits_capped", &oasiskv::LayerStatistics::admits_capped)
      .def_ro("acquires", &oasiskv::LayerStatistics::acquires)
      .def_ro("acquire_wait_ns", &oasiskv::LayerStatistics::acquire_wait_ns)
      .def_ro("observed_true_blocks", &oasiskv::LayerStatistics::observed_true_blocks)
      .def_ro("observed_hits", &oasiskv::LayerStatistics::observed_hits)
      .def("recall", &oasiskv::LayerStatistics::recall)
      .def("__repr__", [](const oasiskv::LayerStatistics& l) {
        return fmt::format("LayerStatistics(plans={}, blocks_selected={}, blocks_fetched={}, bytes_fetched={}, "
                           "admits_capped={}, acquires={}, recall={:.4f})",
                           l.plans, l.blocks_selected, l.blocks_fetched, l.bytes_fetched, l.admits_capped, l.acquires,
                           l.recall());
      });
  nb::class_<Statistics>(m, "Statistics")
      .def_ro("layers", &Statistics::layers)
      .def_ro("host_blocks_total", &Statistics::host_blocks_total)
      .def_ro("host_blocks_in_use", &Statistics::host_blocks_in_use)
      .def_ro("host_bytes_in_use", &Statistics::host_bytes_in_use)
      .def("total", &Statistics::total)
      .def("__repr__", &statistics_repr);

  // ---- LayerView ----
  nb::class_<PyLayerView>(m, "LayerView",
                          "The resident working set of one layer (CSR over (sequence, kv head) pairs). Valid from "
                          "acquire until release; every attribute raises oasiskv.Error after that.")
      .def_prop_ro("valid", &PyLayerView::valid, "Whether the view's ticket is still acquired.")
      .def_prop_ro("layer", [](const PyLayerView& v) { return v.checked("layer").layer; })
      .def_prop_ro("batch_size", [](const PyLayerView& v) { return v.checked("batch_size").batch_size; })
      .def_prop_ro("num_kv_heads", [](const PyLayerView& v) { return v.checked("num_kv_heads").num_kv_heads; })
      .def_prop_ro("head_dim", [](const PyLayerView& v) { return v.checked("head_dim").head_dim; })
      .def_prop_ro("block_tokens", [](const PyLayerView& v) { return v.checked("block_tokens").block_tokens; })
      .def_prop_ro("num_pairs",
                   [](const PyLayerView& v) { return v.checked("num_pairs").batch_size * v.raw().num_kv_heads; })
      .def_prop_ro("ticket_id", [](const PyLayerView& v) { return v.raw().ticket; })
      .def_prop_ro("seq_ids", [](nb::handle_t<PyLayerView> h) {
        const auto& v = *nb::inst_ptr<PyLayerView>(h);
        return numpy_1d(v.checked("seq_ids").seq_ids, h);
      })
      .def_prop_ro("seq_len", [](nb::handle_t<PyLayerView> h) {
        const auto& v = *nb::inst_ptr<PyLayerView>(h);
        return numpy_1d(v.checked("seq_len").seq_len, h);
      })
      .def_prop_ro("indptr", [](nb::handle_t<PyLayerView> h) {
        const auto& v = *nb::inst_ptr<PyLayerView>(h);
        return numpy_1d(v.checked("indptr").indptr, h);
      })
      .def_prop_ro("slot", [](nb::handle_t<PyLayerView> h) {
        const auto& v = *nb::inst_ptr<PyLayerView>(h);
        return numpy_1d(v.checked("slot").slot, h);
      })
      .def_prop_ro("block", [](nb::handle_t<PyLayerView> h) {
        const auto& v = *nb::inst_ptr<PyLayerView>(h);
        return numpy_1d(v.checked("block").block, h);
      })
      .def_prop_ro("valid_tokens", [](nb::handle_t<PyLayerView> h) {
        const auto& v = *nb::inst_ptr<PyLayerView>(h);
        return numpy_1d(v.checked("valid_tokens").valid_tokens, h);
      })
      .def_prop_ro(
          "pool",
          [](const PyLayerView& v) {
            const ViewData& d = v.checked("pool");
            const PyCache& c = nb::cast<const PyCache&>(v.cache_object());
            const DType t = c.impl().dtype();
            return pool_array(t, v.cache_object(), d.pool,
                              {static_cast<std::size_t>(d.pool_slots), 2, static_cast<std::size_t>(d.block_tokens),
                               static_cast<std::size_t>(d.head_dim)},
                              {d.slot_stride, static_cast<std::int64_t>(d.block_tokens) * d.head_dim, d.head_dim, 1});
          },
          "The layer's slot pool, zero-copy and read-only: [slots][K|V][block_tokens][head_dim] "
          "(bfloat16 caches: uint16 bit patterns).")
      .def(
          "keys",
          [](const PyLayerView& v, std::int64_t entry) {
            const ViewData& d = v.checked("keys");
            if (entry < 0 || entry >= static_cast<std::int64_t>(d.slot.size()))
              fail("LayerView.keys: entry {} is outside [0, {})", entry, d.slot.size());
            const PyCache& c = nb::cast<const PyCache&>(v.cache_object());
            const DType t = c.impl().dtype();
            const auto* base = static_cast<const char*>(d.pool) +
                               static_cast<std::int64_t>(d.slot[entry]) * d.slot_stride * element_size(t);
            return pool_array(t, v.cache_object(), base,
                              {static_cast<std::size_t>(d.valid_tokens[entry]), static_cast<std::size_t>(d.head_dim)},
                              {d.head_dim, 1});
          },
          "entry"_a, "The valid key rows of entry e: [valid_tokens[e]][head_dim], a zero-copy view.")
      .def(
          "values",
          [](const PyLayerView& v, std::int64_t entry) {
            const ViewData& d = v.checked("values");
            if (entry < 0 || entry >= static_cast<std::int64_t>(d.slot.size()))
              fail("LayerView.values: entry {} is outside [0, {})", entry, d.slot.size());
            const PyCache& c = nb::cast<const PyCache&>(v.cache_object());
            const DType t = c.impl().dtype();
            const auto* base =
                static_cast<const char*>(d.pool) +
                (static_cast<std::int64_t>(d.slot[entry]) * d.slot_stride +
                 static_cast<std::int64_t>(d.block_tokens) * d.head_dim) *
                    static_cast<std::int64_t>(element_size(t));
            return pool_array(t, v.cache_object(), base,
                              {static_cast<std::size_t>(d.valid_tokens[entry]), static_cast<std::size_t>(d.head_dim)},
                              {d.head_dim, 1});
          },
          "entry"_a, "The valid value rows of entry e: [valid_tokens[e]][head_dim], a zero-copy view.")
      .def("__repr__", [](const PyLayerView& v) {
        const ViewData& d = v.raw();
        return fmt::format("LayerView(ticket={}, layer={}, batch_size={}, entries={}, {})", d.ticket, d.layer,
                           d.batch_size, d.slot.size(), v.valid() ? "acquired" : "released");
      });

  // ---- Cache ----
  nb::class_<PyCache>(m, "Cache",
                      "Cache<cpu, T>: sequences, append, prefetch, acquire / attend / release, statistics.",
                      nb::is_weak_referenceable())
      .def(nb::init<const CacheConfig&, const std::string&>(), "config"_a, "dtype"_a = "float32")
      .def_prop_ro("dtype", [](const PyCache& c) { return std::string(numpy_name(c.impl().dtype())); })
      .def_prop_ro("id", [](const PyCache& c) { return c.impl().id(); })
      .def_prop_ro("config", [](const PyCache& c) { return c.impl().layout().config; })
      .def_prop_ro("num_layers", [](const PyCache& c) { return c.impl().layout().num_layers(); })
      .def_prop_ro("budget_blocks", [](const PyCache& c) { return c.impl().layout().budget_blocks; })
      .def_prop_ro("selectable_blocks", [](const PyCache& c) { return c.impl().layout().selectable_blocks; })
      .def_prop_ro("slots_per_layer", [](const PyCache& c) { return c.impl().layout().slots_per_layer; })
      .def_prop_ro("num_sequences", [](PyCache& c) { return c.locked([&] { return c.impl().num_sequences(); }); })
      .def("add_sequence", [](PyCache& c, SeqId id) { c.locked([&] { c.impl().add_sequence(id); }); }, "id"_a)
      .def("remove_sequence", [](PyCache& c, SeqId id) { c.locked([&] { c.impl().remove_sequence(id); }); }, "id"_a)
      .def("has_sequence", [](PyCache& c, SeqId id) { return c.locked([&] { return c.impl().has_sequence(id); }); },
           "id"_a)
      .def("sequence_length",
           [](PyCache& c, SeqId id, int layer) { return c.locked([&] { return c.impl().sequence_length(id, layer); }); },
           "id"_a, "layer"_a = 0)
      .def("truncate",
           [](PyCache& c, SeqId id, std::int64_t length) { c.locked([&] { c.impl().truncate(id, length); }); }, "id"_a,
           "length"_a)
      .def("fork",
           [](PyCache& c, SeqId src, SeqId dst, std::optional<std::int64_t> length) {
             c.locked([&] { c.impl().fork(src, dst, length); });
           },
           "src"_a, "dst"_a, "length"_a = nb::none())
      .def(
          "append",
          [](PyCache& c, const std::vector<SeqId>& batch, int layer, nb::handle k, nb::handle v,
             std::optional<std::vector<std::int32_t>> rows_per_seq) {
            const CacheLayout& L = c.impl().layout();
            std::vector<std::int32_t> rows = rows_per_seq ? *rows_per_seq : std::vector<std::int32_t>(batch.size(), 1);
            if (rows.size() != batch.size())
              fail("append: rows_per_seq has {} entries, the batch {} sequences", rows.size(), batch.size());
            std::int64_t total = 0;
            for (std::size_t i = 0; i < rows.size(); ++i) {
              if (rows[i] < 0) fail("append: rows_per_seq[{}] = {} is negative", i, rows[i]);
              total += rows[i];
            }
            Array keep_k, keep_v;
            const DType t = c.impl().dtype();
            const RowsView kr = rows_argument(k, "append", "k", total, L.num_kv_heads(), L.head_dim(), t, false, keep_k);
            const RowsView vr = rows_argument(v, "append", "v", total, L.num_kv_heads(), L.head_dim(), t, false, keep_v);
            c.locked([&] { c.impl().append(batch, layer, rows, kr, vr); });
          },
          "batch"_a, "layer"_a, "k"_a, "v"_a, "rows_per_seq"_a = nb::none(),
          "Appends rows_per_seq[i] rows (default 1) to batch[i] at `layer`; k, v: [rows][num_kv_heads][head_dim] of "
          "the cache's dtype, C-contiguous, rows in batch order.")
      .def(
          "prefetch",
          [](PyCache& c, const std::vector<SeqId>& batch, int layer, nb::handle q, std::int64_t next_step_rows) {
            const CacheLayout& L = c.impl().layout();
            Array keep;
            const RowsView qr =
                rows_argument(q, "prefetch", "q_lookahead", -1, L.num_q_heads(), L.head_dim(), c.impl().dtype(), true, keep);
            return c.locked([&] { return c.impl().prefetch(batch, layer, qr, next_step_rows); });
          },
          "batch"_a, "layer"_a, "q_lookahead"_a, "next_step_rows"_a = 1,
          "Plans the next step's resident set at `layer` from the lookahead queries [batch * R][num_q_heads][head_dim] "
          "(the cache's dtype or float32); returns its Ticket.")
      .def(
          "acquire",
          [](nb::handle_t<PyCache> self, nb::handle ticket) {
            PyCache& c = *nb::inst_ptr<PyCache>(self);
            const Ticket t = checked_ticket(ticket, "acquire");
            ViewData d = c.locked([&] { return c.impl().acquire(t); });
            return make_view(std::move(d), self, c);
          },
          "ticket"_a, "Waits for the ticket's copies (GIL released) and returns its LayerView.")
      .def(
          "release",
          [](PyCache& c, nb::handle ticket) {
            const Ticket t = checked_ticket(ticket, "release");
            c.locked([&] { c.impl().release(t); });
            c.mark_released(t.layer);
          },
          "ticket"_a)
      .def(
          "attend",
          [](nb::handle_t<PyCache> self, nb::handle ticket, nb::callable fn) {
            PyCache& c = *nb::inst_ptr<PyCache>(self);
            const Ticket t = checked_ticket(ticket, "attend");
            nb::object result;
            bool entered = false;  // acquired: the view must be marked released whatever happens
            try {
              c.locked([&] {
                c.impl().attend(t, [&](ViewData&& d) {
                  entered = true;
                  nb::gil_scoped_acquire acquire;
                  nb::object view = make_view(std::move(d), self, c);
                  result = fn(view);
                });
              });
            } catch (...) {
              if (entered) c.mark_released(t.layer);
              throw;
            }
            c.mark_released(t.layer);
            return result;
          },
          "ticket"_a, "fn"_a,
          "acquire, fn(view), release (also when fn raises); returns fn's result. The wait runs without the GIL.")
      .def(
          "observe",
          [](PyCache& c, nb::handle ticket, nb::handle q) {
            const Ticket t = checked_ticket(ticket, "observe");
            const CacheLayout& L = c.impl().layout();
            Array keep;
            const RowsView qr =
                rows_argument(q, "observe", "q_true", -1, L.num_q_heads(), L.head_dim(), c.impl().dtype(), true, keep);
            c.locked([&] { c.impl().observe(t, qr); });
          },
          "ticket"_a, "q_true"_a)
      .def(
          "remainder",
          [](PyCache& c, nb::handle ticket, nb::handle q) {
            const Ticket t = checked_ticket(ticket, "remainder");
            const CacheLayout& L = c.impl().layout();
            Array keep;
            const RowsView qr =
                rows_argument(q, "remainder", "q", -1, L.num_q_heads(), L.head_dim(), c.impl().dtype(), true, keep);
            const auto rows = static_cast<std::size_t>(qr.rows);
            const auto heads = static_cast<std::size_t>(L.num_q_heads()), d = static_cast<std::size_t>(L.head_dim());
            auto* out = new std::vector<float>(rows * heads * d);
            auto* lse = new std::vector<float>(rows * heads);
            nb::capsule own_out(out, [](void* p) noexcept { delete static_cast<std::vector<float>*>(p); });
            nb::capsule own_lse(lse, [](void* p) noexcept { delete static_cast<std::vector<float>*>(p); });
            c.locked([&] { c.impl().remainder(t, qr, *out, *lse); });
            const std::size_t out_shape[3] = {rows, heads, d}, lse_shape[2] = {rows, heads};
            return nb::make_tuple(nb::ndarray<nb::numpy, float, nb::ndim<3>>(out->data(), 3, out_shape, own_out),
                                  nb::ndarray<nb::numpy, float, nb::ndim<2>>(lse->data(), 2, lse_shape, own_lse));
          },
          "ticket"_a, "q"_a,
          "(out, lse): the estimate of the attention over the blocks the acquired view leaves out, per row and "
          "query head (CacheConfig.remainder must not be 'none'); merge it with the view's attention state.")
      .def(
          "select_blocks",
          [](PyCache& c, SeqId id, int layer, nb::handle q) {
            const CacheLayout& L = c.impl().layout();
            Array keep;
            const RowsView qr =
                rows_argument(q, "select_blocks", "q", -1, L.num_q_heads(), L.head_dim(), c.impl().dtype(), true, keep);
            return c.locked([&] { return c.impl().select_blocks(id, layer, qr); });
          },
          "id"_a, "layer"_a, "q"_a,
          "The blocks (best first) the selector would pick for id's next step at `layer`, per kv head.")
      .def("statistics", [](PyCache& c) { return c.locked([&] { return c.impl().statistics(); }); })
      .def("reset_statistics", [](PyCache& c) { c.locked([&] { c.impl().reset_statistics(); }); })
      .def("synchronize", [](PyCache& c) { c.locked([&] { c.impl().synchronize(); }); })
      .def("layer_failure", [](PyCache& c, int layer) { return c.locked([&] { return c.impl().layer_failure(layer); }); },
           "layer"_a)
      .def("recover_layer", [](PyCache& c, int layer) { c.locked([&] { c.impl().recover_layer(layer); }); }, "layer"_a)
      .def("__repr__", [](const PyCache& c) {
        const auto& L = c.impl().layout();
        return fmt::format("Cache(id={}, dtype='{}', layers={}, q_heads={}, kv_heads={}, head_dim={}, budget_tokens={})",
                           c.impl().id(), numpy_name(c.impl().dtype()), L.num_layers(), L.num_q_heads(),
                           L.num_kv_heads(), L.head_dim(), L.config.budget_tokens);
      });
}
