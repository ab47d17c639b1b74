// Cache<cuda, T>: the one Cache (oasiskv/cache.hpp) over the CUDA engine (oasiskv/cuda/engine.hpp).
// Same API and semantics as Cache<cpu, T>; given the same scores it selects, plans and copies the
// same blocks. Host code (compiles with g++); link oasiskv::cuda.
//
//   oasiskv::Cache<oasiskv::cuda, fp16_t> cache(config, oasiskv::CudaOptions{.compute_stream = s});
//
// Device. The cache records the current device at construction and sets it (restoring the
// caller's afterwards) in every call, so calls made while another device is current still go to
// the cache's device. Inputs on another device are refused.
//
// Memory. Every pointer the decode calls take is a DEVICE pointer (cudaMalloc'd, managed, or
// mapped pinned host memory): append's k and v, prefetch's q_lookahead, observe's q_true,
// select_blocks' q, remainder's q, out and lse. acquire's LayerView points at DEVICE memory (seq_ids, seq_len, indptr,
// slot, block, valid_tokens, pool); it is valid from acquire until release, for work ordered on the compute stream. The
// host tier is pinned and mapped (the constructor fails if it cannot be).
//
// Streams. options.compute_stream is the engine's: append, the query staging of prefetch,
// acquire's view kernels and observe run there, and the engine's attention must run there (or be
// ordered before release on it). The cache owns a copy stream for scoring, top-K, planning and
// the gathers (zero-copy reads of the pinned host tier). Inputs are consumed in stream order on
// the compute stream: append reads k and v, prefetch copies q_lookahead to its own staging, and
// observe reads q_true, all there, so the engine may overwrite these buffers with any work it
// enqueues on the compute stream after the call. remainder (CacheConfig::remainder) is a kernel on
// the compute stream too: it reads q and what the estimate keeps on the device (clusters: the
// block sums, folded by a companion of the append kernel, refolded on truncate, copied on fork,
// and the key clusters of each filled segment, clustered there after the append; quantized: the
// block codes, written by the same companions) and writes out and lse
// for the engine's merge enqueued after it; it agrees with Cache<cpu>::remainder to float
// rounding (expf/logf and summation order differ), not bit for bit. Copy-stream work that must follow compute-stream
// work waits for an event (summaries are ready for scoring; a gather runs after the attention that
// read its victim slots).
//
// Ordering (docs/architecture.md, "A decode step"). A plan's gathers are enqueued when the Cache's gate opens (its
// older plans retired), normally in release(previous); acquire makes the compute stream wait for
// the ticket's gathers and builds the view on the device. No host synchronisation and no
// device-to-host copy in append, prefetch, acquire, release or observe.
//
// Differences from Cache<cpu> (each an oasiskv::Error where it is a refusal):
//   - No finiteness check of k, v or q (device data is not read on the host). Pageable host
//     pointers are refused (outside stream capture only).
//   - At most options.tickets_per_layer tickets per layer may be outstanding; prefetch and observe
//     take at most options.max_query_rows rows per sequence (scratch is sized at construction).
//   - statistics() synchronises both streams (device counters); acquire_wait_ns stays 0 (acquire
//     does not block the host). select_blocks is synchronous.
//   - add_sequence, remove_sequence, statistics, reset_statistics, select_blocks, synchronize and
//     recover_layer are refused during stream capture.
//
// CUDA graphs. A decode step (append, prefetch, acquire, attention, release for every layer) can
// be captured with cudaStreamBeginCapture on the compute stream:
//   cache.join();                        // eager: orders earlier copy-stream work before the graph
//   cudaStreamBeginCapture(compute, ...);
//   ... the step's cache calls and the engine's kernels on `compute` ...
//   cache.join();                        // joins the copy stream into the capture
//   cudaStreamEndCapture(compute, &graph); instantiate; launch on compute.
// The host bookkeeping advances when the calls are made (during capture), so a graph captures
// exactly ONE step and must be launched exactly once, before any later call of the cache. If the
// capture fails, or the graph is not launched, call cache.abandon_capture() before anything else:
// it rolls the captured appends' lengths back, drops the tickets, and empties the resident sets
// of the layers the capture touched (their next plans are uncapped). A call during capture while
// eager copy-stream work is not joined is refused (call join() before cudaStreamBeginCapture).
#pragma once

#include "oasiskv/cache.hpp"
#include "oasiskv/cuda/engine.hpp"
