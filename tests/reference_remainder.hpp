// Reference remainder estimates for the remainder tests (test_remainder.cpp and
// test_remainder_*.cpp): the formulas of RemainderEstimate::clusters (block centroids and whole
// clusters) and ::quantized evaluated in double from the rows a test appended, and the checks of
// Cache::remainder against them after appends, truncates and forks. Written from the estimates'
// definitions, not from the library's code.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <vector>

#include "support.hpp"

namespace oasiskv::test {

// Every row of one sequence as the test appended it: [token][kv head][head_dim] per layer.
template <class T>
struct Rows {
  std::vector<std::vector<T>> k, v;  // [layer]
};

// The attention state of weights exp(logits[j]) over values means[j] ([j][d]): out and lse.
inline void softmax_of(const std::vector<double>& logits, const std::vector<double>& means, int d, std::vector<double>& out,
                       double& lse) {
  out.assign(static_cast<std::size_t>(d), 0.0);
  lse = -INFINITY;
  if (logits.empty()) return;
  const double top = *std::max_element(logits.begin(), logits.end());
  double total = 0;
  for (std::size_t j = 0; j < logits.size(); ++j) {
    const double w = std::exp(logits[j] - top);
    total += w;
    for (int i = 0; i < d; ++i) out[static_cast<std::size_t>(i)] += w * means[j * static_cast<std::size_t>(d) + static_cast<std::size_t>(i)];
  }
  for (double& x : out) x /= total;
  lse = top + std::log(total);
}

// A cache of `config` holding one sequence of `len` rows (layer 0), prefetched for query q; calls
// check(view, out, lse) with the acquired view and Cache::remainder's state for q.
template <class Check>
void with_one_sequence_remainder(const CacheConfig& config, const std::vector<float>& k, const std::vector<float>& v,
                                 int len, const std::vector<float>& q, Check&& check) {
  Cache<cpu, float> cache(config);
  cache.add_sequence(1);
  const SeqId batch[] = {1};
  const std::int32_t counts[] = {len};
  cache.append(batch, 0, counts, rows_view(k.data(), len), rows_view(v.data(), len));
  const Ticket t = cache.prefetch(batch, 0, rows_view(q.data(), 1));
  std::vector<float> out(q.size()), lse(static_cast<std::size_t>(config.shape.num_q_heads));
  cache.attend(t, [&](const LayerView<float>& view) {
    cache.remainder(t, rows_view(q.data(), 1), out, lse);
    check(view, out, lse);
  });
}

// The block centroid in double, from the rows: per block of the sequence not in `resident`,
// logit = log n + s q.mean(k), weight exp(logit), value mean(v) (what `clusters` gives the blocks
// of segments it has not clustered).
template <class T>
void brute_force_centroid(const std::vector<T>& k, const std::vector<T>& v, std::int64_t len, int H, int h, int d, int bt,
                          const std::vector<std::int32_t>& resident, const float* q, float scale, std::vector<double>& out,
                          double& lse) {
  std::vector<double> logits, means;
  const std::int64_t nb = (len + bt - 1) / bt;
  for (std::int64_t b = 0; b < nb; ++b) {
    if (std::find(resident.begin(), resident.end(), b) != resident.end()) continue;
    const std::int64_t first = b * bt, n = std::min<std::int64_t>(bt, len - first);
    double dot = 0;
    std::vector<double> vm(static_cast<std::size_t>(d), 0.0);
    for (int i = 0; i < d; ++i) {
      double sum = 0;
      for (std::int64_t t = first; t < first + n; ++t) {
        sum += to_float(k[static_cast<std::size_t>((t * H + h) * d + i)]);
        vm[static_cast<std::size_t>(i)] += to_float(v[static_cast<std::size_t>((t * H + h) * d + i)]) / static_cast<double>(n);
      }
      dot += q[i] * sum / static_cast<double>(n);
    }
    logits.push_back(std::log(static_cast<double>(n)) + scale * dot);
    means.insert(means.end(), vm.begin(), vm.end());
  }
  softmax_of(logits, means, d, out, lse);
}

// The clusters store of a cache with `remainder = clusters` (the engine holds it behind
// RemainderStore).
template <class T>
const detail::ClustersRemainder<T>& clusters_of(const Cache<cpu, T>& cache) {
  return dynamic_cast<const detail::ClustersRemainder<T>&>(*cache.backend().remainder_store());
}

template <class T>
void append_random(Cache<cpu, T>& cache, std::map<SeqId, Rows<T>>& rows, SeqId id, int n, std::mt19937_64& rng) {
  const auto& L = cache.layout();
  const SeqId batch[] = {id};
  const std::int32_t counts[] = {n};
  for (int l = 0; l < L.num_layers(); ++l) {
    const auto k = test::random_rows<T>(rng, static_cast<std::size_t>(n * L.row_elems));
    const auto v = test::random_rows<T>(rng, static_cast<std::size_t>(n * L.row_elems));
    cache.append(batch, l, counts, rows_view(k.data(), n), rows_view(v.data(), n));
    auto& r = rows[id];
    r.k.resize(static_cast<std::size_t>(L.num_layers()));
    r.v.resize(static_cast<std::size_t>(L.num_layers()));
    r.k[static_cast<std::size_t>(l)].insert(r.k[static_cast<std::size_t>(l)].end(), k.begin(), k.end());
    r.v[static_cast<std::size_t>(l)].insert(r.v[static_cast<std::size_t>(l)].end(), v.begin(), v.end());
  }
}

// RemainderEstimate::quantized from the rows: every block outside `resident` coded as
// quantized_rows.hpp says (keys per channel against the block's min/max, values per row in groups
// of 32 channels, round to nearest; written here from the format's definition), and the exact
// attention of q over the decoded rows, each score lowered by 0.5 s^2 sum_i q_i^2 step_i^2 / 12.
template <class T>
void brute_force_quantized(const std::vector<T>& k, const std::vector<T>& v, std::int64_t len, int H, int h, int d,
                           int bt, int bits, const std::vector<std::int32_t>& resident, const float* q, float scale,
                           std::vector<double>& out, double& lse) {
  const float levels = static_cast<float>((1 << bits) - 1);
  const auto round_to = [&](float x, float lo, float step) {
    if (!(step > 0.0f)) return lo;
    const float code = std::clamp(std::nearbyint((x - lo) / step), 0.0f, levels);
    return lo + code * step;
  };
  std::vector<double> logits, values;
  const std::int64_t nb = (len + bt - 1) / bt;
  for (std::int64_t b = 0; b < nb; ++b) {
    if (std::find(resident.begin(), resident.end(), b) != resident.end()) continue;
    const std::int64_t first = b * bt, n = std::min<std::int64_t>(bt, len - first);
    const auto key = [&](std::int64_t t, int i) { return to_float(k[static_cast<std::size_t>((t * H + h) * d + i)]); };
    const auto value = [&](std::int64_t t, int i) { return to_float(v[static_cast<std::size_t>((t * H + h) * d + i)]); };
    std::vector<float> lo(static_cast<std::size_t>(d), INFINITY), hi(static_cast<std::size_t>(d), -INFINITY);
    double offset = 0;
    for (int i = 0; i < d; ++i) {
      for (std::int64_t t = first; t < first + n; ++t) lo[i] = std::min(lo[i], key(t, i)), hi[i] = std::max(hi[i], key(t, i));
      const double step = hi[i] / levels - lo[i] / levels;
      offset += 0.5 * scale * scale * q[i] * q[i] * step * step / 12.0;
    }
    for (std::int64_t t = first; t < first + n; ++t) {
      double dot = 0;
      for (int i = 0; i < d; ++i) dot += q[i] * round_to(key(t, i), lo[i], (hi[i] - lo[i]) / levels);
      logits.push_back(scale * dot - offset);
      for (int g0 = 0; g0 < d; g0 += 32) {
        const int g1 = std::min(d, g0 + 32);
        float vlo = INFINITY, vhi = -INFINITY;
        for (int i = g0; i < g1; ++i) vlo = std::min(vlo, value(t, i)), vhi = std::max(vhi, value(t, i));
        for (int i = g0; i < g1; ++i) values.push_back(round_to(value(t, i), vlo, (vhi - vlo) / levels));
      }
    }
  }
  softmax_of(logits, values, d, out, lse);
}

// RemainderEstimate::clusters from the rows and the cache's clustering (its row ids, checked
// against its counts and sums here): each clustered segment's clusters with their means over all
// their rows, weighted by their rows outside `resident`; every other block outside `resident` as
// centroid (brute_force); the two states merged.
template <class T>
void brute_force_clusters(const detail::KeyClusters& kc, int slot, int layer, const std::vector<T>& k, const std::vector<T>& v,
                          std::int64_t len, int H, int h, int d, int bt, const std::vector<std::int32_t>& resident,
                          const float* q, float scale, std::vector<double>& out, double& lse) {
  const std::int64_t nb = (len + bt - 1) / bt;
  std::vector<std::int32_t> skip = resident;  // the blocks the cluster part covers join the resident ones
  std::vector<double> logits, means;
  for (std::int64_t s = 0; s < nb / kClusterSegmentBlocks; ++s) {
    if (!kc.clustered(slot, layer, h, s)) continue;
    for (std::int64_t b = s * kClusterSegmentBlocks; b < (s + 1) * kClusterSegmentBlocks; ++b) skip.push_back(static_cast<std::int32_t>(b));
    const std::uint8_t* ids = kc.ids(slot, layer, h, s);
    for (int c = 0; c < kc.clusters_per_segment(); ++c) {
      std::int64_t n = 0, left = 0;
      std::vector<double> km(static_cast<std::size_t>(d), 0.0), vm(static_cast<std::size_t>(d), 0.0);
      for (int r = 0; r < kc.segment_rows(); ++r) {
        if (ids[r] != c) continue;
        const std::int64_t t = s * kc.segment_rows() + r;
        ++n;
        const bool res = std::find(resident.begin(), resident.end(), static_cast<std::int32_t>(t / bt)) != resident.end();
        left += res ? 0 : 1;
        for (int i = 0; i < d; ++i) {
          km[static_cast<std::size_t>(i)] += to_float(k[static_cast<std::size_t>((t * H + h) * d + i)]);
          vm[static_cast<std::size_t>(i)] += to_float(v[static_cast<std::size_t>((t * H + h) * d + i)]);
        }
      }
      REQUIRE(n == kc.count(slot, layer, h, s, c));
      const float* sums = kc.sums(slot, layer, h, s, c);
      for (int i = 0; i < 2 * d; ++i) {
        const double want = i < d ? km[static_cast<std::size_t>(i)] : vm[static_cast<std::size_t>(i - d)];
        CHECK(sums[i] == doctest::Approx(want).epsilon(1e-4).scale(1.0));
      }
      if (left == 0) continue;
      double dot = 0;
      for (int i = 0; i < d; ++i) dot += q[i] * km[static_cast<std::size_t>(i)] / static_cast<double>(n);
      logits.push_back(std::log(static_cast<double>(left)) + scale * dot);
      for (int i = 0; i < d; ++i) means.push_back(vm[static_cast<std::size_t>(i)] / static_cast<double>(n));
    }
  }
  double block_lse = 0;
  std::vector<double> block_out;
  brute_force_centroid(k, v, len, H, h, d, bt, skip, q, scale, block_out, block_lse);
  if (block_lse != -INFINITY) {
    logits.push_back(block_lse);
    means.insert(means.end(), block_out.begin(), block_out.end());
  }
  softmax_of(logits, means, d, out, lse);
}

// Prefetches, acquires and checks cache.remainder for every layer of `ids` against brute_force,
// with `rows` query rows per sequence.
template <class T>
void check_against_brute_force(Cache<cpu, T>& cache, std::map<SeqId, Rows<T>>& rows, const std::vector<SeqId>& ids,
                               int qrows, std::mt19937_64& rng) {
  const auto& L = cache.layout();
  const int H = L.num_kv_heads(), G = L.group_size, d = L.head_dim(), Q = L.num_q_heads();
  for (int l = 0; l < L.num_layers(); ++l) {
    const auto q = test::random_rows<float>(rng, ids.size() * static_cast<std::size_t>(qrows * L.q_row_elems), 2.0f);
    const auto qv = rows_view(q.data(), static_cast<std::int64_t>(ids.size()) * qrows);
    const Ticket t = cache.prefetch(ids, l, qv);
    const LayerView<T> view = cache.acquire(t);
    std::vector<float> out(q.size()), lse(ids.size() * static_cast<std::size_t>(qrows * Q));
    cache.remainder(t, qv, out, lse);
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const std::int64_t len = view.seq_len[i];
      const auto& r = rows[ids[i]];
      for (int h = 0; h < H; ++h) {
        const int p = static_cast<int>(i) * H + h;
        std::vector<std::int32_t> resident(view.block + view.indptr[p], view.block + view.indptr[p + 1]);
        for (int row = 0; row < qrows; ++row) {
          for (int g = h * G; g < (h + 1) * G; ++g) {
            const std::size_t state = (i * static_cast<std::size_t>(qrows) + static_cast<std::size_t>(row)) * Q + g;
            std::vector<double> want;
            double want_lse = 0;
            if (L.config.remainder == RemainderEstimate::quantized) {
              brute_force_quantized(r.k[static_cast<std::size_t>(l)], r.v[static_cast<std::size_t>(l)], len, H, h, d,
                                    L.block_tokens(), L.config.remainder_bits, resident, q.data() + state * d,
                                    L.softmax_scale, want, want_lse);
            } else {
              brute_force_clusters(clusters_of(cache).key_clusters(), cache.block_table().find(ids[i]), l,
                                   r.k[static_cast<std::size_t>(l)], r.v[static_cast<std::size_t>(l)], len, H, h, d,
                                   L.block_tokens(), resident, q.data() + state * d, L.softmax_scale, want, want_lse);
            }
            INFO("layer " << l << " sequence " << ids[i] << " head " << g << " length " << len);
            if (want_lse == -INFINITY) {
              CHECK(lse[state] == -INFINITY);
            } else {
              CHECK(lse[state] == doctest::Approx(want_lse).epsilon(1e-4));
            }
            for (int c = 0; c < d; ++c) CHECK(out[state * d + c] == doctest::Approx(want[static_cast<std::size_t>(c)]).epsilon(1e-3).scale(1.0));
          }
        }
      }
    }
    cache.release(t);
  }
}

template <class T>
void random_against_brute_force(RemainderEstimate kind, int bits = 4, int head_dim = 16) {
  OASISKV_SEEDED_RNG(rng);
  CacheConfig c = test::small_config(96, 1024, 3);
  c.shape.head_dim = head_dim;
  c.remainder = kind;
  c.remainder_bits = bits;
  Cache<cpu, T> cache(c);
  std::map<SeqId, Rows<T>> rows;
  cache.add_sequence(1);
  cache.add_sequence(2);
  append_random(cache, rows, 1, 300, rng);  // a prompt of several blocks and a partial tail
  append_random(cache, rows, 2, 157, rng);
  check_against_brute_force(cache, rows, {1, 2}, 1, rng);
  for (int step = 0; step < 5; ++step) {  // decode rows, each folded into the tail block's sums
    append_random(cache, rows, 1, 1, rng);
    append_random(cache, rows, 2, 3, rng);
  }
  check_against_brute_force(cache, rows, {1, 2}, 2, rng);
  // A truncate mid-block: the partial block's sums are refolded from its rows.
  cache.truncate(1, 201);
  for (auto& k : rows[1].k) k.resize(static_cast<std::size_t>(201 * c.shape.num_kv_heads * c.shape.head_dim));
  for (auto& v : rows[1].v) v.resize(static_cast<std::size_t>(201 * c.shape.num_kv_heads * c.shape.head_dim));
  append_random(cache, rows, 1, 7, rng);
  // A fork mid-block: full blocks' sums copied, the partial one refolded.
  cache.fork(2, 3, 150);
  rows[3] = rows[2];
  for (auto& k : rows[3].k) k.resize(static_cast<std::size_t>(150 * c.shape.num_kv_heads * c.shape.head_dim));
  for (auto& v : rows[3].v) v.resize(static_cast<std::size_t>(150 * c.shape.num_kv_heads * c.shape.head_dim));
  append_random(cache, rows, 3, 5, rng);
  check_against_brute_force(cache, rows, {1, 2, 3}, 1, rng);
}

}  // namespace oasiskv::test
