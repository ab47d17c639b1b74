// The Python module `oasiskv._oasiskv` (nanobind): the C++ Cache with the same names, arrays taken
// through DLPack / the buffer protocol without copies, oasiskv::Error as oasiskv.Error.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "bindings.hpp"
#include "oasiskv/error.hpp"
#include "oasiskv/version.hpp"

NB_MODULE(_oasiskv, m) {
  namespace nb = nanobind;
  m.doc() = "OasisKV: a tiered sparse KV cache for LLM decode";
  m.attr("__version__") = std::string(oasiskv::version_string());
  m.attr("version_major") = oasiskv::version_major();
  m.attr("version_minor") = oasiskv::version_minor();
  m.attr("version_patch") = oasiskv::version_patch();
  nb::exception<oasiskv::Error>(m, "Error");
  oasiskv::python::bind_config(m);
  oasiskv::python::bind_results(m);
  oasiskv::python::bind_cache(m);
}
