#include "dense_attention.hpp"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include <oasiskv/cpu/attention.hpp>
#include <oasiskv/dtype.hpp>

#include "thread_pool.hpp"

namespace smollm2 {

namespace {

template <class T>
const T* kv_keys(const DenseKv& kv, int layer) {
  if constexpr (std::is_same_v<T, float>)
    return kv.keys(layer);
  else
    return kv.keys16(layer);
}
template <class T>
const T* kv_values(const DenseKv& kv, int layer) {
  if constexpr (std::is_same_v<T, float>)
    return kv.values(layer);
  else
    return kv.values16(layer);
}

// The library's kernels (oasiskv/cpu/attention.hpp): one segment per kv head over the cache's rows, and one
// over the scratch rows, which are rounded to the cache's precision as if they had been appended.
template <class T>
void attend_dense_row_fast(const ModelConfig& c, const DenseKv& kv, int layer, std::int64_t n, const float* q,
                           const float* extra_k, const float* extra_v, int extra_rows, float* out) {
  const int d = c.head_dim, H = c.num_kv_heads, W = c.kv_width();
  thread_local std::vector<T> ek, ev;
  ek.resize(static_cast<std::size_t>(extra_rows) * W);
  ev.resize(ek.size());
  for (std::size_t i = 0; i < ek.size(); ++i) {
    ek[i] = oasiskv::from_float<T>(extra_k[i]);
    ev[i] = oasiskv::from_float<T>(extra_v[i]);
  }
  thread_local std::vector<oasiskv::KvRows<T>> segments;
  thread_local std::vector<std::int32_t> indptr;
  segments.clear();
  indptr.assign(1, 0);
  for (int h = 0; h < H; ++h) {
    segments.push_back({kv_keys<T>(kv, layer) + h * d, kv_values<T>(kv, layer) + h * d, n, W});
    if (extra_rows > 0) segments.push_back({ek.data() + h * d, ev.data() + h * d, extra_rows, W});
    indptr.push_back(static_cast<std::int32_t>(segments.size()));
  }
  oasiskv::cpu_attend_query_row<T>(q, H, c.group_size(), d, 1.0f / std::sqrt(static_cast<float>(d)), segments, indptr,
                                   out, nullptr, engine_parallel_for());
}

}  // namespace

void attend_dense_row(const ModelConfig& c, const DenseKv& kv, int layer, std::int64_t n, const float* q,
                      const float* extra_k, const float* extra_v, int extra_rows, float* out, bool fast) {
  if (kv.precision() == KvPrecision::fp16)
    return attend_dense_row_fast<oasiskv::fp16_t>(c, kv, layer, n, q, extra_k, extra_v, extra_rows, out);
  if (fast) return attend_dense_row_fast<float>(c, kv, layer, n, q, extra_k, extra_v, extra_rows, out);
  const int d = c.head_dim, G = c.group_size();
  const std::int64_t total = n + extra_rows;
  std::vector<const float*> keys(static_cast<std::size_t>(total)), values(static_cast<std::size_t>(total));
  std::vector<float> scores(static_cast<std::size_t>(total) * G);
  for (int h = 0; h < c.num_kv_heads; ++h) {
    for (std::int64_t t = 0; t < n; ++t) {
      keys[t] = kv.key(layer, t) + h * d;
      values[t] = kv.value(layer, t) + h * d;
    }
    for (int e = 0; e < extra_rows; ++e) {
      keys[n + e] = extra_k + (static_cast<std::size_t>(e) * c.num_kv_heads + h) * d;
      values[n + e] = extra_v + (static_cast<std::size_t>(e) * c.num_kv_heads + h) * d;
    }
    attend_heads(q + h * G * d, G, keys.data(), values.data(), static_cast<int>(total), d, out + h * G * d,
                 scores.data());
  }
}

void attention_probabilities(const ModelConfig& c, const DenseKv& kv, int layer, std::int64_t n, const float* q_head,
                             int kv_head, float* probs) {
  const int d = c.head_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  float max_score = -INFINITY;
  for (std::int64_t t = 0; t < n; ++t) {
    probs[t] = dot(q_head, kv.key(layer, t) + kv_head * d, d) * scale;
    max_score = std::max(max_score, probs[t]);
  }
  double total = 0.0;
  for (std::int64_t t = 0; t < n; ++t) {
    probs[t] = std::exp(probs[t] - max_score);
    total += probs[t];
  }
  const float inv = static_cast<float>(1.0 / total);
  for (std::int64_t t = 0; t < n; ++t) probs[t] *= inv;
}

namespace {

// Causal attention of a chunk of query rows over every key up to each row's position, tiled like
// flash attention: a tile of keys (in L1) serves all query rows and GQA heads of a row tile, so
// a long prefill streams the keys once per row tile instead of once per (row, head). Online
// softmax keeps one running max, sum and accumulator per query vector.
void causal_attention(const ModelConfig& c, const DenseKv& kv, int layer, const float* q, int rows,
                      const std::int32_t* positions, float* out) {
  const int d = c.head_dim, G = c.group_size(), H = c.num_kv_heads;
  constexpr int kKeyTile = 64, kRowTile = 16;
  const int row_tiles = (rows + kRowTile - 1) / kRowTile;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  engine_pool().run(H * row_tiles, [&](int task) {
    const int h = task / row_tiles, rt = task % row_tiles;
    {
      const int ra = rt * kRowTile, rb = std::min(rows, ra + kRowTile);
      const int nq = (rb - ra) * G;
      std::vector<float> running_max(nq, -INFINITY), running_sum(nq, 0.0f), acc(static_cast<std::size_t>(nq) * d, 0.0f);
      float s[kKeyTile];
      const std::int64_t end = positions[rb - 1] + 1;
      for (std::int64_t t0 = 0; t0 < end; t0 += kKeyTile) {
        const std::int64_t t1 = std::min<std::int64_t>(end, t0 + kKeyTile);
        for (int r = ra; r < rb; ++r) {
          const std::int64_t limit = std::min<std::int64_t>(t1, positions[r] + 1);
          if (limit <= t0) continue;
          for (int gi = 0; gi < G; ++gi) {
            const int qi = (r - ra) * G + gi;
            const float* qv = q + (static_cast<std::size_t>(r) * c.num_q_heads + h * G + gi) * d;
            float tile_max = -INFINITY;
            for (std::int64_t t = t0; t < limit; ++t) {
              s[t - t0] = dot(qv, kv.key(layer, t) + h * d, d) * scale;
              tile_max = std::max(tile_max, s[t - t0]);
            }
            const float new_max = std::max(running_max[qi], tile_max);
            const float rescale = std::exp(running_max[qi] - new_max);
            float* a = acc.data() + static_cast<std::size_t>(qi) * d;
            running_sum[qi] *= rescale;
            for (int i = 0; i < d; ++i) a[i] *= rescale;
            for (std::int64_t t = t0; t < limit; ++t) {
              const float p = std::exp(s[t - t0] - new_max);
              running_sum[qi] += p;
              const float* v = kv.value(layer, t) + h * d;
              for (int i = 0; i < d; ++i) a[i] += p * v[i];
            }
            running_max[qi] = new_max;
          }
        }
      }
      for (int r = ra; r < rb; ++r)
        for (int gi = 0; gi < G; ++gi) {
          const int qi = (r - ra) * G + gi;
          float* o = out + (static_cast<std::size_t>(r) * c.num_q_heads + h * G + gi) * d;
          for (int i = 0; i < d; ++i) o[i] = acc[static_cast<std::size_t>(qi) * d + i] / running_sum[qi];
        }
    }
  });
}

// The library's kernels: tasks of a few query rows per kv head, so that each tile of keys is
// converted once for the rows of a task.
template <class T>
void causal_attention_fast(const ModelConfig& c, const DenseKv& kv, int layer, const float* q, int rows,
                           const std::int32_t* positions, float* out) {
  const int d = c.head_dim, G = c.group_size(), H = c.num_kv_heads, W = c.kv_width();
  constexpr int kRowsPerTask = 16;
  const int row_tasks = (rows + kRowsPerTask - 1) / kRowsPerTask;
  const std::int64_t stride = static_cast<std::int64_t>(c.num_q_heads) * d;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  engine_pool().run(H * row_tasks, [&](int task) {
    const int h = task % H, r0 = (task / H) * kRowsPerTask, n = std::min(rows, r0 + kRowsPerTask) - r0;
    const oasiskv::KvRows<T> all{kv_keys<T>(kv, layer) + h * d, kv_values<T>(kv, layer) + h * d, kv.length(layer), W};
    const std::size_t at = (static_cast<std::size_t>(r0) * c.num_q_heads + static_cast<std::size_t>(h) * G) * d;
    oasiskv::cpu_attend_causal<T>(q + at, stride, n, positions + r0, G, d, scale, all, out + at, stride);
  });
}

}  // namespace

PrefillResult prefill(const LlamaModel& model, DenseKv& kv, std::span<const std::int32_t> tokens, bool keep_all_logits,
                      int chunk_rows) {
  const ModelConfig& c = model.config();
  PrefillResult result;
  result.last_queries.assign(c.num_layers, std::vector<float>(c.q_width()));
  if (keep_all_logits) result.all_logits.resize(tokens.size() * static_cast<std::size_t>(c.vocab_size));
  const std::int64_t start = kv.length(0);
  const bool fast = model.fast_kernels();
  const int n_tokens = static_cast<int>(tokens.size());
  for (int c0 = 0; c0 < n_tokens; c0 += chunk_rows) {
    const int rows = std::min(chunk_rows, n_tokens - c0);
    std::vector<std::int32_t> positions(rows);
    for (int r = 0; r < rows; ++r) positions[r] = static_cast<std::int32_t>(start + c0 + r);
    std::vector<float> x(static_cast<std::size_t>(rows) * c.dim);
    model.embed(tokens.subspan(c0, rows), x.data());
    std::vector<float> q(static_cast<std::size_t>(rows) * c.q_width()),
        k(static_cast<std::size_t>(rows) * c.kv_width()), v(k.size()), out(q.size());
    for (int l = 0; l < c.num_layers; ++l) {
      model.attention_inputs(l, x.data(), rows, positions.data(), q.data(), k.data(), v.data());
      kv.append(l, k.data(), v.data(), rows);
      if (kv.precision() == KvPrecision::fp16) {
        causal_attention_fast<oasiskv::fp16_t>(c, kv, l, q.data(), rows, positions.data(), out.data());
      } else if (fast) {
        causal_attention_fast<float>(c, kv, l, q.data(), rows, positions.data(), out.data());
      } else {
        causal_attention(c, kv, l, q.data(), rows, positions.data(), out.data());
      }
      if (c0 + rows == n_tokens)
        std::copy_n(q.data() + static_cast<std::size_t>(rows - 1) * c.q_width(), c.q_width(),
                    result.last_queries[l].data());
      model.attention_output_and_mlp(l, x.data(), out.data(), rows);
    }
    if (keep_all_logits) {
      model.logits(x.data(), rows, result.all_logits.data() + static_cast<std::size_t>(c0) * c.vocab_size);
    } else if (c0 + rows == n_tokens) {
      result.last_logits.resize(c.vocab_size);
      model.logits(x.data() + static_cast<std::size_t>(rows - 1) * c.dim, 1, result.last_logits.data());
    }
  }
  if (keep_all_logits && n_tokens > 0)
    result.last_logits.assign(result.all_logits.end() - c.vocab_size, result.all_logits.end());
  return result;
}

std::vector<float> dense_decode_step(const LlamaModel& model, DenseKv& kv, std::int32_t token,
                                     std::vector<std::vector<float>>* queries, StepProfile* profile) {
  using P = StepProfile;
  const P::Phase whole{profile, &P::total_ns};
  const ModelConfig& c = model.config();
  const std::int32_t position = static_cast<std::int32_t>(kv.length(0));
  std::vector<float> x(c.dim), q(c.q_width()), k(c.kv_width()), v(c.kv_width()), out(c.q_width());
  model.embed(std::span(&token, 1), x.data());
  if (queries) queries->assign(c.num_layers, {});
  for (int l = 0; l < c.num_layers; ++l) {
    {
      const P::Phase phase{profile, &P::qkv_ns};
      model.attention_inputs(l, x.data(), 1, &position, q.data(), k.data(), v.data());
    }
    {
      const P::Phase phase{profile, &P::append_ns};
      kv.append(l, k.data(), v.data(), 1);
    }
    {
      const P::Phase phase{profile, &P::attention_ns};
      attend_dense_row(c, kv, l, kv.length(l), q.data(), nullptr, nullptr, 0, out.data(), model.fast_kernels());
    }
    if (queries) (*queries)[l] = q;
    const P::Phase phase{profile, &P::output_mlp_ns};
    model.attention_output_and_mlp(l, x.data(), out.data(), 1);
  }
  std::vector<float> logits(c.vocab_size);
  {
    const P::Phase phase{profile, &P::logits_ns};
    model.logits(x.data(), 1, logits.data());
  }
  if (profile != nullptr) ++profile->steps;
  return logits;
}

}  // namespace smollm2

namespace smollm2 {

std::vector<std::vector<float>> dense_row_queries(const LlamaModel& model, const DenseKv& kv, std::int32_t token,
                                                  std::int32_t position) {
  const ModelConfig& c = model.config();
  std::vector<float> x(c.dim), q(c.q_width()), k(c.kv_width()), v(c.kv_width()), out(c.q_width());
  std::vector<std::vector<float>> queries(c.num_layers);
  model.embed(std::span(&token, 1), x.data());
  for (int l = 0; l < c.num_layers; ++l) {
    model.attention_inputs(l, x.data(), 1, &position, q.data(), k.data(), v.data());
    attend_dense_row(c, kv, l, position, q.data(), k.data(), v.data(), 1, out.data(), model.fast_kernels());
    queries[l] = q;
    model.attention_output_and_mlp(l, x.data(), out.data(), 1);
  }
  return queries;
}

}  // namespace smollm2
