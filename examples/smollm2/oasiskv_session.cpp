#include "oasiskv_session.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <type_traits>

#include <oasiskv/cpu/attention.hpp>

#include "forward_rows.hpp"
#include "thread_pool.hpp"

namespace smollm2 {

oasiskv::ModelShape model_shape(const ModelConfig& c) {
  return oasiskv::ModelShape{c.num_layers, c.num_q_heads, c.num_kv_heads, c.head_dim};
}

oasiskv::CpuOptions engine_cache_options() {
  oasiskv::CpuOptions options;
  options.parallel_for = engine_parallel_for();
  // One sequence's copies are small (tens of 4 KiB blocks a layer): waking a copy worker for them
  // costs more than the overlap saves, even with a core free for it (docs/performance.md).
  options.copy_thread = false;
  return options;
}

namespace {

// The reference: pointer lists into the view for attend_heads (float views).
void attend_view_row_reference(const ModelConfig& c, const oasiskv::LayerView<float>& view, const float* q,
                               const float* extra_k, const float* extra_v, int extra_rows, float* out,
                               std::int64_t last_position, float* lse) {
  const int d = c.head_dim, G = c.group_size();
  std::vector<const float*> keys, values;
  std::vector<float> scores;
  for (int h = 0; h < c.num_kv_heads; ++h) {
    keys.clear();
    values.clear();
    for (std::int32_t e = view.indptr[h]; e < view.indptr[h + 1]; ++e) {
      const std::int64_t first = static_cast<std::int64_t>(view.block[e]) * view.block_tokens;
      std::int64_t valid = view.valid_tokens[e];
      if (last_position < first + valid) valid = std::max<std::int64_t>(0, last_position - first + 1);  // no overflow
      for (std::int32_t r = 0; r < valid; ++r) {
        keys.push_back(view.keys(e) + static_cast<std::ptrdiff_t>(r) * d);
        values.push_back(view.values(e) + static_cast<std::ptrdiff_t>(r) * d);
      }
    }
    for (int x = 0; x < extra_rows; ++x) {
      keys.push_back(extra_k + (static_cast<std::size_t>(x) * c.num_kv_heads + h) * d);
      values.push_back(extra_v + (static_cast<std::size_t>(x) * c.num_kv_heads + h) * d);
    }
    scores.resize(keys.size() * G);
    if (lse != nullptr) {  // the log-sum-exp of each head's scaled scores, before attend_heads normalises them
      const float scale = 1.0f / std::sqrt(static_cast<float>(d));
      for (int g = 0; g < G; ++g) {
        const float* qg = q + (h * G + g) * d;
        float top = -INFINITY;
        for (std::size_t j = 0; j < keys.size(); ++j) top = std::max(top, dot(qg, keys[j], d) * scale);
        double total = 0.0;
        for (std::size_t j = 0; j < keys.size(); ++j)
          total += std::exp(static_cast<double>(dot(qg, keys[j], d) * scale - top));
        lse[h * G + g] = keys.empty() ? -INFINITY : top + static_cast<float>(std::log(total));
      }
    }
    attend_heads(q + h * G * d, G, keys.data(), values.data(), static_cast<int>(keys.size()), d, out + h * G * d,
                 scores.data());
  }
}

// The library kernel's segments for a view plus scratch rows (oasiskv::cpu_attend_query_row): per
// kv head, one segment per resident block (its valid rows are contiguous, head_dim apart; rows past
// last_position left out), then extra_rows scratch rows of that head ([rows][kv head][d]).
template <class T>
void view_segments(const oasiskv::LayerView<T>& view, int H, int d, std::int64_t last_position, const T* extra_k,
                   const T* extra_v, int extra_rows, std::vector<oasiskv::KvRows<T>>& segments,
                   std::vector<std::int32_t>& indptr) {
  segments.clear();
  indptr.assign(1, 0);
  for (int h = 0; h < H; ++h) {
    for (std::int32_t e = view.indptr[h]; e < view.indptr[h + 1]; ++e) {
      const std::int64_t first = static_cast<std::int64_t>(view.block[e]) * view.block_tokens;
      std::int64_t valid = view.valid_tokens[e];
      if (last_position < first + valid) valid = std::max<std::int64_t>(0, last_position - first + 1);
      if (valid > 0) segments.push_back({view.keys(e), view.values(e), valid, d});
    }
    if (extra_rows > 0) {
      segments.push_back({extra_k + static_cast<std::size_t>(h) * d, extra_v + static_cast<std::size_t>(h) * d,
                          extra_rows, static_cast<std::int64_t>(H) * d});
    }
    indptr.push_back(static_cast<std::int32_t>(segments.size()));
  }
}

// The library's attention over batch entry 0 of a view: `rows` query rows ([rows][q heads][d]),
// row r at position seq_len - rows + r seeing the view up to its own position (cpu_attend).
template <class T>
void attend_view_rows(const ModelConfig& c, const oasiskv::LayerView<T>& view, const float* q, int rows, float* out,
                      float* lse) {
  oasiskv::LayerView<T> first = view;
  first.batch_size = 1;
  oasiskv::cpu_attend(first, q, c.num_q_heads, rows, 1.0f / std::sqrt(static_cast<float>(c.head_dim)), out, lse,
                      engine_parallel_for());
}

}  // namespace

template <class T>
void attend_view_row(const ModelConfig& c, const oasiskv::LayerView<T>& view, const float* q, const T* extra_k,
                     const T* extra_v, int extra_rows, float* out, std::int64_t last_position, bool fast, float* lse) {
  if constexpr (std::is_same_v<T, float>) {
    if (!fast) return attend_view_row_reference(c, view, q, extra_k, extra_v, extra_rows, out, last_position, lse);
  }
  if (extra_rows == 0 && last_position >= view.seq_len[0] - 1) return attend_view_rows(c, view, q, 1, out, lse);
  const int d = c.head_dim, H = c.num_kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  thread_local std::vector<oasiskv::KvRows<T>> segments;
  thread_local std::vector<std::int32_t> indptr;
  view_segments(view, H, d, last_position, extra_k, extra_v, extra_rows, segments, indptr);
  oasiskv::cpu_attend_query_row<T>(q, H, c.group_size(), d, scale, segments, indptr, out, lse, engine_parallel_for());
}

template <class T>
void attend_view_step_rows(const ModelConfig& c, const oasiskv::LayerView<T>& view, const float* q, const T* own_k,
                           const T* own_v, float* out, bool fast, float* lse) {
  const int d = c.head_dim, H = c.num_kv_heads, G = c.group_size(), Q = c.num_q_heads;
  const std::size_t width = static_cast<std::size_t>(c.q_width());
  if (!fast) {
    attend_view_row<T>(c, view, q, nullptr, nullptr, 0, out, INT64_MAX, false, lse);
    attend_view_row<T>(c, view, q + width, own_k, own_v, 1, out + width, INT64_MAX, false,
                       lse != nullptr ? lse + Q : nullptr);
    return;
  }
  // Each row over the whole view (the library's tiles fold every query head on its own, so the
  // two calls give the bits of one call over both rows' heads), the log-sum-exps into the
  // caller's lse or scratch.
  thread_local std::vector<float> lse_rows, own_v_rows, own_score;
  lse_rows.resize(2 * static_cast<std::size_t>(Q));
  float* lse_out = lse != nullptr ? lse : lse_rows.data();
  attend_view_rows(c, view, q, 1, out, lse_out);
  attend_view_rows(c, view, q + width, 1, out + width, lse_out + Q);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  // The lookahead row's own k, v: one more key for each head, a state of its own (output v,
  // log-sum-exp the scaled score) merged into the row's.
  own_v_rows.resize(width);
  own_score.resize(static_cast<std::size_t>(Q));
  for (int h = 0; h < H; ++h) {
    const T* k = own_k + static_cast<std::size_t>(h) * d;
    const T* v = own_v + static_cast<std::size_t>(h) * d;
    for (int g = 0; g < G; ++g) {
      const auto head = static_cast<std::size_t>(h * G + g);
      const float* qh = q + width + head * d;
      float score = 0.0f;
      for (int i = 0; i < d; ++i) score += qh[i] * oasiskv::to_float(k[i]);
      own_score[head] = score * scale;
      for (int i = 0; i < d; ++i) own_v_rows[head * d + i] = oasiskv::to_float(v[i]);
    }
  }
  oasiskv::merge_states(out + width, lse_out + Q, own_v_rows.data(), own_score.data(), Q, d);
}

template <class T>
OasisKvSession<T>::OasisKvSession(const LlamaModel& model, const oasiskv::CacheConfig& config, const DenseKv& prompt_kv,
                                  std::int64_t prompt_tokens, const oasiskv::BudgetProfile* profile,
                                  const oasiskv::CpuOptions& options)
    : model_(model),
      c_(model.config()),
      cache_(config, profile != nullptr ? *profile : oasiskv::BudgetProfile::uniform(config), options),
      fast_(!std::is_same_v<T, float> || model.fast_kernels()),
      merge_remainder_(config.remainder != oasiskv::RemainderEstimate::none),
      tickets_(static_cast<std::size_t>(c_.num_layers)),
      speculated_q_(static_cast<std::size_t>(c_.num_layers)) {
  constexpr bool half = std::is_same_v<T, oasiskv::fp16_t>;
  if (prompt_kv.precision() != (half ? KvPrecision::fp16 : KvPrecision::fp32)) {
    throw std::invalid_argument(std::string("OasisKvSession: a cache of ") + (half ? "fp16" : "fp32") +
                                " rows from a prompt DenseKv of " + kv_precision_name(prompt_kv.precision()));
  }
  const oasiskv::SeqId batch[] = {kSequence};
  cache_.add_sequence(kSequence);
  const std::int32_t rows[] = {static_cast<std::int32_t>(prompt_tokens)};
  for (int l = 0; l < c_.num_layers; ++l) {
    if constexpr (half) {
      cache_.append(batch, l, rows, oasiskv::rows_view(prompt_kv.keys16(l), prompt_tokens),
                    oasiskv::rows_view(prompt_kv.values16(l), prompt_tokens));
    } else {
      cache_.append(batch, l, rows, oasiskv::rows_view(prompt_kv.keys(l), prompt_tokens),
                    oasiskv::rows_view(prompt_kv.values(l), prompt_tokens));
    }
  }
  length_ = prompt_tokens;
}

template <class T>
OasisKvSession<T>::OasisKvSession(const LlamaModel& model, const oasiskv::CacheConfig& config,
                                  const oasiskv::AdmissionMessage& message,
                                  std::shared_ptr<oasiskv::RemoteBlockSource> source,
                                  const oasiskv::CpuOptions& options)
    : model_(model),
      c_(model.config()),
      cache_(config, options),
      fast_(!std::is_same_v<T, float> || model.fast_kernels()),
      merge_remainder_(config.remainder != oasiskv::RemainderEstimate::none),
      speculated_q_(static_cast<std::size_t>(c_.num_layers)),
      length_(message.length) {
  tickets_ = cache_.admit(kSequence, message, std::move(source));
}

template <class T>
void OasisKvSession<T>::start(const std::vector<std::vector<float>>& lookahead_queries, int next_step_rows) {
  const oasiskv::SeqId batch[] = {kSequence};
  for (int l = 0; l < c_.num_layers; ++l) {
    tickets_[l] = cache_.prefetch(batch, l, oasiskv::rows_view(lookahead_queries[l].data(), 1), next_step_rows);
  }
}

template <class T>
void OasisKvSession<T>::merge_remainder(const oasiskv::Ticket& ticket, const float* q, int rows, float* out,
                                        float* lse) {
  const auto states = static_cast<std::size_t>(rows) * static_cast<std::size_t>(c_.num_q_heads);
  rem_out_.assign(states * static_cast<std::size_t>(c_.head_dim), 0.0f);
  rem_lse_.assign(states, -INFINITY);
  cache_.remainder(ticket, oasiskv::rows_view(q, rows), rem_out_, rem_lse_);
  oasiskv::merge_states(out, lse, rem_out_.data(), rem_lse_.data(), static_cast<std::int64_t>(states), c_.head_dim);
}

template <class T>
std::vector<float> OasisKvSession<T>::step(std::int32_t token, std::optional<std::int32_t> draft) {
  using P = StepProfile;
  const P::Phase whole{profile_, &P::total_ns};
  const oasiskv::SeqId batch[] = {kSequence};
  // The current row, and the lookahead row when there is a draft.
  ForwardRows<T> f(model_, token, draft ? std::span(&*draft, 1) : std::span<const std::int32_t>(),
                   static_cast<std::int32_t>(length()));
  const int rows = f.rows;
  for (int l = 0; l < c_.num_layers; ++l) {
    {
      const P::Phase phase{profile_, &P::qkv_ns};
      f.attention_inputs(l);
    }
    {
      const P::Phase phase{profile_, &P::append_ns};
      f.kv_rows(k_rows_, v_rows_);
      // The current row joins the cache.
      cache_.append(batch, l, oasiskv::rows_view(k_rows_.data(), 1), oasiskv::rows_view(v_rows_.data(), 1));
    }
    oasiskv::Ticket next;
    {
      // The next step's blocks, planned from the last row's queries.
      const P::Phase phase{profile_, &P::prefetch_ns};
      next = cache_.prefetch(batch, l, oasiskv::rows_view(f.q_row(rows - 1), 1));
    }
    // The lookahead row exists for its queries, which the prefetch above has read: past the last
    // layer's queries nothing of it is used (its logits are not computed), so that layer's
    // attention and MLP run on the current row alone (the same bits for it: rows are independent).
    const int rows_on = l + 1 == c_.num_layers ? 1 : rows;
    // This step's blocks, planned by the previous step (or start). The kernel's time is the
    // attention phase; the rest of attend (acquire, its wait, release) the cache's.
    const std::int64_t kernel_before = profile_ != nullptr ? profile_->attention_ns : 0;
    {
      const P::Phase phase{profile_, &P::attend_cache_ns};
      cache_.attend(tickets_[l], [&](const oasiskv::LayerView<T>& view) {
        const P::Phase kernel{profile_, &P::attention_ns};
        lse_.resize(static_cast<std::size_t>(rows) * c_.num_q_heads);
        float* lse = merge_remainder_ ? lse_.data() : nullptr;
        if (rows_on == 2) {  // the lookahead row also sees its own k, v, which are never appended
          attend_view_step_rows<T>(c_, view, f.q.data(), k_rows_.data() + c_.kv_width(), v_rows_.data() + c_.kv_width(),
                                   f.out.data(), fast_, lse);
        } else {
          attend_view_row<T>(c_, view, f.q.data(), nullptr, nullptr, 0, f.out.data(), INT64_MAX, fast_, lse);
        }
        if (merge_remainder_) merge_remainder(tickets_[l], f.q.data(), rows_on, f.out.data(), lse_.data());
      });
    }
    if (profile_ != nullptr) profile_->attend_cache_ns -= profile_->attention_ns - kernel_before;
    tickets_[l] = std::move(next);
    const P::Phase phase{profile_, &P::output_mlp_ns};
    f.attention_output_and_mlp(l, rows_on);
  }
  length_ += 1;
  std::vector<float> logits;
  {
    const P::Phase phase{profile_, &P::logits_ns};
    logits = f.first_row_logits();
  }
  if (profile_ != nullptr) ++profile_->steps;
  return logits;
}

template <class T>
std::vector<std::vector<float>> OasisKvSession<T>::speculate(std::int32_t token, std::span<const std::int32_t> drafts) {
  using P = StepProfile;
  const P::Phase whole{profile_, &P::total_ns};
  const oasiskv::SeqId batch[] = {kSequence};
  const auto p = static_cast<std::int32_t>(length());
  ForwardRows<T> f(model_, token, drafts, p);
  const int rows = f.rows;
  const std::int32_t n_rows[] = {rows};
  for (int l = 0; l < c_.num_layers; ++l) {
    {
      const P::Phase phase{profile_, &P::qkv_ns};
      f.attention_inputs(l);
    }
    {
      const P::Phase phase{profile_, &P::append_ns};
      f.kv_rows(k_rows_, v_rows_);
      cache_.append(batch, l, n_rows, oasiskv::rows_view(k_rows_.data(), rows),
                    oasiskv::rows_view(v_rows_.data(), rows));
    }
    const std::int64_t kernel_before = profile_ != nullptr ? profile_->attention_ns : 0;
    {
      const P::Phase phase{profile_, &P::attend_cache_ns};
      cache_.attend(tickets_[l], [&](const oasiskv::LayerView<T>& view) {
        const P::Phase kernel{profile_, &P::attention_ns};
        lse_.resize(static_cast<std::size_t>(rows) * c_.num_q_heads);
        // Row r sees the view up to its own position, p + r.
        if (fast_) {
          attend_view_rows<T>(c_, view, f.q.data(), rows, f.out.data(), merge_remainder_ ? lse_.data() : nullptr);
        } else {
          for (int r = 0; r < rows; ++r) {
            attend_view_row<T>(c_, view, f.q_row(r), nullptr, nullptr, 0, f.out_row(r), p + r, false,
                               merge_remainder_ ? lse_.data() + static_cast<std::size_t>(r) * c_.num_q_heads : nullptr);
          }
        }
        if (merge_remainder_) merge_remainder(tickets_[l], f.q.data(), rows, f.out.data(), lse_.data());
      });
    }
    if (profile_ != nullptr) profile_->attend_cache_ns -= profile_->attention_ns - kernel_before;
    speculated_q_[l] = f.q;  // accept() plans the next step from these
    const P::Phase phase{profile_, &P::output_mlp_ns};
    f.attention_output_and_mlp(l, rows);
  }
  speculated_rows_ = rows;
  length_ += rows;
  std::vector<std::vector<float>> logits;
  {
    const P::Phase phase{profile_, &P::logits_ns};
    logits = f.logits();
  }
  if (profile_ != nullptr) ++profile_->steps;
  return logits;
}

template <class T>
void OasisKvSession<T>::accept(int rows, int next_step_rows) {
  if (rows < 1 || rows > speculated_rows_) {
    throw std::invalid_argument("accept: " + std::to_string(rows) + " rows of a " + std::to_string(speculated_rows_) +
                                "-row speculative step");
  }
  if (rows < speculated_rows_) {
    length_ = length() - speculated_rows_ + rows;
    cache_.truncate(kSequence, length_);
  }
  // Plan the next step from the rows at and after the cut (or the last row when all were kept).
  const int first = rows < speculated_rows_ ? rows : speculated_rows_ - 1;
  const oasiskv::SeqId batch[] = {kSequence};
  for (int l = 0; l < c_.num_layers; ++l) {
    const float* q = speculated_q_[l].data() + static_cast<std::size_t>(first) * c_.q_width();
    tickets_[l] = cache_.prefetch(batch, l, oasiskv::rows_view(q, speculated_rows_ - first),
                                  next_step_rows > 0 ? next_step_rows : speculated_rows_);
  }
  speculated_rows_ = 0;
}

template <class T>
void OasisKvSession<T>::remove() {
  cache_.remove_sequence(kSequence);
  tickets_.assign(tickets_.size(), oasiskv::Ticket{});
}

template class OasisKvSession<float>;
template class OasisKvSession<oasiskv::fp16_t>;
template void attend_view_row<float>(const ModelConfig&, const oasiskv::LayerView<float>&, const float*, const float*,
                                     const float*, int, float*, std::int64_t, bool, float*);
template void attend_view_step_rows<float>(const ModelConfig&, const oasiskv::LayerView<float>&, const float*,
                                           const float*, const float*, float*, bool, float*);
template void attend_view_step_rows<oasiskv::fp16_t>(const ModelConfig&, const oasiskv::LayerView<oasiskv::fp16_t>&,
                                                     const float*, const oasiskv::fp16_t*, const oasiskv::fp16_t*,
                                                     float*, bool, float*);
template void attend_view_row<oasiskv::fp16_t>(const ModelConfig&, const oasiskv::LayerView<oasiskv::fp16_t>&,
                                               const float*, const oasiskv::fp16_t*, const oasiskv::fp16_t*, int,
                                               float*, std::int64_t, bool, float*);

}  // namespace smollm2
