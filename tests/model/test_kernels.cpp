// The engine's fast kernels against simple references on fresh random inputs (no model needed), at
// every instruction-set level (ctest runs this binary once per level: tests/model/CMakeLists.txt):
// the library's tiled attention as the engine calls it (oasiskv/cpu/attention.hpp: float and fp16
// rows, several segments, odd lengths, split over the engine's threads) against the engine's
// reference attend_heads,
// the int8-activation matrix product, the decode step's two rows over a view, and the thread pool. Suite `pipeline`: they run threads, so
// the TSan run (ctest -L pipeline) takes them too.
#include <doctest/doctest.h>

#include <atomic>
#include <cmath>
#include <random>
#include <thread>
#include <type_traits>
#include <vector>

#include <oasiskv/cpu/attention.hpp>

#include "llama_model.hpp"
#include "oasiskv_session.hpp"
#include "quantized_matmul.hpp"
#include "thread_pool.hpp"

namespace {

std::vector<float> random_floats(std::mt19937& rng, std::size_t n, float scale = 1.0f) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

}  // namespace

TEST_SUITE("pipeline") {
  TEST_CASE("tiled attention equals attend_heads over the same rows (float and fp16 rows on 1 and 2 threads)") {
    std::mt19937 rng(7);
    for (int d : {64, 128, 40}) {  // 40: the scalar fallback
      for (int threads : {1, 2}) {
        smollm2::set_engine_threads(threads);
        const int kv_heads = 3, group = 3;
        for (std::int64_t n : {1, 5, 63, 64, 65, 700, 1500}) {
          // Rows in [n][kv_heads][d] (a dense cache's layout), given as segments of uneven sizes.
          const auto k = random_floats(rng, static_cast<std::size_t>(n) * kv_heads * d, 2.0f);
          const auto v = random_floats(rng, k.size());
          std::vector<oasiskv::fp16_t> k16(k.size()), v16(v.size());
          std::vector<float> kr(k.size()), vr(v.size());  // the fp16 rows widened: the fp16 reference
          for (std::size_t i = 0; i < k.size(); ++i) {
            k16[i] = oasiskv::to_fp16(k[i]);
            v16[i] = oasiskv::to_fp16(v[i]);
            kr[i] = oasiskv::to_float(k16[i]);
            vr[i] = oasiskv::to_float(v16[i]);
          }
          const auto q = random_floats(rng, static_cast<std::size_t>(kv_heads) * group * d);
          const int W = kv_heads * d;
          auto run = [&](auto* keys, auto* values, std::vector<float>& out) {
            using T = std::remove_const_t<std::remove_pointer_t<decltype(keys)>>;
            std::vector<oasiskv::KvRows<T>> segments;
            std::vector<std::int32_t> indptr{0};
            for (int h = 0; h < kv_heads; ++h) {
              for (std::int64_t first = 0; first < n;) {
                const std::int64_t rows = std::min<std::int64_t>(n - first, 1 + (first * 7 + h) % 37);
                segments.push_back({keys + first * W + h * d, values + first * W + h * d, rows, W});
                first += rows;
              }
              indptr.push_back(static_cast<std::int32_t>(segments.size()));
            }
            out.assign(q.size(), 0.0f);
            oasiskv::cpu_attend_query_row<T>(q.data(), kv_heads, group, d, 1.0f / std::sqrt(static_cast<float>(d)),
                                             segments, indptr, out.data(), nullptr, smollm2::engine_parallel_for());
          };
          auto reference = [&](const std::vector<float>& keys, const std::vector<float>& values) {
            std::vector<float> out(q.size()), scratch(static_cast<std::size_t>(n) * group);
            std::vector<const float*> kp(n), vp(n);
            for (int h = 0; h < kv_heads; ++h) {
              for (std::int64_t t = 0; t < n; ++t) {
                kp[t] = keys.data() + t * W + h * d;
                vp[t] = values.data() + t * W + h * d;
              }
              smollm2::attend_heads(q.data() + h * group * d, group, kp.data(), vp.data(), static_cast<int>(n), d,
                                    out.data() + h * group * d, scratch.data());
            }
            return out;
          };
          std::vector<float> out32, out16;
          run(k.data(), v.data(), out32);
          run(k16.data(), v16.data(), out16);
          const auto ref32 = reference(k, v), ref16 = reference(kr, vr);
          float worst32 = 0.0f, worst16 = 0.0f;
          for (std::size_t i = 0; i < q.size(); ++i) {
            worst32 = std::max(worst32, std::fabs(out32[i] - ref32[i]));
            worst16 = std::max(worst16, std::fabs(out16[i] - ref16[i]));
          }
          INFO("d " << d << ", n " << n << ", threads " << threads);
          CHECK(worst32 < 2e-5f);
          CHECK(worst16 < 2e-5f);
        }
      }
    }
    smollm2::set_engine_threads(1);
  }

  TEST_CASE("causal attention of several rows equals each row's attention over its prefix") {
    std::mt19937 rng(5);
    for (int d : {64, 40}) {
      const int heads = 3, rows = 21;
      const std::int64_t n = 300;
      const auto k = random_floats(rng, static_cast<std::size_t>(n) * d), v = random_floats(rng, k.size());
      const auto q = random_floats(rng, static_cast<std::size_t>(rows) * heads * d);
      std::vector<std::int32_t> positions(rows);
      for (int r = 0; r < rows; ++r) positions[r] = static_cast<std::int32_t>(n - rows + r);
      positions[0] = 3;  // a row whose prefix ends inside the first tile
      const float scale = 1.0f / std::sqrt(static_cast<float>(d));
      const oasiskv::KvRows<float> all{k.data(), v.data(), n, d};
      std::vector<float> out(q.size()), one(static_cast<std::size_t>(heads) * d);
      oasiskv::cpu_attend_causal<float>(q.data(), heads * d, rows, positions.data(), heads, d, scale, all, out.data(),
                                        heads * d);
      for (int r = 0; r < rows; ++r) {
        const oasiskv::KvRows<float> prefix{k.data(), v.data(), positions[r] + 1, d};
        const std::int32_t indptr[] = {0, 1};
        oasiskv::cpu_attend_query_row<float>(q.data() + r * heads * d, 1, heads, d, scale, std::span(&prefix, 1), indptr,
                                             one.data());
        float worst = 0.0f;
        for (int i = 0; i < heads * d; ++i) worst = std::max(worst, std::fabs(one[i] - out[r * heads * d + i]));
        INFO("d " << d << ", row " << r);
        CHECK(worst < 1e-6f);
      }
    }
  }

  TEST_CASE("the quantized products equal the exact sums over their operands: int8 and fp32 activations") {
    std::mt19937 rng(11);
    for (int threads : {1, 2}) {
      smollm2::set_engine_threads(threads);
      for (auto type : {smollm2::GgmlType::q4_1, smollm2::GgmlType::q8_0})
      // Odd and even blocks per row (pairs of blocks, and the last alone), and rows longer than
      // the 16 blocks whose scales the AVX-512 loop takes at a time (a partial last group: 19, 33).
      for (int cols : {96, 64, 608, 1056})
      for (int rows_x : {1, 2, 7, 8, 19}) {  // every remainder path, and whole groups of eight
        const int rows_w = 37;
        smollm2::QuantizedRows w;
        w.type = static_cast<std::uint32_t>(type);
        w.rows = rows_w;
        w.cols = cols;
        w.blocks_per_row = cols / 32;
        const auto blocks = static_cast<std::size_t>(rows_w) * w.blocks_per_row;
        w.d = random_floats(rng, blocks, 0.05f);
        if (type == smollm2::GgmlType::q4_1) w.m = random_floats(rng, w.min_slots(), 0.1f);
        w.q.resize(blocks * static_cast<std::size_t>(w.quant_bytes()));
        std::uniform_int_distribution<int> byte(0, 255);
        for (auto& b : w.q) b = static_cast<std::uint8_t>(byte(rng));
        auto x = random_floats(rng, static_cast<std::size_t>(rows_x) * cols);
        x[5] = 40.0f;  // an outlier: its block's scale is set by it
        smollm2::ActivationBlocks xq;
        smollm2::quantize_activations(x.data(), rows_x, cols, xq);
        std::vector<float> y(static_cast<std::size_t>(rows_x) * rows_w);
        smollm2::matmul_quantized(w, xq, y.data());
        std::vector<float> wrow(cols);
        for (int o = 0; o < rows_w; ++o) {
          w.dequantize_row(o, wrow.data());
          for (int r = 0; r < rows_x; ++r) {
            double exact = 0.0;  // sum of w * (d_x * q_x), in double
            for (int i = 0; i < cols; ++i)
              exact += static_cast<double>(wrow[i]) * xq.d[static_cast<std::size_t>(r) * w.blocks_per_row + i / 32] *
                       xq.q[static_cast<std::size_t>(r) * cols + i];
            const float got = y[static_cast<std::size_t>(r) * rows_w + o];
            CHECK(std::fabs(got - exact) <= 1e-4 * (1.0 + std::fabs(exact)));
          }
        }
        // Rows are independent: each activation row alone gives the same bits as within the batch
        // (a decode step's current row does not depend on its lookahead row: OasisKvSession::step
        // drops that row from the last layer).
        for (int r = 0; r < rows_x; ++r) {
          smollm2::ActivationBlocks one;
          smollm2::quantize_activations(x.data() + static_cast<std::size_t>(r) * cols, 1, cols, one);
          std::vector<float> alone(static_cast<std::size_t>(rows_w));
          smollm2::matmul_quantized(w, one, alone.data());
          int differ = 0;
          for (int o = 0; o < rows_w; ++o) differ += alone[o] != y[static_cast<std::size_t>(r) * rows_w + o];
          INFO("row " << r << " of " << rows_x);
          CHECK(differ == 0);
        }
        // The fp32-activation path (WeightFormat::quantized) over the same weights: the exact sum
        // of the dequantised row times x.
        w.int8_activations = false;
        smollm2::matmul_quantized(w, x.data(), rows_x, y.data());
        w.int8_activations = true;
        for (int o = 0; o < rows_w; ++o) {
          w.dequantize_row(o, wrow.data());
          for (int r = 0; r < rows_x; ++r) {
            double exact = 0.0;
            for (int i = 0; i < cols; ++i) exact += static_cast<double>(wrow[i]) * x[static_cast<std::size_t>(r) * cols + i];
            const float got = y[static_cast<std::size_t>(r) * rows_w + o];
            CHECK(std::fabs(got - exact) <= 1e-4 * (1.0 + std::fabs(exact)));
          }
        }
        // The quantized activations are within half a step of x.
        for (int r = 0; r < rows_x; ++r)
          for (int i = 0; i < cols; ++i) {
            const float step = xq.d[static_cast<std::size_t>(r) * w.blocks_per_row + i / 32];
            CHECK(std::fabs(step * xq.q[static_cast<std::size_t>(r) * cols + i] - x[static_cast<std::size_t>(r) * cols + i]) <=
                  0.5f * step * 1.0001f + 1e-7f);
          }
      }
    }
    smollm2::set_engine_threads(1);
  }

  TEST_CASE("a step's two rows over a view in one pass: the current row as attend_view_row and the lookahead row as the reference") {
    std::mt19937 rng(5);
    smollm2::ModelConfig c;
    c.num_q_heads = 9;
    c.num_kv_heads = 3;
    c.head_dim = 64;
    const int bt = 16, slots = 40, H = c.num_kv_heads, d = c.head_dim;
    for (int threads : {1, 2}) {
      smollm2::set_engine_threads(threads);
      for (int trial = 0; trial < 6; ++trial) {
        // A view of random blocks: per kv head a few dozen entries, some partly valid.
        const auto pool = random_floats(rng, static_cast<std::size_t>(slots) * 2 * bt * d);
        std::vector<oasiskv::fp16_t> pool16(pool.size());
        for (std::size_t i = 0; i < pool.size(); ++i) pool16[i] = oasiskv::to_fp16(pool[i]);
        std::vector<std::int32_t> indptr{0}, slot, block, valid;
        for (int h = 0; h < H; ++h) {
          const int entries = std::uniform_int_distribution<int>(1, trial < 3 ? 8 : 40)(rng);
          for (int e = 0; e < entries; ++e) {
            slot.push_back(std::uniform_int_distribution<int>(0, slots - 1)(rng));
            block.push_back(e);
            valid.push_back(e + 1 == entries ? std::uniform_int_distribution<int>(1, bt)(rng) : bt);
          }
          indptr.push_back(static_cast<std::int32_t>(slot.size()));
        }
        const oasiskv::SeqId ids[] = {1};
        // The sequence's length: past its last row in any head (the view's rows are causal by
        // position: attend_view_row's fast path gives the current row every row before it).
        std::int64_t lens[] = {0};
        for (std::size_t e = 0; e < slot.size(); ++e)
          lens[0] = std::max<std::int64_t>(lens[0], static_cast<std::int64_t>(block[e]) * bt + valid[e]);
        auto view_of = [&](const auto* p) {
          oasiskv::LayerView<std::remove_cv_t<std::remove_pointer_t<decltype(p)>>> v;
          v.batch_size = 1;
          v.num_kv_heads = H;
          v.head_dim = d;
          v.block_tokens = bt;
          v.seq_ids = ids;
          v.seq_len = lens;
          v.indptr = indptr.data();
          v.slot = slot.data();
          v.block = block.data();
          v.valid_tokens = valid.data();
          v.pool = p;
          v.slot_stride = 2 * bt * d;
          return v;
        };
        const auto q = random_floats(rng, 2 * static_cast<std::size_t>(c.q_width()));
        const auto own_k = random_floats(rng, static_cast<std::size_t>(c.kv_width()));
        const auto own_v = random_floats(rng, static_cast<std::size_t>(c.kv_width()));
        const std::size_t W = static_cast<std::size_t>(c.q_width()), Q = static_cast<std::size_t>(c.num_q_heads);
        // float rows: the fused fast pass against two reference rows (attend_heads), and the
        // current row against the fast single-row pass, bit for bit.
        const auto view = view_of(pool.data());
        std::vector<float> fused(2 * W), fused_lse(2 * Q), ref(2 * W), ref_lse(2 * Q), single(W), single_lse(Q);
        smollm2::attend_view_step_rows<float>(c, view, q.data(), own_k.data(), own_v.data(), fused.data(), true,
                                              fused_lse.data());
        smollm2::attend_view_step_rows<float>(c, view, q.data(), own_k.data(), own_v.data(), ref.data(), false,
                                              ref_lse.data());
        smollm2::attend_view_row<float>(c, view, q.data(), nullptr, nullptr, 0, single.data(), INT64_MAX, true,
                                        single_lse.data());
        for (std::size_t i = 0; i < W; ++i) REQUIRE(fused[i] == single[i]);
        for (std::size_t i = 0; i < Q; ++i) REQUIRE(fused_lse[i] == single_lse[i]);
        for (std::size_t i = 0; i < 2 * W; ++i) CHECK(std::fabs(fused[i] - ref[i]) <= 2e-5f * (1.0f + std::fabs(ref[i])));
        for (std::size_t i = 0; i < 2 * Q; ++i) CHECK(std::fabs(fused_lse[i] - ref_lse[i]) <= 2e-5f * (1.0f + std::fabs(ref_lse[i])));
        // fp16 rows: the lookahead row against the fast single-row pass with its own k, v as a
        // scratch row (rounded to fp16, as the session passes them).
        std::vector<oasiskv::fp16_t> k16(own_k.size()), v16(own_v.size());
        for (std::size_t i = 0; i < k16.size(); ++i) {
          k16[i] = oasiskv::to_fp16(own_k[i]);
          v16[i] = oasiskv::to_fp16(own_v[i]);
        }
        const auto view16 = view_of(pool16.data());
        std::vector<float> fused16(2 * W), row1(W);
        smollm2::attend_view_step_rows<oasiskv::fp16_t>(c, view16, q.data(), k16.data(), v16.data(), fused16.data(), true);
        smollm2::attend_view_row<oasiskv::fp16_t>(c, view16, q.data() + W, k16.data(), v16.data(), 1, row1.data());
        for (std::size_t i = 0; i < W; ++i) CHECK(std::fabs(fused16[W + i] - row1[i]) <= 2e-5f * (1.0f + std::fabs(row1[i])));
      }
    }
    smollm2::set_engine_threads(1);
  }

  TEST_CASE("the thread pool runs every task once and nested calls inline for any thread count") {
    for (int threads : {1, 2, 3}) {
      smollm2::ThreadPool pool(threads);
      CHECK(pool.threads() == threads);
      for (int round = 0; round < 200; ++round) {
        const int tasks = 1 + round % 17;
        std::vector<std::atomic<int>> hits(static_cast<std::size_t>(tasks));
        std::atomic<int> nested{0};
        pool.run(tasks, [&](int t) {
          hits[static_cast<std::size_t>(t)].fetch_add(1);
          pool.run(3, [&](int) { nested.fetch_add(1); });  // inline: no deadlock
        });
        for (auto& h : hits) CHECK(h.load() == 1);
        CHECK(nested.load() == 3 * tasks);
      }
    }
    CHECK_THROWS_AS(smollm2::ThreadPool(0), std::invalid_argument);
  }

  TEST_CASE("the thread pool oversubscribed: late workers skip closed regions and every task runs once and times add up") {
    // More threads than cores: workers are often descheduled when a region starts, join it late
    // or not at all (the caller takes their tasks), and a later region's fields must not reach a
    // worker still leaving an earlier one.
    const int threads = 2 * static_cast<int>(std::max(1u, std::thread::hardware_concurrency())) + 1;
    smollm2::ThreadPool pool(threads);
    pool.set_profiling(true);
    std::int64_t regions = 0;
    for (int round = 0; round < 2000; ++round) {
      const int tasks = 2 + round % 13;
      std::vector<std::atomic<int>> hits(static_cast<std::size_t>(tasks));
      pool.run(tasks, [&](int t) { hits[static_cast<std::size_t>(t)].fetch_add(1); });
      ++regions;
      int wrong = 0;
      for (auto& h : hits) wrong += h.load() != 1;
      REQUIRE(wrong == 0);
    }
    const auto t = pool.times();
    CHECK(t.regions == regions);
    CHECK(t.busy_ns > 0);
    CHECK(t.caller_wait_ns >= 0);
    pool.reset_times();
    CHECK(pool.times().regions == 0);
  }
}
