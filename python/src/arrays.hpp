// Array arguments and results of the Python module: what a call accepts (DLPack producers, the
// buffer protocol), checked before the C++ call and refused with oasiskv.Error naming the
// argument, and the element types' names.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "oasiskv/view.hpp"
#include "oasiskv/dtype.hpp"

namespace oasiskv::python {

namespace nb = nanobind;

// A read-only array of any dtype, shape and device: what arguments are taken as.
using Array = nb::ndarray<nb::ro>;

// "float32", "float16", "bfloat16"; and the cache dtype of such a name (or an alias: "f16",
// "half", ...), an Error naming it otherwise.
const char* numpy_name(DType t);
DType parse_dtype(const std::string& name);
// The DLPack element type the cache's rows are handed out as (bfloat16: uint16 bit patterns on
// the host, where numpy has no bfloat16).
nb::dlpack::dtype element_dlpack(DType t);

std::string shape_text(const std::vector<std::int64_t>& s);

// What one rows argument must be: [rows][heads][head_dim] of the cache's dtype (or float32 where
// allowed), C-contiguous, in host memory.
struct RowsSpec {
  const char* call;       // "append"
  const char* name;       // "k"
  std::int64_t rows;      // the rows expected, or -1: any
  int heads;              // num_kv_heads or num_q_heads
  const char* heads_name; // "num_kv_heads"
  int head_dim;
  DType cache_dtype;
  bool allow_float32;
};

// `obj` as a checked RowsView (its rows from the array's shape, never from another count), kept
// alive in `keep`; oasiskv.Error naming spec.name and what is wrong otherwise.
RowsView rows_argument(nb::handle obj, const RowsSpec& spec, Array& keep);

}  // namespace oasiskv::python
