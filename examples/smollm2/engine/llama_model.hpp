// A Llama-architecture decoder (SmolLM2) in float32 on the CPU.
//
// The model exposes the forward pass in pieces so that the caller owns attention: the dense
// engine, the OasisKV session (oasiskv_session.hpp) and the evaluation's early-exit drafter all
// reuse the same projections, RoPE and MLP, and differ only in which keys and values a query row
// attends to.
//
// Row-major layouts throughout: activations [rows][dim]; q [rows][q_heads][head_dim];
// k, v [rows][kv_heads][head_dim]. Weight matrices are [out][in] (GGUF's dims[1] x dims[0]).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <vector>

#include "gguf_reader.hpp"
#include "quantized_matmul.hpp"

namespace smollm2 {

struct ModelConfig {
  int num_layers = 0;
  int dim = 0;          // embedding width
  int ffn_dim = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int vocab_size = 0;
  int context_length = 0;
  float rms_eps = 1e-5f;
  float rope_base = 10000.0f;
  int group_size() const { return num_q_heads / num_kv_heads; }
  int q_width() const { return num_q_heads * head_dim; }
  int kv_width() const { return num_kv_heads * head_dim; }
};

// A row-major [rows][cols] weight matrix: dense floats, or (the fast path) kept quantized as the
// file stores it, when `quantized` is set and `values` empty.
struct Matrix {
  int rows = 0;
  int cols = 0;
  std::vector<float> values;
  QuantizedRows quantized;
  const float* row(int r) const { return values.data() + static_cast<std::size_t>(r) * cols; }
  // Row r as floats, whichever form the matrix is in.
  void copy_row(int r, float* out) const;
};

// How LlamaModel keeps its weights. fp32: dequantised once at load, the reference path (the logits
// tests compare it with the numpy reference). The fast paths keep Q4_1 / Q8_0 tensors as the file
// has them (quantized_matmul.hpp) and run attention through the library's tiled kernels
// (oasiskv/cpu/attention.hpp). quantized: dot products against fp32 activations, the reference's
// values summed in another order (logits within 1e-4). quantized-int8: activations rounded to int8
// per block of 32, integer dot products, as llama.cpp's CPU backend does for these types (Q8_1 /
// Q8_0 activations): the fastest, and its logits move by up to ~1 (8-bit activations; greedy
// tokens stay the same on the test prompts: tests/model/test_fast_path.cpp).
enum class WeightFormat { fp32, quantized, quantized_int8 };
WeightFormat parse_weight_format(const std::string& name);

// y[r][o] = sum_i x[r][i] * w[o][i] for r < rows. Parallel over output rows, blocked over input
// rows so that each weight row is read from memory once per block of activation rows.
void matmul(const Matrix& w, const float* x, int rows, float* y);
// matmul(w, x, rows, y) for each (w, y) pair of products, all with the same x: the int8 path
// quantizes x once for all of them (q, k and v; gate and up) instead of once per matrix.
struct Product {
  const Matrix* w;
  float* y;
};
void matmul_same_input(std::initializer_list<Product> products, const float* x, int rows);

// Dot product with sixteen independent accumulators (vectorises without -ffast-math), at the
// level in use (isa_kernels.hpp), as matmul's fp32 path.
float dot(const float* a, const float* b, int n);
// Four dot products of w with x0..x3 (w loaded once for all four).
void dot4(const float* w, const float* x0, const float* x1, const float* x2, const float* x3, int n, float* out);

void rms_norm(const float* x, const float* weight, int rows, int dim, float eps, float* y);

class LlamaModel {
 public:
  // Loads and dequantises every weight. Throws with a clear message on a missing tensor, an
  // architecture other than llama, or an unsupported tensor type.
  explicit LlamaModel(const GgufFile& file, WeightFormat format = WeightFormat::fp32);
  WeightFormat weight_format() const { return format_; }
  // Whether the engine's fast kernels serve this model's attention too (the quantized path); the
  // fp32 path keeps the reference loops end to end.
  bool fast_kernels() const { return format_ != WeightFormat::fp32; }

  const ModelConfig& config() const { return config_; }

  // x [rows][dim] = embedding rows of the tokens.
  void embed(std::span<const std::int32_t> tokens, float* x) const;

  // RMSNorm, Q/K/V projections, then RoPE at the given positions (GGUF layout: adjacent pairs).
  void attention_inputs(int layer, const float* x, int rows, const std::int32_t* positions,
                        float* q, float* k, float* v) const;

  // x += Wo * attention_output; then x += MLP(RMSNorm(x)).
  void attention_output_and_mlp(int layer, float* x, const float* attention_output, int rows) const;

  // logits [rows][vocab] = LM head (RMSNorm(x)).
  void logits(const float* x, int rows, float* out) const;

  // Applies RoPE in place to `heads` vectors of head_dim at one position.
  void apply_rope(float* vectors, int heads, std::int32_t position) const;

 private:
  struct Layer {
    std::vector<float> attn_norm, ffn_norm;
    Matrix wq, wk, wv, wo, w_gate, w_up, w_down;
  };
  ModelConfig config_;
  WeightFormat format_ = WeightFormat::fp32;
  Matrix token_embedding_;  // [vocab][dim]
  Matrix output_;           // LM head; a copy of the embedding when tied
  bool tied_output_ = false;
  std::vector<float> output_norm_;
  std::vector<Layer> layers_;
  std::vector<float> rope_inv_freq_;  // [head_dim / 2]
};

// Softmax attention of `heads` query vectors (one GQA group: they share keys and values) over
// `n` keys/values given as pointers, so callers can gather rows from any layout. Each key and
// value is loaded once for the whole group. q, out: [heads][head_dim]; scratch: heads * n floats.
void attend_heads(const float* q, int heads, const float* const* keys, const float* const* values, int n,
                  int head_dim, float* out, float* scratch);

}  // namespace smollm2
