// Moved: the exporter of a Cache<cpu, T>'s sequence (make_admission) is the CPU backend's,
// oasiskv/cpu/admission_export.hpp. This header forwards there so that existing includes keep
// working (docs/usage.md); include the new path in new code.
#pragma once

#include "oasiskv/cpu/admission_export.hpp"
