// Templated device code of the CUDA backend (nvcc only), one header per stage of the decode
// step. cuda/kernels.cu instantiates these kernels and wraps them in the host operations
// declared in oasiskv/cuda/ops.hpp; engines that want to fuse or re-instantiate them can include
// this header (or one stage's) from their own .cu files.
#pragma once

#include "oasiskv/cuda/kernels/append.cuh"               // append
#include "oasiskv/cuda/kernels/common.cuh"               // conversions, block_sum, upload_words
#include "oasiskv/cuda/kernels/gather.cuh"               // gather_admits, gather_copies
#include "oasiskv/cuda/kernels/plan.cuh"                 // plan_transfers, clear_residency
#include "oasiskv/cuda/kernels/reference_attention.cuh"  // reference::sparse_attention
#include "oasiskv/cuda/kernels/remainder/clusters.cuh"   // append_moments, rebuild_moments, cluster_segment, remainder
#include "oasiskv/cuda/kernels/remainder/quantized.cuh"  // append_quantized, rebuild_quantized, remainder_quantized
#include "oasiskv/cuda/kernels/score.cuh"                // score_blocks
#include "oasiskv/cuda/kernels/top_k.cuh"                // segmented_top_k
#include "oasiskv/cuda/kernels/truncate.cuh"             // truncate_rows, truncate_residency
#include "oasiskv/cuda/kernels/view.cuh"                 // snapshot_plans, build_view, count_resident_hits
