// Umbrella header: the whole CPU API.
#pragma once

#include "oasiskv/argument_checks.hpp"
#include "oasiskv/attention.hpp"
#include "oasiskv/backend.hpp"
#include "oasiskv/block_table.hpp"
#include "oasiskv/cache.hpp"
#include "oasiskv/config.hpp"
#include "oasiskv/dtype.hpp"
#include "oasiskv/error.hpp"
#include "oasiskv/lookahead_selector.hpp"
#include "oasiskv/prefetch_pipeline.hpp"
#include "oasiskv/statistics.hpp"
#include "oasiskv/summary.hpp"
#include "oasiskv/ticket.hpp"
#include "oasiskv/tier.hpp"
#include "oasiskv/transfer_plan.hpp"
#include "oasiskv/version.hpp"
