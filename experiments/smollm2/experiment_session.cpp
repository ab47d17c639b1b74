#include "experiment_session.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "dense_attention.hpp"
#include "forward_rows.hpp"
#include "thread_pool.hpp"

namespace smollm2 {

template <class T>
ExperimentSession<T>::ExperimentSession(const LlamaModel& model, const oasiskv::CacheConfig& config,
                                        const DenseKv& prompt_kv, std::int64_t prompt_tokens, std::int64_t capacity,
                                        const oasiskv::BudgetProfile* profile)
    : model_(model),
      c_(model.config()),
      cache_(config, profile != nullptr ? *profile : oasiskv::BudgetProfile::uniform(config), engine_cache_options()),
      mirror_(c_.num_layers, c_.kv_width(), capacity),
      tickets_(static_cast<std::size_t>(c_.num_layers)),
      drafted_(static_cast<std::size_t>(c_.num_layers)),
      speculated_q_(static_cast<std::size_t>(c_.num_layers)) {
  constexpr bool half = std::is_same_v<T, oasiskv::fp16_t>;
  if (prompt_kv.precision() != (half ? KvPrecision::fp16 : KvPrecision::fp32)) {
    throw std::invalid_argument(std::string("ExperimentSession: a cache of ") + (half ? "fp16" : "fp32") +
                                " rows from a prompt DenseKv of " + kv_precision_name(prompt_kv.precision()));
  }
  fast_ = half || model.fast_kernels();
  planned_q_.resize(static_cast<std::size_t>(c_.num_layers));
  if (config.remainder != oasiskv::RemainderEstimate::none) remainder_ = RemainderMode::estimate;
  const oasiskv::SeqId batch[] = {kSequence};
  cache_.add_sequence(kSequence);
  const std::int32_t rows[] = {static_cast<std::int32_t>(prompt_tokens)};
  std::vector<float> k, v;
  for (int l = 0; l < c_.num_layers; ++l) {
    if constexpr (half) {
      // The mirror holds what the cache holds: the fp16 rows, widened.
      const auto n = static_cast<std::size_t>(prompt_tokens) * static_cast<std::size_t>(c_.kv_width());
      k.resize(n);
      v.resize(n);
      for (std::size_t i = 0; i < n; ++i) {
        k[i] = oasiskv::to_float(prompt_kv.keys16(l)[i]);
        v[i] = oasiskv::to_float(prompt_kv.values16(l)[i]);
      }
      mirror_.append(l, k.data(), v.data(), static_cast<int>(prompt_tokens));
      cache_.append(batch, l, rows, oasiskv::rows_view(prompt_kv.keys16(l), prompt_tokens),
                    oasiskv::rows_view(prompt_kv.values16(l), prompt_tokens));
    } else {
      mirror_.append(l, prompt_kv.keys(l), prompt_kv.values(l), static_cast<int>(prompt_tokens));
      cache_.append(batch, l, rows, oasiskv::rows_view(prompt_kv.keys(l), prompt_tokens),
                    oasiskv::rows_view(prompt_kv.values(l), prompt_tokens));
    }
  }
  length_ = prompt_tokens;
}

template <class T>
void ExperimentSession<T>::set_remainder(RemainderMode mode) {
  if (mode == RemainderMode::estimate && cache_.layout().config.remainder == oasiskv::RemainderEstimate::none) {
    throw std::invalid_argument("set_remainder: the estimate needs a cache whose CacheConfig::remainder is not none");
  }
  remainder_ = mode;
}

// k-means (L2, 8 Lloyd iterations, deterministic start) of the mirror's keys of `layer` per kv head,
// within segments of 1,024 rows, about remainder_group_rows_ rows a cluster.
template <class T>
void ExperimentSession<T>::make_clusters(int layer) {
  const int H = c_.num_kv_heads, d = c_.head_dim;
  if (cluster_of_.empty()) {
    cluster_of_.resize(static_cast<std::size_t>(c_.num_layers));
    cluster_count_.assign(static_cast<std::size_t>(c_.num_layers) * H, 0);
  }
  auto& of = cluster_of_[static_cast<std::size_t>(layer)];
  if (!of.empty()) return;
  const std::int64_t n = mirror_.length(layer);
  of.assign(static_cast<std::size_t>(H), std::vector<std::int32_t>(static_cast<std::size_t>(n)));
  constexpr std::int64_t kSegment = 1024;
  std::vector<float> centres, sums;
  std::vector<std::int32_t> counts;
  for (int h = 0; h < H; ++h) {
    std::int32_t first_cluster = 0;
    for (std::int64_t s0 = 0; s0 < n; s0 += kSegment) {
      const std::int64_t len = std::min(kSegment, n - s0);
      const int k = static_cast<int>(std::max<std::int64_t>(1, len / remainder_group_rows_));
      centres.assign(static_cast<std::size_t>(k) * d, 0.0f);
      // Start: k rows spread over the segment by a fixed stride that is coprime with typical periods.
      for (int j = 0; j < k; ++j) {
        const std::int64_t t = s0 + (static_cast<std::int64_t>(j) * 7919 + 13) % len;
        std::copy_n(mirror_.key(layer, t) + h * d, d, centres.begin() + static_cast<std::ptrdiff_t>(j) * d);
      }
      for (int it = 0; it < 8; ++it) {
        sums.assign(centres.size(), 0.0f);
        counts.assign(static_cast<std::size_t>(k), 0);
        for (std::int64_t t = s0; t < s0 + len; ++t) {
          const float* x = mirror_.key(layer, t) + h * d;
          int best = 0;
          float best_d = INFINITY;
          for (int j = 0; j < k; ++j) {
            const float* cj = centres.data() + static_cast<std::ptrdiff_t>(j) * d;
            float dist = 0.0f;
            for (int i = 0; i < d; ++i) dist += (x[i] - cj[i]) * (x[i] - cj[i]);
            if (dist < best_d) best_d = dist, best = j;
          }
          of[static_cast<std::size_t>(h)][static_cast<std::size_t>(t)] = first_cluster + best;
          counts[static_cast<std::size_t>(best)] += 1;
          for (int i = 0; i < d; ++i) sums[static_cast<std::size_t>(best) * d + i] += x[i];
        }
        for (int j = 0; j < k; ++j) {
          if (counts[static_cast<std::size_t>(j)] == 0) continue;  // an empty cluster keeps its centre
          for (int i = 0; i < d; ++i) {
            centres[static_cast<std::size_t>(j) * d + i] =
                sums[static_cast<std::size_t>(j) * d + i] / static_cast<float>(counts[static_cast<std::size_t>(j)]);
          }
        }
      }
      first_cluster += k;
    }
    cluster_count_[static_cast<std::size_t>(layer) * H + h] = first_cluster;
  }
}

// grouped / clustered (RemainderMode): the centroid estimate over finer or key-shaped groups of the
// non-resident rows, from the mirror, into rem_out_ / rem_lse_.
template <class T>
void ExperimentSession<T>::mirror_estimate(int layer, const oasiskv::LayerView<T>& view, const float* q, int rows) {
  const int Q = c_.num_q_heads, G = c_.group_size(), d = c_.head_dim, H = c_.num_kv_heads;
  const std::int64_t n = mirror_.length(layer), bt = view.block_tokens;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  if (remainder_ == RemainderMode::clustered) make_clusters(layer);
  struct Group {
    std::int64_t count = 0;  // non-resident rows: the weight
    std::vector<float> key, value;
    std::int64_t mean_count = 0;  // rows of the means (remainder_whole_clusters_: the whole cluster's)
  };
  std::vector<Group> groups;
  for (int h = 0; h < H; ++h) {
    std::int32_t next = view.indptr[h];
    std::vector<std::int64_t> missing;
    for (std::int64_t b = 0; b * bt < n; ++b) {
      if (next < view.indptr[h + 1] && view.block[next] == b) ++next;
      else missing.push_back(b);
    }
    groups.clear();
    const std::int64_t clustered_rows =
        remainder_ == RemainderMode::clustered ? static_cast<std::int64_t>(cluster_of_[layer][h].size()) : 0;
    const std::int32_t clusters = remainder_ == RemainderMode::clustered ? cluster_count_[layer * H + h] : 0;
    groups.resize(static_cast<std::size_t>(clusters));
    auto add = [&](Group& g, std::int64_t t) {
      if (g.key.empty()) g.key.assign(static_cast<std::size_t>(d), 0.0f), g.value.assign(static_cast<std::size_t>(d), 0.0f);
      const float* k = mirror_.key(layer, t) + h * d;
      const float* v = mirror_.value(layer, t) + h * d;
      for (int i = 0; i < d; ++i) g.key[i] += k[i], g.value[i] += v[i];
      g.count += 1;
    };
    for (std::int64_t b : missing) {
      const std::int64_t end = std::min(n, (b + 1) * bt);
      for (std::int64_t t0 = b * bt; t0 < end; t0 += remainder_group_rows_) {
        const std::size_t positional = groups.size();
        bool used = false;
        for (std::int64_t t = t0; t < std::min(end, t0 + remainder_group_rows_); ++t) {
          if (t < clustered_rows) {
            add(groups[static_cast<std::size_t>(cluster_of_[layer][h][static_cast<std::size_t>(t)])], t);
          } else {
            if (!used) groups.emplace_back(), used = true;
            add(groups[positional], t);
          }
        }
      }
    }
    for (auto& g : groups) g.mean_count = g.count;
    if (remainder_whole_clusters_) {
      // The means of whole clusters (resident rows included): only the counts of their
      // non-resident rows are needed per step, not the resident rows themselves.
      for (std::int32_t c = 0; c < clusters; ++c) {  // the positional groups after them keep their sums
        Group& g = groups[static_cast<std::size_t>(c)];
        std::fill(g.key.begin(), g.key.end(), 0.0f);
        std::fill(g.value.begin(), g.value.end(), 0.0f);
        g.mean_count = 0;
      }
      for (std::int64_t t = 0; t < clustered_rows; ++t) {
        Group& g = groups[static_cast<std::size_t>(cluster_of_[layer][h][static_cast<std::size_t>(t)])];
        if (g.count == 0) continue;
        const float* k = mirror_.key(layer, t) + h * d;
        const float* v = mirror_.value(layer, t) + h * d;
        for (int i = 0; i < d; ++i) g.key[i] += k[i], g.value[i] += v[i];
        g.mean_count += 1;
      }
    }
    std::vector<float> logit(groups.size());
    for (int r = 0; r < rows; ++r) {
      for (int g = h * G; g < (h + 1) * G; ++g) {
        const std::size_t state = static_cast<std::size_t>(r) * Q + g;
        const float* qv = q + state * d;
        float m = -INFINITY;
        for (std::size_t j = 0; j < groups.size(); ++j) {
          logit[j] = -INFINITY;
          if (groups[j].count == 0) continue;
          const float inv = 1.0f / static_cast<float>(groups[j].mean_count);
          float dot = 0.0f;
          for (int i = 0; i < d; ++i) dot += qv[i] * groups[j].key[i] * inv;
          logit[j] = std::log(static_cast<float>(groups[j].count)) + scale * dot;
          m = std::max(m, logit[j]);
        }
        float* o = rem_out_.data() + state * d;
        if (m == -INFINITY) continue;  // nothing missing: zero mass (rem_lse_ stays -inf)
        float sum = 0.0f;
        for (std::size_t j = 0; j < groups.size(); ++j) {
          if (logit[j] == -INFINITY) continue;
          const float w = std::exp(logit[j] - m);
          sum += w;
          const float wv = w / static_cast<float>(groups[j].mean_count);
          for (int i = 0; i < d; ++i) o[i] += wv * groups[j].value[i];
        }
        for (int i = 0; i < d; ++i) o[i] /= sum;
        rem_lse_[state] = m + std::log(sum);
      }
    }
  }
}

// quantized: rows [t0, t1) of kv head h, keys rounded per channel over the rows, values per row in
// groups of 32 channels, to remainder_bits_ / remainder_value_bits_ bits (min/max asymmetric, round to
// nearest).
template <class T>
void ExperimentSession<T>::quantize_block(int layer, int h, std::int64_t t0, std::int64_t t1, std::vector<float>& k,
                                          std::vector<float>& v) const {
  const int d = c_.head_dim;
  const auto rows = static_cast<std::size_t>(t1 - t0);
  k.resize(rows * d);
  v.resize(rows * d);
  const float key_levels = static_cast<float>((1 << remainder_bits_) - 1);
  const float value_levels = static_cast<float>((1 << remainder_value_bits_) - 1);
  auto round_run = [&](float lo, float hi, float x, float levels) {
    if (hi <= lo) return lo;
    const float step = (hi - lo) / levels;
    return lo + std::nearbyint((x - lo) / step) * step;
  };
  for (int i = 0; i < d; ++i) {
    float lo = INFINITY, hi = -INFINITY;
    for (std::int64_t t = t0; t < t1; ++t) lo = std::min(lo, mirror_.key(layer, t)[h * d + i]), hi = std::max(hi, mirror_.key(layer, t)[h * d + i]);
    for (std::int64_t t = t0; t < t1; ++t) k[(t - t0) * d + i] = round_run(lo, hi, mirror_.key(layer, t)[h * d + i], key_levels);
  }
  for (std::int64_t t = t0; t < t1; ++t) {
    const float* x = mirror_.value(layer, t) + h * d;
    for (int g0 = 0; g0 < d; g0 += 32) {
      const int g1 = std::min(d, g0 + 32);
      float lo = INFINITY, hi = -INFINITY;
      for (int i = g0; i < g1; ++i) lo = std::min(lo, x[i]), hi = std::max(hi, x[i]);
      for (int i = g0; i < g1; ++i) v[(t - t0) * d + i] = round_run(lo, hi, x[i], value_levels);
    }
  }
}

template <class T>
void ExperimentSession<T>::merge_remainder(int layer, const oasiskv::Ticket& ticket, const oasiskv::LayerView<T>& view,
                                           const float* q, int rows, float* out, float* lse) {
  const int Q = c_.num_q_heads, G = c_.group_size(), d = c_.head_dim;
  const auto states = static_cast<std::size_t>(rows) * static_cast<std::size_t>(Q);
  rem_out_.assign(states * static_cast<std::size_t>(d), 0.0f);
  rem_lse_.assign(states, -INFINITY);
  if (remainder_ == RemainderMode::estimate) {
    const auto& planned = planned_q_[static_cast<std::size_t>(layer)];
    if (remainder_query_ == RemainderQuery::prefetch && !planned.empty()) {
      // The current row's estimate from the lookahead query that planned this step.
      rem_q_.assign(q, q + static_cast<std::size_t>(rows) * c_.q_width());
      std::copy(planned.begin(), planned.end(), rem_q_.begin());
      q = rem_q_.data();
    }
    cache_.remainder(ticket, oasiskv::rows_view(q, rows), rem_out_, rem_lse_);
    if (remainder_mass_scale_ != 1.0f) {
      const float shift = std::log(remainder_mass_scale_);
      for (float& v : rem_lse_) v += shift;
    }
  } else if (remainder_ == RemainderMode::grouped || remainder_ == RemainderMode::clustered) {
    mirror_estimate(layer, view, q, rows);
  } else {
    // The ceiling: the exact attention over every block the view leaves out, from the mirror.
    const std::int64_t n = mirror_.length(layer), bt = view.block_tokens;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    std::vector<float> qk, qv;
    for (int h = 0; h < c_.num_kv_heads; ++h) {
      std::int32_t next = view.indptr[h];
      std::vector<std::int64_t> missing;
      for (std::int64_t b = 0; b * bt < n; ++b) {
        if (next < view.indptr[h + 1] && view.block[next] == b) ++next;
        else missing.push_back(b);
      }
      for (int r = 0; r < rows; ++r) {
        for (int g = h * G; g < (h + 1) * G; ++g) {
          const std::size_t state = static_cast<std::size_t>(r) * Q + g;
          oasiskv::SoftmaxAccumulator acc(d);
          for (std::int64_t b : missing) {
            const std::int64_t t0 = b * bt, t1 = std::min(n, (b + 1) * bt);
            if (remainder_ == RemainderMode::quantized) {
              quantize_block(layer, h, t0, t1, qk, qv);
              // The rounding noise of the keys raises each logit's exp by exp(variance / 2) on average
              // (uniform noise of variance step^2 / 12 per channel): take it back out.
              float shift = 0.0f;
              if (remainder_debias_) {
                const float levels = static_cast<float>((1 << remainder_bits_) - 1);
                for (int i = 0; i < d; ++i) {
                  float lo = INFINITY, hi = -INFINITY;
                  for (std::int64_t t = t0; t < t1; ++t) {
                    lo = std::min(lo, mirror_.key(layer, t)[h * d + i]), hi = std::max(hi, mirror_.key(layer, t)[h * d + i]);
                  }
                  const float step = (hi - lo) / levels, qi = q[state * d + i] * scale;
                  shift += qi * qi * step * step / 12.0f;
                }
                shift *= 0.5f;
              }
              for (std::int64_t t = t0; t < t1; ++t) {
                acc.add(q + state * d, qk.data() + (t - t0) * d, qv.data() + (t - t0) * d, scale, -shift);
              }
              continue;
            }
            for (std::int64_t t = t0; t < t1; ++t) {
              acc.add(q + state * d, mirror_.key(layer, t) + h * d, mirror_.value(layer, t) + h * d, scale);
            }
          }
          acc.finish(rem_out_.data() + state * d);
          rem_lse_[state] = acc.log_sum_exp();
        }
      }
    }
  }
  row0_lse_.assign(lse, lse + Q);
  row0_rem_lse_.assign(rem_lse_.begin(), rem_lse_.begin() + Q);
  oasiskv::merge_states(out, lse, rem_out_.data(), rem_lse_.data(), static_cast<std::int64_t>(states), d);
}

template <class T>
void ExperimentSession<T>::start(const std::vector<std::vector<float>>& lookahead_queries, int next_step_rows) {
  const oasiskv::SeqId batch[] = {kSequence};
  for (int l = 0; l < c_.num_layers; ++l) {
    const auto q = oasiskv::rows_view(lookahead_queries[l].data(), 1);
    tickets_[l] = cache_.prefetch(batch, l, q, next_step_rows);
    drafted_[l] = cache_.select_blocks(kSequence, l, q);
    planned_q_[l] = lookahead_queries[l];
  }
}

template <class T>
std::vector<float> ExperimentSession<T>::step(std::int32_t token, std::optional<std::int32_t> draft, StepMetrics* metrics) {
  const oasiskv::SeqId batch[] = {kSequence};
  ForwardRows<T> f(model_, token, draft ? std::span(&*draft, 1) : std::span<const std::int32_t>(),
                   static_cast<std::int32_t>(length()));
  const int rows = f.rows;
  if (metrics) reset_metrics(*metrics);
  for (int l = 0; l < c_.num_layers; ++l) {
    f.attention_inputs(l);
    const auto q_current = oasiskv::rows_view(f.q.data(), 1);
    if (metrics) measure_agreement(l, f.q.data(), *metrics);
    f.kv_rows(k_rows_, v_rows_);
    cache_.append(batch, l, oasiskv::rows_view(k_rows_.data(), 1), oasiskv::rows_view(v_rows_.data(), 1));
    mirror_append(l, 1);
    const auto q_lookahead = oasiskv::rows_view(f.q_row(rows - 1), 1);
    oasiskv::Ticket next = cache_.prefetch(batch, l, q_lookahead);
    if (metrics) drafted_[l] = cache_.select_blocks(kSequence, l, q_lookahead);
    const oasiskv::Ticket& current = tickets_[l];
    cache_.attend(current, [&](const oasiskv::LayerView<T>& view) {
      const bool merging = remainder_ != RemainderMode::none && l >= remainder_first_layer_;
      lse_.resize(static_cast<std::size_t>(rows) * c_.num_q_heads);
      float* lse = merging ? lse_.data() : nullptr;
      if (rows == 2) {  // as OasisKvSession::step: the lookahead row also sees its own k, v
        attend_view_step_rows<T>(c_, view, f.q.data(), k_rows_.data() + c_.kv_width(), v_rows_.data() + c_.kv_width(),
                                 f.out.data(), fast_, lse);
      } else {
        attend_view_row<T>(c_, view, f.q.data(), nullptr, nullptr, 0, f.out.data(), INT64_MAX, fast_, lse);
      }
      if (merging) merge_remainder(l, current, view, f.q.data(), rows, f.out.data(), lse_.data());
      if (metrics) {
        cache_.observe(current, q_current);
        measure(l, f.q.data(), view, f.out.data(), mirror_.length(l), *metrics);
      }
    });
    tickets_[l] = std::move(next);
    planned_q_[l].assign(f.q_row(rows - 1), f.q_row(rows));
    f.attention_output_and_mlp(l, rows);
  }
  length_ += 1;
  return f.first_row_logits();
}

template <class T>
void ExperimentSession<T>::reset_metrics(StepMetrics& m) const {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  m.agreement.assign(static_cast<std::size_t>(c_.num_layers) * c_.num_kv_heads, nan);
  m.mass_recall.assign(m.agreement.size(), nan);
  m.exact_topk_mass.assign(m.agreement.size(), nan);
  if (m.want_curves) m.topk_mass_curve.assign(m.agreement.size(), {});
  m.attn_rel_err.assign(static_cast<std::size_t>(c_.num_layers), nan);
  m.dropped_mass_true.assign(static_cast<std::size_t>(c_.num_layers) * c_.num_q_heads, nan);
  m.dropped_mass_est.assign(m.dropped_mass_true.size(), nan);
}

// S_true of the current row on the cache state the previous plan saw (before this append),
// against S_draft, the selection of that plan's queries.
template <class T>
void ExperimentSession<T>::measure_agreement(int layer, const float* q_current, StepMetrics& m) {
  const int H = c_.num_kv_heads;
  const auto truth = cache_.select_blocks(kSequence, layer, oasiskv::rows_view(q_current, 1));
  for (int h = 0; h < H; ++h) {
    const auto& t = truth[h];
    const auto& s = drafted_[layer][h];
    if (t.empty()) continue;
    std::size_t hits = 0;
    for (auto b : t) hits += std::find(s.begin(), s.end(), b) != s.end();
    m.agreement[static_cast<std::size_t>(layer) * H + h] = static_cast<double>(hits) / static_cast<double>(t.size());
  }
}

template <class T>
std::vector<std::vector<float>> ExperimentSession<T>::speculate(std::int32_t token, std::span<const std::int32_t> drafts,
                                                        StepMetrics* metrics) {
  const oasiskv::SeqId batch[] = {kSequence};
  const auto p = static_cast<std::int32_t>(length());
  ForwardRows<T> f(model_, token, drafts, p);
  const int rows = f.rows;
  const std::int32_t n_rows[] = {rows};
  if (metrics) reset_metrics(*metrics);
  for (int l = 0; l < c_.num_layers; ++l) {
    f.attention_inputs(l);
    if (metrics) measure_agreement(l, f.q.data(), *metrics);
    f.kv_rows(k_rows_, v_rows_);
    cache_.append(batch, l, n_rows, oasiskv::rows_view(k_rows_.data(), rows), oasiskv::rows_view(v_rows_.data(), rows));
    mirror_append(l, rows);
    cache_.attend(tickets_[l], [&](const oasiskv::LayerView<T>& view) {
      const bool merging = remainder_ != RemainderMode::none && l >= remainder_first_layer_;
      lse_.resize(static_cast<std::size_t>(rows) * c_.num_q_heads);
      for (int r = 0; r < rows; ++r) {
        attend_view_row<T>(c_, view, f.q_row(r), nullptr, nullptr, 0, f.out_row(r), p + r, fast_,
                           merging ? lse_.data() + static_cast<std::size_t>(r) * c_.num_q_heads : nullptr);
      }
      if (merging) merge_remainder(l, tickets_[l], view, f.q.data(), rows, f.out.data(), lse_.data());
      if (metrics) {
        cache_.observe(tickets_[l], oasiskv::rows_view(f.q.data(), 1));
        measure(l, f.q.data(), view, f.out.data(), p + 1, *metrics);
      }
    });
    speculated_q_[l] = f.q;
    f.attention_output_and_mlp(l, rows);
  }
  speculated_rows_ = rows;
  length_ += rows;
  return f.logits();
}

template <class T>
void ExperimentSession<T>::accept(int rows, int next_step_rows) {
  if (rows < 1 || rows > speculated_rows_) {
    throw std::invalid_argument("accept: " + std::to_string(rows) + " rows of a " + std::to_string(speculated_rows_) +
                                "-row speculative step");
  }
  const std::int64_t keep = length() - speculated_rows_ + rows;
  if (rows < speculated_rows_) {
    cache_.truncate(kSequence, keep);
    mirror_.truncate(keep);
    length_ = keep;
  }
  // Plan the next step from the rows at and after the cut (or the last row when all were kept).
  const int first = rows < speculated_rows_ ? rows : speculated_rows_ - 1;
  const oasiskv::SeqId batch[] = {kSequence};
  for (int l = 0; l < c_.num_layers; ++l) {
    const float* q = speculated_q_[l].data() + static_cast<std::size_t>(first) * c_.q_width();
    const auto lookahead = oasiskv::rows_view(q, speculated_rows_ - first);
    tickets_[l] = cache_.prefetch(batch, l, lookahead, next_step_rows > 0 ? next_step_rows : speculated_rows_);
    drafted_[l] = cache_.select_blocks(kSequence, l, lookahead);
    planned_q_[l].assign(q, q + c_.q_width());
  }
  speculated_rows_ = 0;
}

template <class T>
void ExperimentSession<T>::measure(int layer, const float* q_current, const oasiskv::LayerView<T>& view,
                                   const float* sparse_out, std::int64_t n, StepMetrics& m) {
  const int H = c_.num_kv_heads, G = c_.group_size(), d = c_.head_dim;
  const auto& layout = cache_.layout();
  const std::int64_t bt = layout.config.block_tokens;
  const std::int64_t n_blocks = layout.blocks_for(n);
  const std::int64_t ring_first = layout.ring_start(n);
  std::vector<float> dense_out(static_cast<std::size_t>(c_.q_width()), 0.0f);
  // One task per kv head: each writes its own heads' outputs and entries of m.
  engine_pool().run(H, [&](int h) {
    std::vector<float> probs(static_cast<std::size_t>(n));
    std::vector<double> block_mass(static_cast<std::size_t>(n_blocks), 0.0);
    double resident_mass = 0.0;
    for (int g = h * G; g < (h + 1) * G; ++g) {
      const double resident_before = resident_mass;
      attention_probabilities(c_, mirror_, layer, n, q_current + g * d, h, probs.data());
      float* o = dense_out.data() + g * d;  // dense attention output from the same probabilities
      for (std::int64_t t = 0; t < n; ++t) {
        const float* vt = mirror_.value(layer, t) + h * d;
        for (int i = 0; i < d; ++i) o[i] += probs[t] * vt[i];
      }
      for (std::int64_t t = 0; t < n; ++t) block_mass[t / bt] += probs[t];
      for (std::int32_t e = view.indptr[h]; e < view.indptr[h + 1]; ++e) {
        const std::int64_t first = static_cast<std::int64_t>(view.block[e]) * bt;
        for (std::int32_t r = 0; r < view.valid_tokens[e] && first + r < n; ++r) resident_mass += probs[first + r];
      }
      if (remainder_ != RemainderMode::none && layer >= remainder_first_layer_) {
        // The remainder's share of the merged state: e^rem / (e^view + e^rem).
        const std::size_t gi = static_cast<std::size_t>(layer) * c_.num_q_heads + g;
        const double a = row0_lse_[g], b = row0_rem_lse_[g];
        m.dropped_mass_true[gi] = 1.0 - (resident_mass - resident_before);
        m.dropped_mass_est[gi] = b == -INFINITY ? 0.0 : 1.0 / (1.0 + std::exp(a - b));
      }
    }
    // Best any selector could do with this budget: the pinned blocks plus the heaviest
    // selectable ones (mass summed over the group, as the cache keeps one set per kv head).
    double best = 0.0;
    std::vector<double> candidates;
    for (std::int64_t b = 0; b < n_blocks; ++b) {
      if (b < layout.sink_blocks || b >= ring_first) best += block_mass[b];
      else candidates.push_back(block_mass[b]);
    }
    const auto keep =
        std::min<std::size_t>(candidates.size(), static_cast<std::size_t>(layout.head_selectable_blocks(layer, h)));
    const std::size_t idx = static_cast<std::size_t>(layer) * H + h;
    if (m.want_curves) {
      std::sort(candidates.begin(), candidates.end(), std::greater<>());
      std::vector<double>& curve = m.topk_mass_curve[idx];
      curve.assign(1, best / G);
      double sum = best;
      for (double x : candidates) curve.push_back((sum += x) / G);
    } else {
      std::nth_element(candidates.begin(), candidates.begin() + static_cast<std::ptrdiff_t>(keep), candidates.end(),
                       std::greater<>());
    }
    for (std::size_t i = 0; i < keep; ++i) best += candidates[i];
    m.mass_recall[idx] = resident_mass / G;
    m.exact_topk_mass[idx] = best / G;
  });
  double diff = 0.0, norm = 0.0;
  for (int i = 0; i < c_.q_width(); ++i) {
    diff += (sparse_out[i] - dense_out[i]) * static_cast<double>(sparse_out[i] - dense_out[i]);
    norm += static_cast<double>(dense_out[i]) * dense_out[i];
  }
  m.attn_rel_err[layer] = std::sqrt(diff / std::max(norm, 1e-30));
}

template <class T>
void ExperimentSession<T>::mirror_append(int layer, int rows) {
  // The rows as the cache keeps them (rounded to fp16 when T is), widened back to float.
  thread_local std::vector<float> k, v;
  k.resize(k_rows_.size());
  v.resize(v_rows_.size());
  for (std::size_t i = 0; i < k.size(); ++i) {
    k[i] = oasiskv::to_float(k_rows_[i]);
    v[i] = oasiskv::to_float(v_rows_[i]);
  }
  mirror_.append(layer, k.data(), v.data(), rows);
}

template class ExperimentSession<float>;
template class ExperimentSession<oasiskv::fp16_t>;

}  // namespace smollm2
