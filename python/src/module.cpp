// The Python module `oasiskv._oasiskv` (nanobind): the C++ Cache with the same names, arrays taken
// through DLPack / the buffer protocol without copies, oasiskv::Error as oasiskv.Error.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "bindings.hpp"
#include "oasiskv/cpu/isa.hpp"
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
  m.def(
      "cpu_isa", [] { return std::string(oasiskv::to_string(oasiskv::cpu_isa())); },
      "The instruction-set level the CPU kernels run at: 'scalar', 'avx2' or 'avx512' (the CPU's, capped by "
      "the environment variable OASISKV_CPU_ISA when the module loads). Raises oasiskv.Error naming a value of "
      "OASISKV_CPU_ISA it cannot honour.");
  m.def(
      "cpu_isa_supported", [] { return std::string(oasiskv::to_string(oasiskv::cpu_isa_supported())); },
      "The highest instruction-set level this CPU supports.");
  oasiskv::python::bind_config(m);
  oasiskv::python::bind_results(m);
  oasiskv::python::bind_cache(m);
}
