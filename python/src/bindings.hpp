// The parts of the module oasiskv._oasiskv (module.cpp calls them in this order).
#pragma once

#include <nanobind/nanobind.h>

namespace oasiskv::python {

namespace nb = nanobind;

void bind_config(nb::module_& m);   // CacheConfig (config_binding.cpp)
void bind_results(nb::module_& m);  // Ticket, LayerStatistics, Statistics (cache_binding.cpp)
void bind_cache(nb::module_& m);    // LayerView, Cache (cache_binding.cpp)

}  // namespace oasiskv::python
