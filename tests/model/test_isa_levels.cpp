// The engine's avx2 and avx512 kernels give the same bits (isa_kernels.hpp), on fresh random inputs
// kernel by kernel and on the real model end to end (prefill, dense decode and decode through the
// OasisKV cache, each weight format). ctest runs this binary only as "... [avx512]" (a CPU without
// AVX-512 reports it skipped: tests/model/CMakeLists.txt); the per-level binary compares each
// level with its references. Attention is the library's (oasiskv/cpu/attention.hpp), one AVX2 copy
// for both levels, tested against references in tests/kernels/test_attention.cpp.
#include <doctest/doctest.h>

#include <cstring>
#include <random>
#include <vector>

#include "dense_attention.hpp"
#include "isa_kernels.hpp"
#include "model_fixture.hpp"
#include "oasiskv_session.hpp"
#include "thread_pool.hpp"

namespace {

using oasiskv::CpuIsa;

std::vector<float> random_floats(std::mt19937& rng, std::size_t n, float scale = 1.0f) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

// The number of elements whose bits differ.
template <class T>
std::size_t bits_differ(const std::vector<T>& a, const std::vector<T>& b) {
  REQUIRE(a.size() == b.size());
  std::size_t n = 0;
  for (std::size_t i = 0; i < a.size(); ++i) n += std::memcmp(&a[i], &b[i], sizeof(T)) != 0;
  return n;
}

const smollm2::IsaKernels& level(CpuIsa l) {
  const smollm2::IsaKernels* k = smollm2::isa_kernels_at(l);
  REQUIRE_MESSAGE(k != nullptr, "this CPU has no " << oasiskv::to_string(l) << " (the ctest entry is [avx512] only)");
  return *k;
}

// Restores the engine's level in use and one thread when a test ends.
struct LevelGuard {
  ~LevelGuard() {
    smollm2::set_isa_level_for_testing(oasiskv::cpu_isa());
    smollm2::set_engine_threads(1);
  }
};

smollm2::QuantizedRows random_weights(std::mt19937& rng, smollm2::GgmlType type, int rows, int cols) {
  smollm2::QuantizedRows w;
  w.type = static_cast<std::uint32_t>(type);
  w.rows = rows;
  w.cols = cols;
  w.blocks_per_row = cols / 32;
  const auto blocks = static_cast<std::size_t>(rows) * static_cast<std::size_t>(w.blocks_per_row);
  w.d = random_floats(rng, blocks, 0.05f);
  if (type == smollm2::GgmlType::q4_1) w.m = random_floats(rng, w.min_slots(), 0.1f);
  w.q.resize(blocks * static_cast<std::size_t>(w.quant_bytes()));
  std::uniform_int_distribution<int> byte(0, 255);
  for (auto& b : w.q) b = static_cast<std::uint8_t>(byte(rng));
  return w;
}

}  // namespace

TEST_SUITE("model") {
  TEST_CASE("avx2 and avx512 kernels give the same bits on random inputs: the products") {
    const auto& a = level(CpuIsa::avx2);
    const auto& b = level(CpuIsa::avx512);
    LevelGuard guard;
    std::mt19937 rng(23);
    for (int threads : {1, 2}) {
      smollm2::set_engine_threads(threads);
      // fp32 products: dot, dot4 and the fp32 weight path, odd lengths included.
      for (int n : {16, 37, 576, 1536}) {
        const auto w = random_floats(rng, static_cast<std::size_t>(n) * 29);
        const auto x = random_floats(rng, static_cast<std::size_t>(n) * 11);
        const float da = a.dot(w.data(), x.data(), n), db = b.dot(w.data(), x.data(), n);
        CHECK(std::memcmp(&da, &db, sizeof da) == 0);
        std::vector<float> ya(29 * 11), yb(29 * 11);
        a.matmul_fp32(w.data(), 29, n, x.data(), 11, ya.data());
        b.matmul_fp32(w.data(), 29, n, x.data(), 11, yb.data());
        INFO("fp32 product, n " << n);
        CHECK(bits_differ(ya, yb) == 0);
      }
      // The quantized products: both types, odd and even blocks per row, a partial last group of
      // 16 scales, every activation-row remainder, and the fp32-activation path.
      for (auto type : {smollm2::GgmlType::q4_1, smollm2::GgmlType::q8_0}) {
        for (int cols : {64, 96, 608, 1536}) {
          for (int rows_x : {1, 2, 3, 5, 8, 13, 70}) {
            const auto w = random_weights(rng, type, 45, cols);
            auto x = random_floats(rng, static_cast<std::size_t>(rows_x) * cols);
            x[3] = 30.0f;  // an outlier sets its block's scale
            smollm2::ActivationBlocks qa, qb;
            a.quantize_activations(x.data(), rows_x, cols, qa);
            b.quantize_activations(x.data(), rows_x, cols, qb);
            INFO("type " << static_cast<int>(type) << ", cols " << cols << ", rows " << rows_x);
            CHECK(bits_differ(qa.q, qb.q) == 0);
            CHECK(bits_differ(qa.d, qb.d) == 0);
            CHECK(bits_differ(qa.s, qb.s) == 0);
            std::vector<float> ya(static_cast<std::size_t>(rows_x) * 45), yb(ya.size());
            a.matmul_int8(w, qa, ya.data());
            b.matmul_int8(w, qa, yb.data());
            CHECK(bits_differ(ya, yb) == 0);
            a.matmul_fp32_activations(w, x.data(), rows_x, ya.data());
            b.matmul_fp32_activations(w, x.data(), rows_x, yb.data());
            CHECK(bits_differ(ya, yb) == 0);
          }
        }
      }
    }
  }

  TEST_CASE("avx2 and avx512 give the same bits on the model: prefill and decode in every weight format and through the cache") {
    level(CpuIsa::avx2);
    level(CpuIsa::avx512);
    LevelGuard guard;
    const auto& f = model_tests::model_fixture();
    const auto& c = f.model->config();
    auto text = model_tests::gpl3_tokens();
    constexpr int kPrompt = 160, kSteps = 6;
    smollm2::set_engine_threads(2);
    for (auto format : {smollm2::WeightFormat::quantized_int8, smollm2::WeightFormat::quantized,
                        smollm2::WeightFormat::fp32}) {
      const smollm2::LlamaModel quantized(*f.file, format);
      const smollm2::LlamaModel& model = format == smollm2::WeightFormat::fp32 ? *f.model : quantized;
      // Logits of the prefill, dense decode steps and steps through an OasisKV cache of a budget
      // smaller than the context (fp16 rows, the drafts' rows included).
      auto run = [&](CpuIsa l) {
        smollm2::set_isa_level_for_testing(l);
        std::vector<float> all;
        smollm2::DenseKv kv(c.num_layers, c.kv_width(), kPrompt + kSteps + 2, smollm2::KvPrecision::fp16);
        const auto pre = smollm2::prefill(model, kv, std::span(text.data(), kPrompt));
        all = pre.last_logits;
        for (int t = 0; t < kSteps; ++t) {
          const auto logits = smollm2::dense_decode_step(model, kv, text[kPrompt + t]);
          all.insert(all.end(), logits.begin(), logits.end());
        }
        kv.truncate(kPrompt);
        oasiskv::CacheConfig config;
        config.shape = smollm2::model_shape(c);
        config.budget_tokens = 64;
        config.sink_tokens = 16;
        config.recent_tokens = 16;
        config.max_sequences = 1;
        config.max_tokens_per_sequence = kPrompt + kSteps + 2;
        smollm2::OasisKvSession<oasiskv::fp16_t> session(model, config, kv, kPrompt);
        session.start(pre.last_queries);
        for (int t = 0; t < kSteps; ++t) {
          const auto logits = session.step(text[kPrompt + t], text[kPrompt + t + 1]);
          all.insert(all.end(), logits.begin(), logits.end());
        }
        return all;
      };
      const auto a = run(CpuIsa::avx2), b = run(CpuIsa::avx512);
      INFO("weight format " << static_cast<int>(format));
      CHECK(bits_differ(a, b) == 0);
    }
  }
}
