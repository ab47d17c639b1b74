// The CPU hot loops of the decode path, compiled in the library (src/cpu/cpu_kernels.cpp,
// src/cpu/top_k.cpp, src/cpu/block_copy.cpp): each has a portable version and, on x86, AVX/AVX2/F16C
// versions chosen at run time (the library is built without -march, and consumers need no flags)
// from the level in use (oasiskv/cpu/isa.hpp: the CPU's, capped by OASISKV_CPU_ISA).
// Every version computes exactly the bits of the portable one: the tests compare them.
// Declarations only: no intrinsics here, so nvcc and any host compiler can include this header.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "oasiskv/config.hpp"
#include "oasiskv/dtype.hpp"
#include "oasiskv/kit/block_copy.hpp"
#include "oasiskv/kit/find_non_finite.hpp"

namespace oasiskv {
inline namespace v0 {
namespace detail {

// Folds one key row (d channels) into a block's channel-wise max and min: mx[i] = max(mx[i],
// key[i]) and mn[i] = min(mn[i], key[i]) with std::max / std::min's NaN rules (a NaN key leaves
// the summary as it was); reset (the block's first row) sets both to the key.
void fold_key(float* mx, float* mn, const float* key, int d, bool reset) noexcept;
void fold_key(float* mx, float* mn, const fp16_t* key, int d, bool reset) noexcept;
void fold_key(float* mx, float* mn, const bf16_t* key, int d, bool reset) noexcept;

// find_non_finite (vectorised) is declared in oasiskv/kit/find_non_finite.hpp: the admission
// checks use it too.

// Quest bounds of `blocks` consecutive block summaries (SummaryStore's layout: [block][max | min]
// [d]) against `num_queries` queries ([query][d]): out[block * num_queries + query] =
// quest_bound(query, max, min, d), bit for bit (the same 8 lanes, the same operations in the same
// order, no contraction). Each summary is read once for all queries.
void quest_bound_blocks(const float* summaries, std::int64_t blocks, const float* queries, int num_queries, int d,
                        float* out) noexcept;

// Scores of `blocks` consecutive block summaries against `num_queries` queries with the scorer
// `params` names (config.hpp BlockScore; block_scorer.hpp): out[block * num_queries + query] =
// quest_bound or spread_score of (query, max, min), bit for bit, as
// quest_bound_blocks. params.kind quest is quest_bound_blocks.
void score_blocks(const ScoreParams& params, const float* summaries, std::int64_t blocks, const float* queries,
                  int num_queries, int d, float* out) noexcept;

// The min(k, n) best positions of `scores` in ScoreOrder (lookahead_selector.hpp), best first.
void select_top_k(std::span<const float> scores, int k, std::vector<std::int32_t>& out);

// Runs the copies (non-overlapping) in order. A large batch streams its destinations past the
// caches (non-temporal stores: no read of each destination line before it is written) and warms
// the next copy's pages; it is complete, and visible to other threads, when this returns.
void copy_blocks(std::span<const BlockCopy> copies) noexcept;

// Rows [0, rows) of one sequence appended into one block, for kv heads [0, heads): key row r of
// head h is key[r * row_stride + h * d ...] (value likewise). Each goes to the host tier, at
// host + h * host_head_stride + r * d (values at + value_offset), with streaming stores where the
// CPU has them and the rows are whole 64-byte lines (the host tier is the truth, read again only
// by later copies: its lines need not be pulled into the cache first); through to the pinned slot
// at slot + h * slot_head_stride + r * d (values at + value_offset) when slot is not null, with
// plain stores (attention reads it next); and into the block's summary at summary + h *
// summary_head_stride (max, then min at + d) with fold_key, the first row resetting it where
// reset_first. Call stream_fence() before another thread reads the host rows.
template <class T>
struct AppendRows {
  const T* key = nullptr;
  const T* value = nullptr;
  std::int64_t row_stride = 0;
  int rows = 0;
  int heads = 0;
  int d = 0;
  std::int64_t value_offset = 0;  // from a block's key rows to its value rows
  T* host = nullptr;
  std::int64_t host_head_stride = 0;
  T* slot = nullptr;
  std::int64_t slot_head_stride = 0;
  float* summary = nullptr;
  std::int64_t summary_head_stride = 0;
  bool reset_first = false;
};
void append_rows(const AppendRows<float>& a) noexcept;
void append_rows(const AppendRows<fp16_t>& a) noexcept;
void append_rows(const AppendRows<bf16_t>& a) noexcept;
void stream_fence() noexcept;

// Tests: false makes every kernel above take its portable version (default: true, the fastest
// version at the level in use, oasiskv/cpu/isa.hpp). Not for concurrent use with running kernels.
void set_simd_enabled(bool enabled) noexcept;
bool simd_enabled() noexcept;

}  // namespace detail
}  // namespace v0
}  // namespace oasiskv
