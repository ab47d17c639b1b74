// Cache<cpu, T>: the one Cache (oasiskv/cache.hpp) over the CPU engine (oasiskv/cpu/engine.hpp).
// Everything in host memory: the host tier (the source of truth) and the slot pool are memory
// reservations committed as rows arrive, scoring, top-K and planning run on the calling thread at
// prefetch, and the block copies on a worker thread once the previous ticket of their layer is
// released (CpuOptions: the copies in the caller instead, and the engine's thread pool lent for
// both). It defines correctness: the CUDA backend selects, plans and copies the same blocks.
//
//   #include <oasiskv/cpu/cache.hpp>
//   oasiskv::Cache<oasiskv::cpu, oasiskv::fp16_t> cache(config);   // also float, bf16_t
//   oasiskv::Cache<oasiskv::cpu, oasiskv::fp16_t> cache(config, oasiskv::CpuOptions{.copy_thread = false});
#pragma once

#include "oasiskv/cache.hpp"
#include "oasiskv/cpu/engine.hpp"
