// Attention on the CPU (oasiskv/cpu/attention.hpp): argument checks, the choice of kernel copy
// (attention_kernels.hpp), the split of a head's rows into parts over the threads, and the view's
// segments.
#include "oasiskv/cpu/attention.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>

#include "attention_kernels.hpp"
#include "oasiskv/cpu/isa.hpp"
#include "oasiskv/error.hpp"

namespace oasiskv {
inline namespace v0 {
namespace {

constexpr std::int64_t kRowsPerTask = 512;  // below twice this, a head's rows stay on one thread

// The copy of the kernels for the level in use (attention_kernels.hpp): 0 scalar, 1 avx2, 2 avx512.
// Read on every call: cpu_isa() is a load, and it throws naming a bad OASISKV_CPU_ISA.
int kernel_level() {
#if OASISKV_ATTENTION_AVX2_COPY
  return static_cast<int>(cpu_isa());
#else
  return 0;
#endif
}

template <class T>
void fold(int level, const float* q, int heads, int d, float scale, std::span<const KvRows<T>> segments,
          std::int64_t first, std::int64_t last, SoftmaxState& st) {
  const int count = static_cast<int>(segments.size());
#if OASISKV_ATTENTION_AVX2_COPY
  if (level >= 2) {
    return detail::attention_avx512::fold_rows(q, heads, d, scale, segments.data(), count, first, last, st.max.data(),
                                               st.sum.data(), st.acc.data());
  }
  if (level == 1) {
    return detail::attention_avx2::fold_rows(q, heads, d, scale, segments.data(), count, first, last, st.max.data(),
                                             st.sum.data(), st.acc.data());
  }
#else
  (void)level;
#endif
  detail::attention_scalar::fold_rows(q, heads, d, scale, segments.data(), count, first, last, st.max.data(),
                                      st.sum.data(), st.acc.data());
}

void check_shape(const char* what, int heads, int head_dim) {
  if (heads <= 0) fail("{}: heads must be positive, got {}", what, heads);
  if (head_dim <= 0) fail("{}: head_dim must be positive, got {}", what, head_dim);
}

void check_scale(const char* what, float scale) {
  if (!std::isfinite(scale)) fail("{}: scale must be finite, got {}", what, scale);
}

// Splits [0, n) into `parts` contiguous ranges; range i is [first, last).
void split_range(std::int64_t n, int parts, int i, std::int64_t& first, std::int64_t& last) {
  first = n * i / parts;
  last = n * (i + 1) / parts;
}

// Several query rows ("calls"), each one query row per GQA group over its own segment lists:
// call c's kv head h reads segments[indptr[c * (kv_heads + 1) + h] ..
// indptr[c * (kv_heads + 1) + h + 1]) with the queries q + c * q_stride, and writes out +
// c * q_stride (and lse + c * kv_heads * group). Every (call, kv head, part) is one task of a
// single parallel run, so a batch's sequences and rows share the threads; a call's parts depend
// only on its own rows, so its bits do not depend on the other calls. No checks: the callers made
// them.
template <class T>
void attend_calls(int level, int calls, const float* q, std::size_t q_stride, int kv_heads, int group, int d,
                  float scale, std::span<const KvRows<T>> segments, std::span<const std::int32_t> indptr, float* out,
                  float* lse, const ParallelFor& parallel) {
  const int threads = parallel ? parallel.threads : 1;
  const auto heads_of = [&](int c) {
    return indptr.subspan(static_cast<std::size_t>(c) * (kv_heads + 1), kv_heads + 1);
  };
  // Each call's heads in `parts` ranges (flash-decoding): the states are merged afterwards, in order.
  thread_local std::vector<int> parts, first_task;
  parts.resize(static_cast<std::size_t>(calls));
  first_task.assign(1, 0);
  for (int c = 0; c < calls; ++c) {
    const auto ends = heads_of(c);
    std::int64_t most = 0;
    for (int h = 0; h < kv_heads; ++h) {
      std::int64_t n = 0;
      for (std::int32_t e = ends[h]; e < ends[h + 1]; ++e) n += segments[e].rows;
      most = std::max(most, n);
    }
    parts[c] = static_cast<int>(std::clamp<std::int64_t>(most / kRowsPerTask, 1, threads));
    first_task.push_back(first_task.back() + kv_heads * parts[c]);
  }
  thread_local std::vector<SoftmaxState> states;
  states.resize(static_cast<std::size_t>(first_task.back()));
  SoftmaxState* st = states.data();  // a worker's thread_local is another vector
  const int* part_count = parts.data();
  const int* task_start = first_task.data();
  parallel(first_task.back(), [&](int task) {
    const int c = static_cast<int>(std::upper_bound(task_start, task_start + calls + 1, task) - task_start) - 1;
    const int local = task - task_start[c], h = local / part_count[c], part = local % part_count[c];
    const auto ends = heads_of(c);
    const auto segs = segments.subspan(ends[h], ends[h + 1] - ends[h]);
    std::int64_t n = 0;
    for (const auto& s : segs) n += s.rows;
    std::int64_t a, b;
    split_range(n, part_count[c], part, a, b);
    st[task].reset(group, d);
    fold<T>(level, q + c * q_stride + static_cast<std::size_t>(h) * group * d, group, d, scale, segs, a, b, st[task]);
  });
  for (int c = 0; c < calls; ++c) {
    for (int h = 0; h < kv_heads; ++h) {
      SoftmaxState& s = st[task_start[c] + h * part_count[c]];
      for (int p = 1; p < part_count[c]; ++p) s.merge(st[task_start[c] + h * part_count[c] + p], d);
      const std::size_t head = static_cast<std::size_t>(c) * kv_heads * group + static_cast<std::size_t>(h) * group;
      s.finish(d, out + c * q_stride + static_cast<std::size_t>(h) * group * d, lse != nullptr ? lse + head : nullptr);
    }
  }
}

}  // namespace

template <class T>
void cpu_attend_fold(const float* q, int heads, int head_dim, float scale, std::span<const KvRows<T>> segments,
                     std::int64_t first, std::int64_t last, SoftmaxState& state) {
  check_shape("cpu_attend_fold", heads, head_dim);
  check_scale("cpu_attend_fold", scale);
  if (state.max.size() != static_cast<std::size_t>(heads) ||
      state.acc.size() != static_cast<std::size_t>(heads) * static_cast<std::size_t>(head_dim)) {
    fail("cpu_attend_fold: the state holds {} heads of {} floats, expected {} heads of head_dim {}", state.max.size(),
         state.acc.size(), heads, head_dim);
  }
  fold<T>(kernel_level(), q, heads, head_dim, scale, segments, first, last, state);
}

template <class T>
void cpu_attend_query_row(const float* q, int kv_heads, int group, int head_dim, float scale,
                          std::span<const KvRows<T>> segments, std::span<const std::int32_t> indptr, float* out,
                          float* lse, const ParallelFor& parallel) {
  check_shape("cpu_attend_query_row", kv_heads, head_dim);
  if (group <= 0) fail("cpu_attend_query_row: group must be positive, got {}", group);
  check_scale("cpu_attend_query_row", scale);
  if (indptr.size() != static_cast<std::size_t>(kv_heads) + 1) {
    fail("cpu_attend_query_row: indptr has {} entries, expected kv_heads + 1 = {}", indptr.size(), kv_heads + 1);
  }
  for (int h = 0; h < kv_heads; ++h) {
    if (indptr[h] < 0 || indptr[h + 1] < indptr[h] || static_cast<std::size_t>(indptr[h + 1]) > segments.size()) {
      fail("cpu_attend_query_row: indptr[{}..{}] = [{}, {}) is not a range of the {} segments", h, h + 1, indptr[h],
           indptr[h + 1], segments.size());
    }
  }
  attend_calls<T>(kernel_level(), 1, q, 0, kv_heads, group, head_dim, scale, segments, indptr, out, lse, parallel);
}

template <class T>
void cpu_attend_causal(const float* q, std::int64_t q_stride, int rows, const std::int32_t* positions, int heads,
                       int head_dim, float scale, const KvRows<T>& kv, float* out, std::int64_t out_stride) {
  check_shape("cpu_attend_causal", heads, head_dim);
  check_scale("cpu_attend_causal", scale);
  if (rows < 0) fail("cpu_attend_causal: rows must not be negative, got {}", rows);
  const int level = kernel_level();
  thread_local std::vector<SoftmaxState> states;
  states.resize(static_cast<std::size_t>(rows));
  for (int r = 0; r < rows; ++r) states[static_cast<std::size_t>(r)].reset(heads, head_dim);
#if OASISKV_ATTENTION_AVX2_COPY
  const bool tiled = level >= 2   ? detail::attention_avx512::fold_causal(q, q_stride, rows, positions, heads, head_dim,
                                                                          scale, kv, states.data())
                     : level == 1 ? detail::attention_avx2::fold_causal(q, q_stride, rows, positions, heads, head_dim,
                                                                        scale, kv, states.data())
                                  : false;
  if (tiled) {
    for (int r = 0; r < rows; ++r) states[static_cast<std::size_t>(r)].finish(head_dim, out + r * out_stride);
    return;
  }
#endif
  for (int r = 0; r < rows; ++r) {
    SoftmaxState& st = states[static_cast<std::size_t>(r)];
    fold<T>(level, q + r * q_stride, heads, head_dim, scale, std::span(&kv, 1), 0,
            std::min<std::int64_t>(kv.rows, static_cast<std::int64_t>(positions[r]) + 1), st);
    st.finish(head_dim, out + r * out_stride);
  }
}

template <class T>
void cpu_attend(const LayerView<T>& view, const float* q, int num_q_heads, int rows, float scale, float* out,
                float* lse, const ParallelFor& parallel) {
  const int H = view.num_kv_heads, d = view.head_dim;
  if (view.batch_size < 0) fail("cpu_attend: the view's batch_size {} is negative", view.batch_size);
  if (view.batch_size == 0) return;
  if (H <= 0) fail("cpu_attend: the view's num_kv_heads must be positive, got {}", H);
  if (d <= 0) fail("cpu_attend: the view's head_dim must be positive, got {}", d);
  if (num_q_heads <= 0 || num_q_heads % H != 0) {
    fail("cpu_attend: num_q_heads must be a positive multiple of the view's num_kv_heads {}, got {}", H, num_q_heads);
  }
  if (rows < 1) fail("cpu_attend: rows must be at least 1, got {}", rows);
  check_scale("cpu_attend", scale);
  if (q == nullptr || out == nullptr) fail("cpu_attend: q and out must not be null");
  for (int i = 0; i < view.batch_size; ++i) {
    if (view.seq_len[i] < rows) {
      fail("cpu_attend: sequence {} of the view has seq_len {}, fewer than the {} query rows", i, view.seq_len[i],
           rows);
    }
  }
  const int G = num_q_heads / H;
  const auto width = static_cast<std::size_t>(num_q_heads) * static_cast<std::size_t>(d);
  // Per (sequence, row): one segment per block of each kv head, its valid rows at positions up to
  // the row's own (a view's blocks are in ascending logical order, so that is a prefix); then one
  // run over every (sequence, row, kv head, part).
  thread_local std::vector<KvRows<T>> segments;
  thread_local std::vector<std::int32_t> indptr;
  segments.clear();
  indptr.clear();
  for (int i = 0; i < view.batch_size; ++i) {
    for (int r = 0; r < rows; ++r) {
      const std::int64_t position = view.seq_len[i] - rows + r;
      indptr.push_back(static_cast<std::int32_t>(segments.size()));
      for (int h = 0; h < H; ++h) {
        const int pair = i * H + h;
        for (std::int32_t e = view.indptr[pair]; e < view.indptr[pair + 1]; ++e) {
          const std::int64_t first = static_cast<std::int64_t>(view.block[e]) * view.block_tokens;
          std::int64_t valid = view.valid_tokens[e];
          if (position < first + valid) valid = std::max<std::int64_t>(0, position - first + 1);
          if (valid > 0) segments.push_back({view.keys(e), view.values(e), valid, d});
        }
        indptr.push_back(static_cast<std::int32_t>(segments.size()));
      }
    }
  }
  attend_calls<T>(kernel_level(), view.batch_size * rows, q, width, H, G, d, scale, segments, indptr, out, lse,
                  parallel);
}

#define OASISKV_INSTANTIATE(T)                                                                              \
  template void cpu_attend_fold<T>(const float*, int, int, float, std::span<const KvRows<T>>, std::int64_t, \
                                   std::int64_t, SoftmaxState&);                                            \
  template void cpu_attend_query_row<T>(const float*, int, int, int, float, std::span<const KvRows<T>>,     \
                                        std::span<const std::int32_t>, float*, float*, const ParallelFor&); \
  template void cpu_attend_causal<T>(const float*, std::int64_t, int, const std::int32_t*, int, int, float, \
                                     const KvRows<T>&, float*, std::int64_t);                               \
  template void cpu_attend<T>(const LayerView<T>&, const float*, int, int, float, float*, float*, const ParallelFor&);
OASISKV_INSTANTIATE(float)
OASISKV_INSTANTIATE(fp16_t)
OASISKV_INSTANTIATE(bf16_t)
#undef OASISKV_INSTANTIATE

}  // namespace v0
}  // namespace oasiskv
