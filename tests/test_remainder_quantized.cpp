// RemainderEstimate::quantized: the block codec (decode(encode(rows)) within half a step) and the
// state approaching the exact remainder as the bits grow.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "reference_remainder.hpp"
#include "support.hpp"

using namespace oasiskv;
using namespace oasiskv::test;

// The codes of one block, from the format's definition: every decoded element within half a step
// of its row (a step: the channel's key range, or the value group's, over 2^bits - 1), a constant
// channel exact, the codes of a partial block independent of what lies past its rows.
TEST_CASE("quantized rows: decode(encode(rows)) is within half a step of every row, for 2 to 8 bits") {
  OASISKV_SEEDED_RNG(rng);
  for (int bits = kMinQuantizedBits; bits <= kMaxQuantizedBits; ++bits) {
    for (int d : {16, 33, 64}) {
      for (int rows : {16, 5}) {
        INFO("bits " << bits << " head dim " << d << " rows " << rows);
        const int bt = 16;
        auto k = test::random_rows<float>(rng, static_cast<std::size_t>(bt * d), 3.0f);
        auto v = test::random_rows<float>(rng, k.size());
        for (int t = 0; t < bt; ++t) k[static_cast<std::size_t>(t * d + 1)] = 0.75f;  // a constant channel
        std::vector<float> mx(static_cast<std::size_t>(d), -INFINITY), mn(static_cast<std::size_t>(d), INFINITY);
        for (int t = 0; t < rows; ++t) {
          for (int i = 0; i < d; ++i) {
            mx[i] = std::max(mx[i], k[static_cast<std::size_t>(t * d + i)]);
            mn[i] = std::min(mn[i], k[static_cast<std::size_t>(t * d + i)]);
          }
        }
        const auto bytes = static_cast<std::size_t>(quantized_block_bytes(bt, d, bits));
        REQUIRE(bytes % 4 == 0);
        std::vector<std::uint8_t> codes(bytes, 0xAB), again(bytes, 0x11);
        encode_quantized_block(k.data(), v.data(), rows, bt, d, bits, mx.data(), mn.data(), codes.data());
        for (std::size_t j = static_cast<std::size_t>(rows * d); j < k.size(); ++j) k[j] = 1e6f, v[j] = -1e6f;
        encode_quantized_block(k.data(), v.data(), rows, bt, d, bits, mx.data(), mn.data(), again.data());
        CHECK(codes == again);  // rows past `rows` are not read, every byte written
        std::vector<float> dk(static_cast<std::size_t>(rows * d)), dv(dk.size());
        decode_quantized_block(codes.data(), rows, bt, d, bits, mx.data(), mn.data(), dk.data(), dv.data());
        const float levels = static_cast<float>((1 << bits) - 1);
        for (int t = 0; t < rows; ++t) {
          for (int i = 0; i < d; ++i) {
            const float step = (mx[i] - mn[i]) / levels;
            const float err = std::fabs(dk[static_cast<std::size_t>(t * d + i)] - k[static_cast<std::size_t>(t * d + i)]);
            CHECK(err <= 0.5f * step * (1.0f + 1e-4f) + 1e-6f);
            if (i == 1) CHECK(dk[static_cast<std::size_t>(t * d + i)] == 0.75f);
          }
          for (int g0 = 0; g0 < d; g0 += 32) {
            const int g1 = std::min(d, g0 + 32);
            float lo = INFINITY, hi = -INFINITY;
            for (int i = g0; i < g1; ++i) {
              lo = std::min(lo, v[static_cast<std::size_t>(t * d + i)]);
              hi = std::max(hi, v[static_cast<std::size_t>(t * d + i)]);
            }
            for (int i = g0; i < g1; ++i) {
              const float err = std::fabs(dv[static_cast<std::size_t>(t * d + i)] - v[static_cast<std::size_t>(t * d + i)]);
              CHECK(err <= 0.5f * (hi - lo) / levels * (1.0f + 1e-4f) + 1e-6f);
            }
          }
        }
      }
    }
  }
}

// The quantized state against the exact attention over the non-resident rows: its error falls
// as the bits grow, and at 8 bits it is small.
TEST_CASE("quantized: the state approaches the exact remainder as the bits grow") {
  OASISKV_SEEDED_RNG(rng);
  const int len = 700;
  CacheConfig c = test::small_config(128, 1024, 1);
  c.shape.head_dim = 64;
  const int H = c.shape.num_kv_heads, d = c.shape.head_dim, Q = c.shape.num_q_heads;
  const auto k = test::random_rows<float>(rng, static_cast<std::size_t>(len * H * d));
  const auto v = test::random_rows<float>(rng, k.size());
  const auto q = test::random_rows<float>(rng, static_cast<std::size_t>(Q * d), 1.5f);
  c.remainder = RemainderEstimate::quantized;
  const float scale = CacheLayout::from(c).softmax_scale;
  std::vector<double> error;
  for (int bits : {2, 4, 8}) {
    c.remainder_bits = bits;
    double e = 0;
    with_one_sequence_remainder(c, k, v, len, q, [&](const LayerView<float>& view, const std::vector<float>& out,
                                                    const std::vector<float>& lse) {
      for (int g = 0; g < Q; ++g) {
        const int h = g / (Q / H);
        std::vector<std::int32_t> resident(view.block + view.indptr[h], view.block + view.indptr[h + 1]);
        REQUIRE(static_cast<int>(resident.size()) < (len + 15) / 16);
        std::vector<double> logits, values;
        for (int tok = 0; tok < len; ++tok) {
          if (std::find(resident.begin(), resident.end(), tok / 16) != resident.end()) continue;
          double dot = 0;
          for (int i = 0; i < d; ++i) dot += q[static_cast<std::size_t>(g * d + i)] * k[(static_cast<std::size_t>(tok) * H + h) * d + i];
          logits.push_back(dot * scale);
          for (int i = 0; i < d; ++i) values.push_back(v[(static_cast<std::size_t>(tok) * H + h) * d + i]);
        }
        std::vector<double> exact;
        double exact_lse = 0;
        softmax_of(logits, values, d, exact, exact_lse);
        e += std::fabs(lse[static_cast<std::size_t>(g)] - exact_lse);
        for (int i = 0; i < d; ++i) e += std::fabs(out[static_cast<std::size_t>(g * d + i)] - exact[static_cast<std::size_t>(i)]);
      }
    });
    error.push_back(e / Q);
  }
  INFO("mean error per query head at 2, 4, 8 bits: " << error[0] << ", " << error[1] << ", " << error[2]);
  CHECK(error[1] < 0.5 * error[0]);
  // 8 bits' step is 1/17 of 4 bits': the error follows it. (An absolute bound of 1e-3 per value
  // failed on one random draw in CI at 1.1e-3: it depended on the draw's range, not on the codec.)
  CHECK(error[2] < 0.1 * error[1]);
}
