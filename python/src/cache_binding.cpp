// oasiskv.Cache, oasiskv.LayerView, oasiskv.Ticket and the statistics: the C++ Cache<cpu, T> and
// Cache<cuda, T> (where the module is built with CUDA) with the same names.
//
// Rules this file keeps:
// - Every array argument is checked before the C++ call (arrays.hpp: device, dtype, shape,
//   C-contiguity), and a bad one raises oasiskv.Error naming the argument and the value. Nothing
//   is converted or copied: an array that does not fit is refused.
// - Every method and property goes through bound.hpp's `method`: an object whose __init__ never
//   ran raises oasiskv.Error instead of being read.
// - Calls that can take long (append, prefetch, acquire/attend's wait, observe, select_blocks,
//   truncate, fork) release the GIL. One recursive mutex per cache serialises the C++ calls (the
//   C++ Cache is single-threaded); it is taken after the GIL is released, so a thread that waits for
//   it never holds the GIL. attend's callback runs with the GIL re-acquired, and may call the same
//   cache (observe, statistics) from inside: the mutex is recursive.
// - A LayerView keeps the Python Cache alive (the slot pool it points into is the cache's), and
//   every attribute access checks that its ticket is still acquired: after release it raises
//   oasiskv.Error. On the CPU its CSR arrays are copies owned by the view (the cache reuses its own
//   for the next acquire); on CUDA they are the cache's device arrays (DLPack, zero copy), valid
//   until release. Arrays handed out before the release cannot be revoked; they stay valid memory
//   (the pool lives as long as the cache, which they keep alive), but their contents may be
//   overwritten by later calls.
// - A CUDA cache works on one compute stream, fixed when it is made: the stream given, else the
//   caller's current torch stream (torch.cuda.current_stream), else the legacy default stream.
//   Inputs are taken through __dlpack__(stream=that stream), so a producer orders its writes
//   before the cache reads; the cache's reads are ordered in that stream, so a buffer may be
//   reused by work enqueued on it after the call.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "arrays.hpp"
#include "bindings.hpp"
#include "bound.hpp"
#include "caches.hpp"
#include "oasiskv/cpu/attention.hpp"
#include "oasiskv/oasiskv.hpp"

namespace oasiskv::python {
namespace {

using namespace nb::literals;

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
  const PyCache& cache() const { return *cache_; }
  PyCache& cache() { return *cache_; }

 private:
  ViewData data_;
  nb::object cache_obj_;  // keeps the cache (and the slot pool the views point into) alive
  PyCache* cache_;
};

class PyCache {
 public:
  explicit PyCache(std::unique_ptr<CacheBase> impl) : impl_(std::move(impl)) {
    acquired_.assign(static_cast<std::size_t>(impl_->layout().num_layers()), 0);
  }

  CacheBase& impl() { return *impl_; }
  const CacheBase& impl() const { return *impl_; }
  const CacheLayout& layout() const { return impl_->layout(); }

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

  // The spec of a rows argument of this cache: keys / values ([rows][num_kv_heads][head_dim] of
  // the cache's dtype) or queries ([rows][num_q_heads][head_dim], the cache's dtype or float32).
  RowsSpec kv_rows(const char* call, const char* name, std::int64_t rows) const {
    return RowsSpec{call,          name, rows, layout().num_kv_heads(), "num_kv_heads", layout().head_dim(),
                    impl_->dtype(), false, impl_->placement()};
  }
  RowsSpec query_rows(const char* call, const char* name) const {
    return RowsSpec{call,          name, -1,  layout().num_q_heads(), "num_q_heads", layout().head_dim(),
                    impl_->dtype(), true, impl_->placement()};
  }
  bool on_device() const { return impl_->placement().cuda; }

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

// A one-dimensional device array of the view (DLPack: torch.from_dlpack takes it without a copy),
// owned by the view object.
template <class T>
nb::object device_1d(const T* data, std::int64_t n, const Placement& p, nb::handle owner) {
  const std::size_t shape[1] = {static_cast<std::size_t>(n)};
  return nb::ndarray<nb::ro>(data, 1, shape, owner, nullptr, nb::dtype<T>(), nb::device::cuda::value, p.device).cast();
}

// The layer's slot pool (or part of it), read-only and zero-copy, owned by the cache object: numpy
// on the host (bfloat16 as uint16 bit patterns), a DLPack device array on CUDA.
nb::object pool_array(DType t, const Placement& p, nb::handle cache_obj, const void* data, std::vector<std::size_t> shape,
                      std::vector<std::int64_t> strides) {
  if (p.cuda) {
    const nb::dlpack::dtype dt =
        t == DType::bf16 ? nb::dlpack::dtype{static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1}
                         : element_dlpack(t);
    return nb::ndarray<nb::ro>(data, shape.size(), shape.data(), cache_obj, strides.data(), dt, nb::device::cuda::value,
                               p.device)
        .cast();
  }
  return nb::ndarray<nb::numpy, nb::ro>(data, shape.size(), shape.data(), cache_obj, strides.data(), element_dlpack(t))
      .cast();
}

Ticket checked_ticket(nb::handle obj, const char* call) {
  if (!nb::isinstance<Ticket>(obj)) {
    fail("{}: expected an oasiskv.Ticket (from prefetch), got a {}", call, nb::inst_name(obj).c_str());
  }
  if (!nb::inst_ready(obj)) fail("{}: this Ticket is not initialised: it did not come from prefetch", call);
  return *nb::inst_ptr<Ticket>(obj);
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

// New numpy arrays for an attention state, out [rows][heads][dim] and lse [rows][heads] float32,
// as the tuple (out, lse) and spans of them to write.
struct NewState {
  nb::tuple arrays;
  std::span<float> out, lse;
};
NewState new_state_arrays(std::int64_t rows, int heads, int dim) {
  const auto R = static_cast<std::size_t>(rows), H = static_cast<std::size_t>(heads), D = static_cast<std::size_t>(dim);
  auto* o = new std::vector<float>(R * H * D);
  nb::capsule own_out(o, [](void* p) noexcept { delete static_cast<std::vector<float>*>(p); });
  auto* l = new std::vector<float>(R * H);
  nb::capsule own_lse(l, [](void* p) noexcept { delete static_cast<std::vector<float>*>(p); });
  const std::size_t out_shape[3] = {R, H, D}, lse_shape[2] = {R, H};
  return NewState{nb::make_tuple(nb::ndarray<nb::numpy, float, nb::ndim<3>>(o->data(), 3, out_shape, own_out),
                                 nb::ndarray<nb::numpy, float, nb::ndim<2>>(l->data(), 2, lse_shape, own_lse)),
                  *o, *l};
}

// The LayerView a host ViewData describes, its pool's elements typed.
template <class T>
LayerView<T> host_view(const ViewData& d) {
  LayerView<T> view;
  view.layer = d.layer;
  view.batch_size = d.batch_size;
  view.num_kv_heads = d.num_kv_heads;
  view.head_dim = d.head_dim;
  view.block_tokens = d.block_tokens;
  view.seq_ids = d.seq_ids.data();
  view.seq_len = d.seq_len.data();
  view.indptr = d.indptr.data();
  view.slot = d.slot.data();
  view.block = d.block.data();
  view.valid_tokens = d.valid_tokens.data();
  view.pool = static_cast<const T*>(d.pool);
  view.slot_stride = d.slot_stride;
  return view;
}

// LayerView.attention: checked arguments, then the library's oasiskv::cpu_attend with the GIL
// released and the cache's mutex held (a release from another thread waits for it), on the cache's
// threads (Cache(threads=N); the calling thread alone by default).
nb::object view_attention(PyLayerView& v, nb::handle q, float scale, nb::handle out, nb::handle lse) {
  const ViewData& d = v.checked("attention");
  PyCache& c = v.cache();
  if (d.placement.cuda) {
    fail("LayerView.attention: the view of a CUDA cache is attended on the device by the engine's own kernel; this "
         "one runs on the CPU");
  }
  if (!std::isfinite(scale)) fail("LayerView.attention: scale {} is not finite", scale);
  Array keep;
  const RowsView qr = rows_argument(q, c.query_rows("LayerView.attention", "q"), keep);
  if (qr.dtype != DType::f32) fail("LayerView.attention: q has dtype {}, expected float32", numpy_name(qr.dtype));
  if (d.batch_size <= 0 || qr.rows == 0 || qr.rows % d.batch_size != 0) {
    fail("LayerView.attention: q has {} rows, expected a positive multiple of the view's batch_size {}", qr.rows,
         d.batch_size);
  }
  const int heads = c.layout().num_q_heads(), dim = d.head_dim;
  if (out.is_none() != lse.is_none()) fail("LayerView.attention: pass both out and lse, or neither");
  std::span<float> o, l;
  OutArray keep_out, keep_lse;
  nb::object result;
  if (!out.is_none()) {
    o = output_argument(out, "LayerView.attention", "out", qr.rows, heads, dim, d.placement, keep_out);
    l = output_argument(lse, "LayerView.attention", "lse", qr.rows, heads, 0, d.placement, keep_lse);
    result = nb::make_tuple(out, lse);
  } else {
    NewState state = new_state_arrays(qr.rows, heads, dim);
    o = state.out;
    l = state.lse;
    result = std::move(state.arrays);
  }
  const int rows = static_cast<int>(qr.rows / d.batch_size);
  const auto* query = static_cast<const float*>(qr.data);
  const ParallelFor threads = c.impl().parallel_for();
  c.locked([&] {
    if (!v.valid()) fail("LayerView.attention: the view of ticket {} was released", d.ticket);
    switch (c.impl().dtype()) {
      case DType::f32: return cpu_attend(host_view<float>(d), query, heads, rows, scale, o.data(), l.data(), threads);
      case DType::f16: return cpu_attend(host_view<fp16_t>(d), query, heads, rows, scale, o.data(), l.data(), threads);
      case DType::bf16: return cpu_attend(host_view<bf16_t>(d), query, heads, rows, scale, o.data(), l.data(), threads);
    }
  });
  return result;
}

// The valid key (value_half 0) or value (1) rows of view entry `entry`, zero-copy.
nb::object entry_rows(const PyLayerView& v, std::int64_t entry, int value_half, const char* what) {
  const ViewData& d = v.checked(what);
  if (d.placement.cuda) {
    fail("LayerView.{}: the view of a CUDA cache keeps its arrays on the device; index LayerView.pool with slot, "
         "block and valid_tokens there",
         what);
  }
  if (entry < 0 || entry >= static_cast<std::int64_t>(d.slot.size())) {
    fail("LayerView.{}: entry {} is outside [0, {})", what, entry, d.slot.size());
  }
  const DType t = v.cache().impl().dtype();
  const auto e = static_cast<std::size_t>(entry);
  const std::int64_t offset = static_cast<std::int64_t>(d.slot[e]) * d.slot_stride +
                              static_cast<std::int64_t>(value_half) * d.block_tokens * d.head_dim;
  const auto* base = static_cast<const char*>(d.pool) + offset * static_cast<std::int64_t>(dtype_size(t));
  return pool_array(t, d.placement, v.cache_object(), base,
                    {static_cast<std::size_t>(d.valid_tokens[e]), static_cast<std::size_t>(d.head_dim)}, {d.head_dim, 1});
}

// (cuda, index) of a device argument: "cpu", "cuda", "cuda:N", or an object whose str() is one
// (torch.device); index -1: the current device.
std::pair<bool, int> parse_device(nb::handle device) {
  const std::string text = nb::cast<std::string>(nb::str(device));
  if (text == "cpu") return {false, -1};
  if (text == "cuda") return {true, -1};
  if (text.rfind("cuda:", 0) == 0) {
    const std::string n = text.substr(5);
    if (!n.empty() && n.find_first_not_of("0123456789") == std::string::npos && n.size() < 6) return {true, std::stoi(n)};
  }
  fail("Cache: device '{}' is not 'cpu', 'cuda' or 'cuda:N'", text);
}

// The cudaStream_t of a stream argument: an int, an object with .cuda_stream (torch) or .ptr
// (cupy); None: the current torch stream of `device` where torch is loaded, else 0 (the legacy
// default stream).
std::uintptr_t stream_handle(nb::handle stream, int device) {
  if (stream.is_none()) {
    nb::object torch = nb::module_::import_("sys").attr("modules").attr("get")("torch");
    if (torch.is_none() || !nb::cast<bool>(torch.attr("cuda").attr("is_available")())) return 0;
    return nb::cast<std::uintptr_t>(torch.attr("cuda").attr("current_stream")(device).attr("cuda_stream"));
  }
  if (nb::isinstance<nb::int_>(stream)) return nb::cast<std::uintptr_t>(stream);
  if (nb::hasattr(stream, "cuda_stream")) return nb::cast<std::uintptr_t>(stream.attr("cuda_stream"));
  if (nb::hasattr(stream, "ptr")) return nb::cast<std::uintptr_t>(stream.attr("ptr"));
  fail("Cache: stream is a {}, expected a torch or cupy CUDA stream or a cudaStream_t as an int",
       nb::inst_name(stream).c_str());
}

}  // namespace

void bind_results(nb::module_& m) {
  nb::class_<Ticket>(m, "Ticket", "The handle of one prefetch: acquire / attend / release / observe take it.")
      .def_prop_ro("id", member("Ticket.id", &Ticket::id))
      .def_prop_ro("cache", member("Ticket.cache", &Ticket::cache))
      .def_prop_ro("layer", member("Ticket.layer", &Ticket::layer))
      .def_prop_ro("sequences", member("Ticket.sequences", &Ticket::sequences))
      .def_prop_ro("generations", member("Ticket.generations", &Ticket::generations))
      .def_prop_ro("plans", member("Ticket.plans", &Ticket::plans))
      .def("__repr__", method<Ticket>("Ticket.__repr__", +[](Ticket& t) {
             return fmt::format("Ticket(id={}, cache={}, layer={}, sequences=[{}])", t.id, t.cache, t.layer,
                                fmt::join(t.sequences, ", "));
           }));

  using L = LayerStatistics;
  nb::class_<L>(m, "LayerStatistics")
      .def_prop_ro("plans", member("LayerStatistics.plans", &L::plans))
      .def_prop_ro("blocks_selected", member("LayerStatistics.blocks_selected", &L::blocks_selected))
      .def_prop_ro("blocks_fetched", member("LayerStatistics.blocks_fetched", &L::blocks_fetched))
      .def_prop_ro("bytes_fetched", member("LayerStatistics.bytes_fetched", &L::bytes_fetched))
      .def_prop_ro("remote_blocks_fetched", member("LayerStatistics.remote_blocks_fetched", &L::remote_blocks_fetched))
      .def_prop_ro("remote_bytes_fetched", member("LayerStatistics.remote_bytes_fetched", &L::remote_bytes_fetched))
      .def_prop_ro("admits_capped", member("LayerStatistics.admits_capped", &L::admits_capped))
      .def_prop_ro("acquires", member("LayerStatistics.acquires", &L::acquires))
      .def_prop_ro("acquire_wait_ns", member("LayerStatistics.acquire_wait_ns", &L::acquire_wait_ns))
      .def_prop_ro("observed_true_blocks", member("LayerStatistics.observed_true_blocks", &L::observed_true_blocks))
      .def_prop_ro("observed_hits", member("LayerStatistics.observed_hits", &L::observed_hits))
      .def("recall", method<L>("LayerStatistics.recall", +[](L& l) { return l.recall(); }))
      .def("__repr__", method<L>("LayerStatistics.__repr__", +[](L& l) {
             return fmt::format("LayerStatistics(plans={}, blocks_selected={}, blocks_fetched={}, bytes_fetched={}, "
                                "admits_capped={}, acquires={}, recall={:.4f})",
                                l.plans, l.blocks_selected, l.blocks_fetched, l.bytes_fetched, l.admits_capped,
                                l.acquires, l.recall());
           }));
  nb::class_<Statistics>(m, "Statistics")
      .def_prop_ro("layers", member("Statistics.layers", &Statistics::layers))
      .def_prop_ro("host_blocks_total", member("Statistics.host_blocks_total", &Statistics::host_blocks_total))
      .def_prop_ro("host_blocks_in_use", member("Statistics.host_blocks_in_use", &Statistics::host_blocks_in_use))
      .def_prop_ro("host_bytes_in_use", member("Statistics.host_bytes_in_use", &Statistics::host_bytes_in_use))
      .def("total", method<Statistics>("Statistics.total", +[](Statistics& s) { return s.total(); }))
      .def("__repr__", method<Statistics>("Statistics.__repr__", +[](Statistics& s) { return statistics_repr(s); }));
}

void bind_cache(nb::module_& m) {
  m.def("built_with_cuda", &cuda_built, "Whether this module has the CUDA backend (Cache(device='cuda')).");
  m.def("cuda_available", [] { return cuda_device_count() > 0; },
        "Whether Cache(device='cuda') can run here: the module has the CUDA backend and the runtime sees a GPU.");
  // Tests: an array that says it lives on `device` (DLPack), over host memory that no call reads
  // (every call refuses an array of another device before it reads it).
  m.def(
      "_fake_device_array",
      [](std::vector<std::size_t> shape, const std::string& device) {
        const auto [cuda, index] = parse_device(nb::str(device.c_str()));
        std::size_t n = 1;
        for (std::size_t x : shape) n *= x;
        auto* memory = new std::vector<float>(std::max<std::size_t>(n, 1));
        nb::capsule owner(memory, [](void* p) noexcept { delete static_cast<std::vector<float>*>(p); });
        return nb::ndarray<>(memory->data(), shape.size(), shape.data(), owner, nullptr, nb::dtype<float>(),
                             cuda ? nb::device::cuda::value : nb::device::cpu::value, std::max(index, 0))
            .cast();
      },
      "shape"_a, "device"_a);
  using V = PyLayerView;
  // A property of the view's CSR arrays: a numpy array owned by the view object.
#define OASISKV_VIEW_ARRAY(field, count)                                                           \
  def_prop_ro(#field, method<V>("LayerView." #field, +[](nb::handle self, V& v) {                  \
                const ViewData& d = v.checked(#field);                                             \
                if (!d.placement.cuda) return numpy_1d(d.field, self);                             \
                return device_1d(d.d_##field, count, d.placement, self);                           \
              }))
  nb::class_<V>(m, "LayerView",
                "The resident working set of one layer (CSR over (sequence, kv head) pairs). Valid from acquire "
                "until release; every attribute raises oasiskv.Error after that.")
      .def_prop_ro("valid", method<V>("LayerView.valid", +[](V& v) { return v.valid(); }),
                   "Whether the view's ticket is still acquired.")
      .def_prop_ro("layer", method<V>("LayerView.layer", +[](V& v) { return v.checked("layer").layer; }))
      .def_prop_ro("batch_size", method<V>("LayerView.batch_size", +[](V& v) { return v.checked("batch_size").batch_size; }))
      .def_prop_ro("num_kv_heads",
                   method<V>("LayerView.num_kv_heads", +[](V& v) { return v.checked("num_kv_heads").num_kv_heads; }))
      .def_prop_ro("head_dim", method<V>("LayerView.head_dim", +[](V& v) { return v.checked("head_dim").head_dim; }))
      .def_prop_ro("block_tokens",
                   method<V>("LayerView.block_tokens", +[](V& v) { return v.checked("block_tokens").block_tokens; }))
      .def_prop_ro("num_pairs", method<V>("LayerView.num_pairs", +[](V& v) {
                     const ViewData& d = v.checked("num_pairs");
                     return d.batch_size * d.num_kv_heads;
                   }))
      .def_prop_ro("ticket_id", method<V>("LayerView.ticket_id", +[](V& v) { return v.raw().ticket; }))
      .OASISKV_VIEW_ARRAY(seq_ids, d.batch_size)
      .OASISKV_VIEW_ARRAY(seq_len, d.batch_size)
      .OASISKV_VIEW_ARRAY(indptr, static_cast<std::int64_t>(d.batch_size) * d.num_kv_heads + 1)
      .OASISKV_VIEW_ARRAY(slot, d.entry_capacity)
      .OASISKV_VIEW_ARRAY(block, d.entry_capacity)
      .OASISKV_VIEW_ARRAY(valid_tokens, d.entry_capacity)
      .def_prop_ro(
          "pool", method<V>("LayerView.pool", +[](V& v) {
            const ViewData& d = v.checked("pool");
            return pool_array(v.cache().impl().dtype(), d.placement, v.cache_object(), d.pool,
                              {static_cast<std::size_t>(d.pool_slots), 2, static_cast<std::size_t>(d.block_tokens),
                               static_cast<std::size_t>(d.head_dim)},
                              {d.slot_stride, static_cast<std::int64_t>(d.block_tokens) * d.head_dim, d.head_dim, 1});
          }),
          "The layer's slot pool, zero-copy and read-only: [slots][K|V][block_tokens][head_dim] (numpy on the CPU, "
          "bfloat16 as uint16 bit patterns; a DLPack device array on CUDA).")
      .def("keys", method<V>("LayerView.keys", +[](V& v, std::int64_t entry) { return entry_rows(v, entry, 0, "keys"); }),
           "entry"_a, "The valid key rows of entry e: [valid_tokens[e]][head_dim], a zero-copy view.")
      .def("values",
           method<V>("LayerView.values", +[](V& v, std::int64_t entry) { return entry_rows(v, entry, 1, "values"); }),
           "entry"_a, "The valid value rows of entry e: [valid_tokens[e]][head_dim], a zero-copy view.")
      .def("attention", method<V>("LayerView.attention", +[](V& v, nb::handle q, float scale, nb::handle out,
                                                              nb::handle lse) { return view_attention(v, q, scale, out, lse); }),
           "q"_a.none(), "scale"_a, "out"_a = nb::none(), "lse"_a = nb::none(),
           "(out, lse): the attention of query rows over this view's resident blocks, for engines on the CPU. q "
           "[batch_size * R][num_q_heads][head_dim] float32, the R rows of each sequence in order; row r of a "
           "sequence of n tokens sits at position n - R + r and sees the keys at positions up to its own. out like "
           "q and lse [batch_size * R][num_q_heads] (the log-sum-exp of the scaled scores, for merge_state): new "
           "numpy arrays, or the caller's float32 arrays. Runs on the cache's threads (Cache(threads=N)), without the GIL.")
      .def("__repr__", method<V>("LayerView.__repr__", +[](V& v) {
             const ViewData& d = v.raw();
             return fmt::format("LayerView(ticket={}, layer={}, batch_size={}, entries={}, {})", d.ticket, d.layer,
                                d.batch_size, d.slot.size(), v.valid() ? "acquired" : "released");
           }));
#undef OASISKV_VIEW_ARRAY

  using C = PyCache;
  nb::class_<C>(m, "Cache",
                "Cache<cpu, T> or Cache<cuda, T>: sequences, append, prefetch, acquire / attend / release, statistics.",
                nb::is_weak_referenceable())
      .def(
          "__init__",
          [](C* self, const CacheConfig& config, const std::string& dtype, nb::handle device, nb::handle stream,
             bool copy_thread, int threads) {
            const DType t = parse_dtype(dtype);
            const auto [cuda, index] = parse_device(device);
            if (!cuda) {
              if (!stream.is_none()) fail("Cache: stream is for a CUDA cache; this one is on the cpu");
              new (self) C(make_cpu_cache(config, t, copy_thread, threads));
              return;
            }
            if (threads != 1) fail("Cache: threads {} is for a CPU cache; this one is on {}", threads, nb::cast<std::string>(nb::str(device)));
            const int d = index >= 0 ? index : (cuda_built() && cuda_device_count() > 0 ? cuda_current_device() : 0);
            new (self) C(make_cuda_cache(config, t, d, stream_handle(stream, d)));
          },
          "config"_a, "dtype"_a = "float32", "device"_a = "cpu", "stream"_a = nb::none(), "copy_thread"_a = true,
          "threads"_a = 1,
          "device: 'cpu', 'cuda' (the current device) or 'cuda:N' (or a torch.device). stream (CUDA): the compute "
          "stream, a torch or cupy stream or a cudaStream_t as an int; default: the current torch stream of the "
          "device, else the legacy default stream. copy_thread (CPU): CpuOptions::copy_thread. threads (CPU): how many "
          "threads (the caller's included) run prefetch's planning, copies made in the caller and "
          "LayerView.attention; 1: the calling thread alone.")
      .def_prop_ro("device", method<C>("Cache.device", +[](C& c) {
                     const Placement& p = c.impl().placement();
                     return p.cuda ? fmt::format("cuda:{}", p.device) : std::string("cpu");
                   }))
      .def_prop_ro("dtype", method<C>("Cache.dtype", +[](C& c) { return std::string(numpy_name(c.impl().dtype())); }))
      .def_prop_ro("id", method<C>("Cache.id", +[](C& c) { return c.impl().id(); }))
      .def_prop_ro("config", method<C>("Cache.config", +[](C& c) { return c.layout().config; }))
      .def_prop_ro("num_layers", method<C>("Cache.num_layers", +[](C& c) { return c.layout().num_layers(); }))
      .def_prop_ro("budget_blocks", method<C>("Cache.budget_blocks", +[](C& c) { return c.layout().budget_blocks; }))
      .def_prop_ro("selectable_blocks",
                   method<C>("Cache.selectable_blocks", +[](C& c) { return c.layout().selectable_blocks; }))
      .def_prop_ro("slots_per_layer",
                   method<C>("Cache.slots_per_layer", +[](C& c) { return c.layout().slots_per_layer; }))
      .def_prop_ro("num_sequences", method<C>("Cache.num_sequences", +[](C& c) {
                     return c.locked([&] { return c.impl().num_sequences(); });
                   }))
      .def("add_sequence",
           method<C>("Cache.add_sequence", +[](C& c, SeqId id) { c.locked([&] { c.impl().add_sequence(id); }); }),
           "id"_a)
      .def("remove_sequence",
           method<C>("Cache.remove_sequence", +[](C& c, SeqId id) { c.locked([&] { c.impl().remove_sequence(id); }); }),
           "id"_a)
      .def("has_sequence",
           method<C>("Cache.has_sequence",
                     +[](C& c, SeqId id) { return c.locked([&] { return c.impl().has_sequence(id); }); }),
           "id"_a)
      .def("sequence_length", method<C>("Cache.sequence_length", +[](C& c, SeqId id, int layer) {
             return c.locked([&] { return c.impl().sequence_length(id, layer); });
           }),
           "id"_a, "layer"_a = 0)
      .def("truncate", method<C>("Cache.truncate", +[](C& c, SeqId id, std::int64_t length) {
             c.locked([&] { c.impl().truncate(id, length); });
           }),
           "id"_a, "length"_a)
      .def("fork", method<C>("Cache.fork", +[](C& c, SeqId src, SeqId dst, std::optional<std::int64_t> length) {
             c.locked([&] { c.impl().fork(src, dst, length); });
           }),
           "src"_a, "dst"_a, "length"_a = nb::none())
      .def(
          "append",
          method<C>("Cache.append",
                    +[](C& c, std::vector<SeqId> batch, int layer, nb::handle k, nb::handle v,
                        std::optional<std::vector<std::int32_t>> rows_per_seq) {
                      std::vector<std::int32_t> rows =
                          rows_per_seq ? *rows_per_seq : std::vector<std::int32_t>(batch.size(), 1);
                      if (rows.size() != batch.size()) {
                        fail("append: rows_per_seq has {} entries, the batch {} sequences", rows.size(), batch.size());
                      }
                      std::int64_t total = 0;
                      for (std::size_t i = 0; i < rows.size(); ++i) {
                        if (rows[i] < 0) fail("append: rows_per_seq[{}] = {} is negative", i, rows[i]);
                        total += rows[i];
                      }
                      Array keep_k, keep_v;
                      const RowsView kr = rows_argument(k, c.kv_rows("append", "k", total), keep_k);
                      const RowsView vr = rows_argument(v, c.kv_rows("append", "v", total), keep_v);
                      c.locked([&] { c.impl().append(batch, layer, rows, kr, vr); });
                    }),
          "batch"_a, "layer"_a, "k"_a.none(), "v"_a.none(), "rows_per_seq"_a = nb::none(),
          "Appends rows_per_seq[i] rows (default 1) to batch[i] at `layer`; k, v: [rows][num_kv_heads][head_dim] of "
          "the cache's dtype, C-contiguous, rows in batch order (their total is sum(rows_per_seq)).")
      .def(
          "prefetch",
          method<C>("Cache.prefetch",
                    +[](C& c, std::vector<SeqId> batch, int layer, nb::handle q, std::int64_t next_step_rows) {
                      Array keep;
                      const RowsView qr = rows_argument(q, c.query_rows("prefetch", "q_lookahead"), keep);
                      return c.locked([&] { return c.impl().prefetch(batch, layer, qr, next_step_rows); });
                    }),
          "batch"_a, "layer"_a, "q_lookahead"_a.none(), "next_step_rows"_a = 1,
          "Plans the next step's resident set at `layer` from the lookahead queries [batch * R][num_q_heads][head_dim] "
          "(the cache's dtype or float32); returns its Ticket.")
      .def("acquire", method<C>("Cache.acquire", +[](nb::handle self, C& c, nb::handle ticket) {
             const Ticket t = checked_ticket(ticket, "acquire");
             ViewData d = c.locked([&] { return c.impl().acquire(t); });
             return make_view(std::move(d), self, c);
           }),
           "ticket"_a.none(), "Waits for the ticket's copies (GIL released) and returns its LayerView.")
      .def("release", method<C>("Cache.release", +[](C& c, nb::handle ticket) {
             const Ticket t = checked_ticket(ticket, "release");
             c.locked([&] { c.impl().release(t); });
             c.mark_released(t.layer);
           }),
           "ticket"_a.none())
      .def("attend", method<C>("Cache.attend", +[](nb::handle self, C& c, nb::handle ticket, nb::callable fn) {
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
           }),
           "ticket"_a.none(), "fn"_a,
           "acquire, fn(view), release (also when fn raises); returns fn's result. The wait runs without the GIL.")
      .def("observe", method<C>("Cache.observe", +[](C& c, nb::handle ticket, nb::handle q) {
             const Ticket t = checked_ticket(ticket, "observe");
             Array keep;
             const RowsView qr = rows_argument(q, c.query_rows("observe", "q_true"), keep);
             c.locked([&] { c.impl().observe(t, qr); });
           }),
           "ticket"_a.none(), "q_true"_a.none())
      .def("remainder", method<C>("Cache.remainder", +[](C& c, nb::handle ticket, nb::handle q, nb::handle out,
                                                          nb::handle lse) {
             const Ticket t = checked_ticket(ticket, "remainder");
             Array keep;
             const RowsView qr = rows_argument(q, c.query_rows("remainder", "q"), keep);
             const int heads = c.layout().num_q_heads(), d = c.layout().head_dim();
             if (out.is_none() != lse.is_none()) fail("remainder: pass both out and lse, or neither");
             if (!out.is_none()) {  // the caller's arrays (a CUDA cache writes device memory)
               OutArray keep_out, keep_lse;
               const auto o = output_argument(out, "remainder", "out", qr.rows, heads, d, c.impl().placement(), keep_out);
               const auto l = output_argument(lse, "remainder", "lse", qr.rows, heads, 0, c.impl().placement(), keep_lse);
               c.locked([&] { c.impl().remainder(t, qr, o, l); });
               return nb::make_tuple(out, lse);
             }
             if (c.on_device()) {
               fail("remainder: a CUDA cache writes into device arrays the caller passes: out [{}, {}, {}] and lse "
                    "[{}, {}], float32 (torch.empty(..., device='cuda'))",
                    qr.rows, heads, d, qr.rows, heads);
             }
             NewState state = new_state_arrays(qr.rows, heads, d);
             c.locked([&] { c.impl().remainder(t, qr, state.out, state.lse); });
             return state.arrays;
           }),
           "ticket"_a.none(), "q"_a.none(), "out"_a = nb::none(), "lse"_a = nb::none(),
           "(out, lse): the estimate of the attention over the blocks the acquired view leaves out, per row and "
           "query head (CacheConfig.remainder must not be 'none'); merge it with the view's attention state. out "
           "[rows][num_q_heads][head_dim] and lse [rows][num_q_heads], float32: new numpy arrays, or the caller's "
           "(required on CUDA, device memory).")
      .def("select_blocks", method<C>("Cache.select_blocks", +[](C& c, SeqId id, int layer, nb::handle q) {
             Array keep;
             const RowsView qr = rows_argument(q, c.query_rows("select_blocks", "q"), keep);
             return c.locked([&] { return c.impl().select_blocks(id, layer, qr); });
           }),
           "id"_a, "layer"_a, "q"_a.none(),
           "The blocks (best first) the selector would pick for id's next step at `layer`, per kv head.")
      .def("statistics",
           method<C>("Cache.statistics", +[](C& c) { return c.locked([&] { return c.impl().statistics(); }); }))
      .def("reset_statistics",
           method<C>("Cache.reset_statistics", +[](C& c) { c.locked([&] { c.impl().reset_statistics(); }); }))
      .def("synchronize", method<C>("Cache.synchronize", +[](C& c) { c.locked([&] { c.impl().synchronize(); }); }))
      .def("layer_failure", method<C>("Cache.layer_failure", +[](C& c, int layer) {
             return c.locked([&] { return c.impl().layer_failure(layer); });
           }),
           "layer"_a)
      .def("recover_layer",
           method<C>("Cache.recover_layer", +[](C& c, int layer) { c.locked([&] { c.impl().recover_layer(layer); }); }),
           "layer"_a)
      .def("__repr__", method<C>("Cache.__repr__", +[](C& c) {
             const CacheLayout& L = c.layout();
             return fmt::format("Cache(id={}, dtype='{}', layers={}, q_heads={}, kv_heads={}, head_dim={}, budget_tokens={})",
                                c.impl().id(), numpy_name(c.impl().dtype()), L.num_layers(), L.num_q_heads(),
                                L.num_kv_heads(), L.head_dim(), L.config.budget_tokens);
           }));
}

}  // namespace oasiskv::python
