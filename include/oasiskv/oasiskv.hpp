// Umbrella header: what an engine includes, with the CPU backend (Cache<cpu, T>). The CUDA backend
// is oasiskv/cuda/cache.hpp (target oasiskv::cuda); the remote tier over UCX oasiskv/ucx/ (target
// oasiskv::ucx). Internals live under detail/ (the Cache's), kit/ (what both backends share) and
// the backends' detail/ folders.
#pragma once

#include "oasiskv/admission.hpp"
#include "oasiskv/attention_state.hpp"
#include "oasiskv/backend.hpp"
#include "oasiskv/budget_profile.hpp"
#include "oasiskv/cache.hpp"
#include "oasiskv/cache_engine.hpp"
#include "oasiskv/config.hpp"
#include "oasiskv/cpu/admission_export.hpp"
#include "oasiskv/cpu/attention.hpp"
#include "oasiskv/cpu/cache.hpp"
#include "oasiskv/cpu/isa.hpp"
#include "oasiskv/dtype.hpp"
#include "oasiskv/error.hpp"
#include "oasiskv/reference_attention.hpp"
#include "oasiskv/remote_blocks.hpp"
#include "oasiskv/statistics.hpp"
#include "oasiskv/ticket.hpp"
#include "oasiskv/version.hpp"
#include "oasiskv/view.hpp"
