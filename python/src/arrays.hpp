// Array arguments and results of the Python module: what a call accepts (DLPack producers, the
// buffer protocol), checked before the C++ call and refused with oasiskv.Error naming the
// argument, and the element types' names.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "caches.hpp"
#include "oasiskv/view.hpp"
#include "oasiskv/dtype.hpp"

namespace oasiskv::python {

namespace nb = nanobind;

// A read-only array of any dtype, shape and device: what arguments are taken as; a writable one:
// what outputs are taken as.
using Array = nb::ndarray<nb::ro>;
using OutArray = nb::ndarray<>;

// "float32", "float16", "bfloat16"; and the cache dtype of such a name (or an alias: "f16",
// "half", ...), an Error naming it otherwise.
const char* numpy_name(DType t);
DType parse_dtype(const std::string& name);
// The DLPack element type the cache's rows are handed out as (bfloat16: uint16 bit patterns on
// the host, where numpy has no bfloat16).
nb::dlpack::dtype element_dlpack(DType t);

std::string shape_text(const std::vector<std::int64_t>& s);

// What one rows argument must be: [rows][heads][head_dim] of the cache's dtype (or float32 where
// allowed), C-contiguous, in the cache's memory (host memory, or its CUDA device).
struct RowsSpec {
  const char* call;       // "append"
  const char* name;       // "k"
  std::int64_t rows;      // the rows expected, or -1: any
  int heads;              // num_kv_heads or num_q_heads
  const char* heads_name; // "num_kv_heads"
  int head_dim;
  DType cache_dtype;
  bool allow_float32;
  Placement placement;  // the cache's
};

// `obj` as a checked RowsView (its rows from the array's shape, never from another count), kept
// alive in `keep`; oasiskv.Error naming spec.name and what is wrong otherwise. For a CUDA cache a
// DLPack producer is asked for the array on the cache's stream (__dlpack__(stream=...)), so its
// pending writes are ordered before the cache reads it.
RowsView rows_argument(nb::handle obj, const RowsSpec& spec, Array& keep);

// A float32 output array ([rows][heads][head_dim] when head_dim > 0, else [rows][heads]) in the
// cache's memory, C-contiguous, exactly that shape; oasiskv.Error naming it otherwise.
std::span<float> output_argument(nb::handle obj, const char* call, const char* name, std::int64_t rows, int heads,
                                 int head_dim, const Placement& placement, OutArray& keep);

// "cpu", "cuda:0": where an array is, by its DLPack device.
std::string device_text(int device_type, int device_id);

}  // namespace oasiskv::python
