#include "arrays.hpp"

#include <fmt/format.h>

#include <string_view>
#include <vector>

#include "oasiskv/error.hpp"

namespace oasiskv::python {

const char* numpy_name(DType t) {
  switch (t) {
    case DType::f32: return "float32";
    case DType::f16: return "float16";
    case DType::bf16: return "bfloat16";
  }
  return "?";
}

DType parse_dtype(const std::string& name) {
  if (name == "float32" || name == "f32" || name == "fp32" || name == "float") return DType::f32;
  if (name == "float16" || name == "f16" || name == "fp16" || name == "half") return DType::f16;
  if (name == "bfloat16" || name == "bf16") return DType::bf16;
  fail("Cache: dtype '{}' is not one of 'float32', 'float16', 'bfloat16'", name);
}

nb::dlpack::dtype element_dlpack(DType t) {
  switch (t) {
    case DType::f32: return nb::dtype<float>();
    case DType::f16: return nb::dlpack::dtype{static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float), 16, 1};
    case DType::bf16: return nb::dtype<std::uint16_t>();  // numpy has no bfloat16: raw bits
  }
  return nb::dtype<float>();
}

std::string shape_text(const std::vector<std::int64_t>& s) {
  std::string out = "(";
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + (s.size() == 1 ? ",)" : ")");
}

namespace {

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

// Whether memory of this DLPack device is what the cache reads: host memory for the CPU backend
// (pinned host memory too), the cache's device for CUDA (managed memory, and mapped pinned host
// memory, which the device reads too).
bool readable(int device_type, int device_id, const Placement& p) {
  if (!p.cuda) return device_type == nb::device::cpu::value || device_type == nb::device::cuda_host::value;
  if (device_type == nb::device::cuda_host::value) return true;
  return (device_type == nb::device::cuda::value || device_type == nb::device::cuda_managed::value) &&
         device_id == p.device;
}

[[noreturn]] void refuse_device(const char* call, const char* name, int device_type, int device_id, const Placement& p) {
  if (!p.cuda) {
    fail("{}: {} is on {}; this cache (CPU backend) takes host arrays", call, name, device_text(device_type, device_id));
  }
  fail("{}: {} is on {}; this cache (CUDA backend) lives on cuda:{} and takes arrays in that device's memory", call, name,
       device_text(device_type, device_id), p.device);
}

// The DLPack stream value of a CUDA stream handle: 1 is the legacy default stream (handle 0).
std::uintptr_t dlpack_stream(std::uintptr_t stream) { return stream == 0 ? 1 : stream; }

// Takes `obj` as an array: for a CUDA cache, through __dlpack__(stream=the cache's) where the
// producer accepts it; else as nanobind takes it (DLPack without a stream, the buffer protocol).
template <class A>
bool take_array(nb::handle obj, const Placement& p, A& keep) {
  if (p.cuda && nb::hasattr(obj, "__dlpack__")) {
    try {
      nb::object capsule = obj.attr("__dlpack__")(nb::arg("stream") = dlpack_stream(p.stream));
      if (nb::try_cast(capsule, keep, /*convert=*/false)) return true;
    } catch (const nb::python_error&) {
      // A producer that takes no stream here (host memory: numpy): the plain import below says why.
    }
  }
  return nb::try_cast(obj, keep, /*convert=*/false);
}

// Why an object that is no DLPack or buffer array was refused: a numpy array in the other byte
// order (DLPack has none to say), or not an array at all.
[[noreturn]] void refuse_non_array(nb::handle obj, const RowsSpec& spec) {
  if (nb::hasattr(obj, "dtype")) {
    const nb::object dtype = obj.attr("dtype");
    if (nb::hasattr(dtype, "isnative") && !nb::cast<bool>(dtype.attr("isnative"))) {
      fail("{}: {} has the non-native byte order dtype '{}'; pass {}.astype({}.dtype.newbyteorder('='))", spec.call,
           spec.name, nb::str(dtype.attr("str")).c_str(), spec.name, spec.name);
    }
  }
  fail("{}: {} is a {}, expected an array (numpy, or an object with __dlpack__)", spec.call, spec.name,
       nb::inst_name(obj).c_str());
}

}  // namespace

std::string device_text(int device_type, int device_id) {
  if (device_type == nb::device::cpu::value) return "cpu";
  return fmt::format("{}:{}", device_name(device_type), device_id);
}

RowsView rows_argument(nb::handle obj, const RowsSpec& spec, Array& keep) {
  if (!take_array(obj, spec.placement, keep)) refuse_non_array(obj, spec);
  const Array& a = keep;
  if (!readable(a.device_type(), a.device_id(), spec.placement)) {
    refuse_device(spec.call, spec.name, a.device_type(), a.device_id(), spec.placement);
  }
  const auto dt = array_dtype(a.dtype(), spec.cache_dtype);
  const bool ok = dt && (*dt == spec.cache_dtype || (spec.allow_float32 && *dt == DType::f32));
  if (!ok) {
    fail("{}: {} has dtype {}, expected {}{}", spec.call, spec.name, dlpack_name(a.dtype()),
         numpy_name(spec.cache_dtype),
         spec.allow_float32 && spec.cache_dtype != DType::f32 ? " (the cache's dtype) or float32"
         : spec.cache_dtype == DType::bf16                   ? " (the cache's dtype; numpy: uint16 bit patterns)"
                                                             : " (the cache's dtype)");
  }
  std::vector<std::int64_t> shape(a.ndim());
  for (std::size_t i = 0; i < a.ndim(); ++i) shape[i] = static_cast<std::int64_t>(a.shape(i));
  const bool shape_ok = a.ndim() == 3 && (spec.rows < 0 || shape[0] == spec.rows) && shape[1] == spec.heads &&
                        shape[2] == spec.head_dim;
  if (!shape_ok) {
    fail("{}: {} has shape {}, expected ({}, {}, {}) ([rows][{}][head_dim])", spec.call, spec.name, shape_text(shape),
         spec.rows < 0 ? std::string("rows") : std::to_string(spec.rows), spec.heads, spec.head_dim, spec.heads_name);
  }
  // C order, in elements; a dimension of extent 1 may have any stride, and an empty array has no
  // element whose place a stride could get wrong.
  if (a.size() > 0) {
    std::int64_t expected = 1;
    for (std::size_t i = a.ndim(); i-- > 0;) {
      if (shape[i] != 1 && a.stride(i) != expected) {
        std::vector<std::int64_t> strides(a.ndim());
        for (std::size_t j = 0; j < a.ndim(); ++j) strides[j] = a.stride(j);
        fail("{}: {} is not C-contiguous (shape {}, strides {} in elements); pass numpy.ascontiguousarray({})",
             spec.call, spec.name, shape_text(shape), shape_text(strides), spec.name);
      }
      expected *= shape[i];
    }
  }
  return RowsView{a.data(), *dt, shape[0]};
}

std::span<float> output_argument(nb::handle obj, const char* call, const char* name, std::int64_t rows, int heads,
                                 int head_dim, const Placement& placement, OutArray& keep) {
  if (!take_array(obj, placement, keep)) {
    fail("{}: {} is a {}, expected a writable float32 array", call, name, nb::inst_name(obj).c_str());
  }
  const OutArray& a = keep;
  if (!readable(a.device_type(), a.device_id(), placement)) refuse_device(call, name, a.device_type(), a.device_id(), placement);
  const auto t = a.dtype();
  if (t.code != static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float) || t.bits != 32 || t.lanes != 1) {
    fail("{}: {} has dtype {}, expected float32", call, name, dlpack_name(t));
  }
  std::vector<std::int64_t> shape(a.ndim()), want{rows, heads};
  if (head_dim > 0) want.push_back(head_dim);
  for (std::size_t i = 0; i < a.ndim(); ++i) shape[i] = static_cast<std::int64_t>(a.shape(i));
  if (shape != want) fail("{}: {} has shape {}, expected {}", call, name, shape_text(shape), shape_text(want));
  std::int64_t expected = 1;
  for (std::size_t i = a.ndim(); i-- > 0;) {
    if (shape[i] != 1 && a.stride(i) != expected) fail("{}: {} is not C-contiguous", call, name);
    expected *= shape[i];
  }
  return {static_cast<float*>(a.data()), static_cast<std::size_t>(expected)};
}

}  // namespace oasiskv::python
