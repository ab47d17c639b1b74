// oasiskv.CacheConfig: every field of the C++ CacheConfig (and of its ModelShape) by name, from
// one table that gives the keywords of __init__, the properties and the repr. A test reads the
// C++ struct's fields from config.hpp and checks that this table holds each of them.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

#include "bindings.hpp"
#include "bound.hpp"
#include "oasiskv/config.hpp"
#include "oasiskv/error.hpp"

namespace oasiskv::python {
namespace {

std::string repr_of(nb::handle h) { return nb::cast<std::string>(nb::repr(h)); }

// A Python number as the field's C++ type: ints (and anything with __index__, such as numpy
// integers) for integer fields, any real number for floating fields; the field named otherwise.
template <class V>
V number_of(nb::handle h, const char* name) {
  if (PyBool_Check(h.ptr())) fail("CacheConfig: {} must be a number, got {}", name, repr_of(h));
  if constexpr (std::is_integral_v<V>) {
    PyObject* index = PyNumber_Index(h.ptr());
    if (index == nullptr) {
      PyErr_Clear();
      fail("CacheConfig: {} must be an int, got {}", name, repr_of(h));
    }
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(index, &overflow);
    Py_DECREF(index);
    if (overflow != 0 || v < std::numeric_limits<V>::min() || v > std::numeric_limits<V>::max()) {
      fail("CacheConfig: {} = {} does not fit a {}-bit integer", name, repr_of(h), sizeof(V) * 8);
    }
    return static_cast<V>(v);
  } else {
    if (PyUnicode_Check(h.ptr())) fail("CacheConfig: {} must be a number, got {}", name, repr_of(h));
    const double v = PyFloat_AsDouble(h.ptr());
    if (v == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      fail("CacheConfig: {} must be a number, got {}", name, repr_of(h));
    }
    return static_cast<V>(v);
  }
}

std::string text_of(nb::handle h, const char* name) {
  if (!PyUnicode_Check(h.ptr())) fail("CacheConfig: {} must be a str, got {}", name, repr_of(h));
  return nb::cast<std::string>(h);
}

struct Field {
  const char* name;
  nb::object (*get)(const CacheConfig&);
  void (*set)(CacheConfig&, nb::handle);
};

template <auto M>
nb::object get_field(const CacheConfig& c) {
  return nb::cast(c.*M);
}
template <auto M>
nb::object get_shape(const CacheConfig& c) {
  return nb::cast(c.shape.*M);
}

#define OASISKV_NUMBER(field)                                                                           \
  Field {                                                                                               \
    #field, &get_field<&CacheConfig::field>, [](CacheConfig& c, nb::handle h) {                        \
      c.field = number_of<std::remove_reference_t<decltype(c.field)>>(h, #field);                       \
    }                                                                                                   \
  }
#define OASISKV_SHAPE(field)                                                                                  \
  Field {                                                                                                     \
    #field, &get_shape<&ModelShape::field>, [](CacheConfig& c, nb::handle h) { c.shape.field = number_of<int>(h, #field); } \
  }
#define OASISKV_CHOICE(field, name_of, parse)                                                              \
  Field {                                                                                                  \
    #field, [](const CacheConfig& c) { return nb::cast(std::string(name_of(c.field))); },                 \
        [](CacheConfig& c, nb::handle h) { c.field = parse(text_of(h, #field)); }                          \
  }

// Every field of CacheConfig, in the struct's order (ModelShape's four first).
const Field kFields[] = {
    OASISKV_SHAPE(num_layers),
    OASISKV_SHAPE(num_q_heads),
    OASISKV_SHAPE(num_kv_heads),
    OASISKV_SHAPE(head_dim),
    OASISKV_NUMBER(block_tokens),
    OASISKV_NUMBER(budget_tokens),
    OASISKV_NUMBER(sink_tokens),
    OASISKV_NUMBER(recent_tokens),
    OASISKV_NUMBER(fetch_ratio),
    OASISKV_NUMBER(max_sequences),
    OASISKV_NUMBER(max_tokens_per_sequence),
    OASISKV_NUMBER(host_pool_blocks),
    OASISKV_CHOICE(reduction, reduction_name, parse_reduction),
    OASISKV_NUMBER(softmax_scale),
    OASISKV_CHOICE(remainder, remainder_name, parse_remainder),
    OASISKV_NUMBER(remainder_cluster_rows),
    OASISKV_NUMBER(remainder_bits),
    OASISKV_CHOICE(scorer, block_score_name, parse_block_score),
    OASISKV_NUMBER(spread_alpha),
    OASISKV_NUMBER(run_tokens),
};

#undef OASISKV_NUMBER
#undef OASISKV_SHAPE
#undef OASISKV_CHOICE

const Field& field_named(const std::string& name) {
  for (const Field& f : kFields) {
    if (name == f.name) return f;
  }
  std::string names;
  for (const Field& f : kFields) names += (names.empty() ? "" : ", ") + std::string(f.name);
  fail("CacheConfig: no field '{}' (the fields: {})", name, names);
}

}  // namespace

void bind_config(nb::module_& m) {
  auto cfg = nb::class_<CacheConfig>(m, "CacheConfig",
                                     "What the engine chooses: every field of the C++ CacheConfig (and of its "
                                     "ModelShape), as a keyword of the constructor and as a property. "
                                     "CacheConfig.field_names lists them.");
  cfg.def(
      "__init__",
      [](CacheConfig* self, const nb::kwargs& fields) {
        CacheConfig c;  // the C++ defaults
        for (auto [key, value] : fields) field_named(nb::cast<std::string>(key)).set(c, value);
        new (self) CacheConfig(c);
      },
      "Keywords only: any field of CacheConfig.field_names; the others keep the C++ defaults.");
  nb::list names;
  for (const Field& f : kFields) {
    names.append(f.name);
    cfg.def_prop_rw(
        f.name,
        [&f](nb::handle_t<CacheConfig> self) { return f.get(self_of<CacheConfig>(self, "CacheConfig")); },
        [&f](nb::handle_t<CacheConfig> self, nb::handle value) { f.set(self_of<CacheConfig>(self, "CacheConfig"), value); });
  }
  cfg.attr("field_names") = nb::tuple(names);
  cfg.def("validate", method<CacheConfig>("CacheConfig.validate", +[](CacheConfig& c) { (void)CacheLayout::from(c); }),
          "Raises oasiskv.Error naming the first bad value (the Cache constructor does the same).");
  cfg.def("__repr__", method<CacheConfig>("CacheConfig.__repr__", +[](CacheConfig& c) {
            std::string out = "CacheConfig(";
            for (const Field& f : kFields) {
              out += fmt::format("{}{}={}", &f == kFields ? "" : ", ", f.name, nb::cast<std::string>(nb::repr(f.get(c))));
            }
            return out + ")";
          }));
}

}  // namespace oasiskv::python
