// RemainderEstimate::clusters: the estimate against the whole-cluster formula on the cache's
// own clustering (appends that fill segments, truncates into them, forks), and its gain over the
// block centroid on keys whose clusters are scattered over positions.
#include <algorithm>
#include <cmath>
#include <map>

#include "reference_remainder.hpp"
#include "support.hpp"

using namespace oasiskv;
using namespace oasiskv::test;

namespace {

// RemainderEstimate::clusters through appends that fill segments, a truncate into a clustered
// segment (it is forgotten, then clustered again from the new rows) and a fork (the segments
// wholly below the fork point are copied), against brute_force_clusters.
template <class T>
void clusters_against_brute_force() {
  OASISKV_SEEDED_RNG(rng);
  CacheConfig c = test::small_config(96, 4096, 3);
  c.remainder = RemainderEstimate::clusters;
  Cache<cpu, T> cache(c);
  const auto& kc = clusters_of(cache).key_clusters();
  std::map<SeqId, Rows<T>> rows;
  cache.add_sequence(1);
  cache.add_sequence(2);
  append_random(cache, rows, 1, 2500, rng);  // segments 0 and 1 filled
  append_random(cache, rows, 2, 1100, rng);  // segment 0
  const auto slot = [&](SeqId id) { return cache.block_table().find(id); };
  CHECK(kc.clustered(slot(1), 1, 1, 1));
  CHECK_FALSE(kc.clustered(slot(1), 1, 1, 2));
  CHECK(kc.clustered(slot(2), 0, 0, 0));
  CHECK_FALSE(kc.clustered(slot(2), 0, 0, 1));
  check_against_brute_force(cache, rows, {1, 2}, 1, rng);
  append_random(cache, rows, 2, 940, rng);  // 2,040: segment 1 not yet full
  CHECK_FALSE(kc.clustered(slot(2), 0, 1, 1));
  for (int step = 0; step < 9; ++step) append_random(cache, rows, 2, 1, rng);  // the 2,048th row fills it
  CHECK(kc.clustered(slot(2), 0, 1, 1));
  check_against_brute_force(cache, rows, {1, 2}, 2, rng);
  cache.truncate(1, 1500);
  for (auto& k : rows[1].k) k.resize(static_cast<std::size_t>(1500 * c.shape.num_kv_heads * c.shape.head_dim));
  for (auto& v : rows[1].v) v.resize(static_cast<std::size_t>(1500 * c.shape.num_kv_heads * c.shape.head_dim));
  CHECK(kc.clustered(slot(1), 0, 0, 0));
  CHECK_FALSE(kc.clustered(slot(1), 0, 0, 1));
  check_against_brute_force(cache, rows, {1}, 1, rng);
  append_random(cache, rows, 1, 600, rng);  // segment 1 again, from the new rows
  CHECK(kc.clustered(slot(1), 1, 0, 1));
  cache.fork(2, 3, 1900);
  rows[3] = rows[2];
  for (auto& k : rows[3].k) k.resize(static_cast<std::size_t>(1900 * c.shape.num_kv_heads * c.shape.head_dim));
  for (auto& v : rows[3].v) v.resize(static_cast<std::size_t>(1900 * c.shape.num_kv_heads * c.shape.head_dim));
  CHECK(kc.clustered(slot(3), 1, 1, 0));
  CHECK_FALSE(kc.clustered(slot(3), 1, 1, 1));
  append_random(cache, rows, 3, 5, rng);
  check_against_brute_force(cache, rows, {1, 2, 3}, 1, rng);
  cache.remove_sequence(1);  // a new sequence in its slot starts with nothing clustered
  cache.add_sequence(4);
  REQUIRE(slot(4) >= 0);
  for (int l = 0; l < c.shape.num_layers; ++l) CHECK_FALSE(kc.clustered(slot(4), l, 0, 0));
}

}  // namespace

TEST_CASE("clusters: the estimate is the whole-cluster formula on the cache's clustering (append, truncate, fork)") {
  SUBCASE("float rows") { clusters_against_brute_force<float>(); }
  SUBCASE("fp16 rows") { clusters_against_brute_force<fp16_t>(); }
}

// Keys around 48 centres, each centre's rows scattered over the sequence (so a block mixes many
// centres, as text does): the clusters' estimate of the non-resident attention is much closer to
// the exact one than the block centroid's.
TEST_CASE("clusters: on keys around centres scattered over positions, the estimate beats the block centroid") {
  OASISKV_SEEDED_RNG(rng);
  const int len = 2100, centres = 48;
  CacheConfig c = test::small_config(128, 4096, 1);
  std::normal_distribution<float> unit(0.0f, 1.0f);
  const int H = c.shape.num_kv_heads, d = c.shape.head_dim, Q = c.shape.num_q_heads;
  std::vector<float> kc(static_cast<std::size_t>(centres * H * d)), vc(kc.size());
  for (float& x : kc) x = 1.5f * unit(rng);
  for (float& x : vc) x = unit(rng);
  std::vector<float> k(static_cast<std::size_t>(len * H * d)), v(k.size());
  std::uniform_int_distribution<int> pick(0, centres - 1);
  for (int t = 0; t < len; ++t) {
    for (int h = 0; h < H; ++h) {
      const int m = pick(rng);
      for (int i = 0; i < d; ++i) {
        const std::size_t at = (static_cast<std::size_t>(t) * H + h) * d + i, from = (static_cast<std::size_t>(m) * H + h) * d + i;
        k[at] = kc[from] + 0.1f * unit(rng);
        v[at] = vc[from] + 0.1f * unit(rng);
      }
    }
  }
  const auto q = test::random_rows<float>(rng, static_cast<std::size_t>(Q * d), 2.0f);
  double error[2] = {0, 0};  // the block centroid (brute_force_centroid, in double), the cache's clusters
  c.remainder = RemainderEstimate::clusters;
  const float scale = CacheLayout::from(c).softmax_scale;
  with_one_sequence_remainder(c, k, v, len, q, [&](const LayerView<float>& view, const std::vector<float>& out,
                                                  const std::vector<float>& lse) {
    for (int g = 0; g < Q; ++g) {
      const int h = g / (Q / H);
      std::vector<std::int32_t> resident(view.block + view.indptr[h], view.block + view.indptr[h + 1]);
      // The exact attention over the rows of the blocks not resident, in double.
      double top = -INFINITY;
      std::vector<double> logits;
      for (int tok = 0; tok < len; ++tok) {
        if (std::find(resident.begin(), resident.end(), tok / 16) != resident.end()) continue;
        double dot = 0;
        for (int i = 0; i < d; ++i) dot += q[static_cast<std::size_t>(g * d + i)] * k[(static_cast<std::size_t>(tok) * H + h) * d + i];
        logits.push_back(dot * scale);
        top = std::max(top, logits.back());
      }
      double total = 0;
      std::vector<double> exact(static_cast<std::size_t>(d), 0.0);
      std::size_t j = 0;
      for (int tok = 0; tok < len; ++tok) {
        if (std::find(resident.begin(), resident.end(), tok / 16) != resident.end()) continue;
        const double w = std::exp(logits[j++] - top);
        total += w;
        for (int i = 0; i < d; ++i) exact[static_cast<std::size_t>(i)] += w * v[(static_cast<std::size_t>(tok) * H + h) * d + i];
      }
      const double exact_lse = top + std::log(total);
      std::vector<double> block_out;
      double block_lse = 0;
      brute_force_centroid(k, v, len, H, h, d, 16, resident, q.data() + g * d, scale, block_out, block_lse);
      double e0 = std::fabs(block_lse - exact_lse), e1 = std::fabs(lse[static_cast<std::size_t>(g)] - exact_lse);
      for (int i = 0; i < d; ++i) {
        const double x = exact[static_cast<std::size_t>(i)] / total;
        e0 += std::fabs(block_out[static_cast<std::size_t>(i)] - x);
        e1 += std::fabs(out[static_cast<std::size_t>(g * d + i)] - x);
      }
      error[0] += e0;
      error[1] += e1;
    }
  });
  INFO("error: centroid " << error[0] << ", clusters " << error[1]);
  CHECK(error[1] < 0.5 * error[0]);
}
