#include "llama_model.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "dense_kv.hpp"
#include "dequantize.hpp"
#include "isa_kernels.hpp"

namespace smollm2 {
namespace {

Matrix load_matrix(const GgufFile& file, const std::string& name, int expect_rows, int expect_cols,
                   WeightFormat format) {
  const TensorInfo& t = file.tensor(name);
  if (t.dims.size() != 2 || t.dims[0] != expect_cols || t.dims[1] != expect_rows)
    throw std::runtime_error("tensor '" + name + "' has unexpected shape (want " +
                             std::to_string(expect_rows) + " x " + std::to_string(expect_cols) + ")");
  if (format != WeightFormat::fp32 && quantizable(t.type) && expect_cols % 32 == 0) {
    Matrix m{expect_rows, expect_cols, {}, repack(t, expect_rows, expect_cols)};
    m.quantized.int8_activations = format == WeightFormat::quantized_int8;
    return m;
  }
  return Matrix{expect_rows, expect_cols, dequantize_tensor(t), {}};
}

std::vector<float> load_vector(const GgufFile& file, const std::string& name, int expect) {
  const TensorInfo& t = file.tensor(name);
  if (t.elements() != expect) throw std::runtime_error("tensor '" + name + "' has unexpected size");
  return dequantize_tensor(t);
}

}  // namespace

WeightFormat parse_weight_format(const std::string& name) {
  if (name == "fp32") return WeightFormat::fp32;
  if (name == "quantized") return WeightFormat::quantized;
  if (name == "quantized-int8") return WeightFormat::quantized_int8;
  throw std::invalid_argument("weight format '" + name + "': use fp32, quantized or quantized-int8");
}

KvPrecision parse_kv_precision(const std::string& name) {
  if (name == "fp32") return KvPrecision::fp32;
  if (name == "fp16") return KvPrecision::fp16;
  throw std::invalid_argument("KV precision '" + name + "': use fp32 or fp16");
}

const char* kv_precision_name(KvPrecision p) { return p == KvPrecision::fp16 ? "fp16" : "fp32"; }

void Matrix::copy_row(int r, float* out) const {
  if (!quantized.empty()) {
    quantized.dequantize_row(r, out);
  } else {
    std::copy_n(row(r), cols, out);
  }
}

void matmul(const Matrix& w, const float* x, int rows, float* y) {
  if (!w.quantized.empty()) {
    matmul_quantized(w.quantized, x, rows, y);
    return;
  }
  isa_kernels().matmul_fp32(w.values.data(), w.rows, w.cols, x, rows, y);
}

void matmul_same_input(std::initializer_list<Product> products, const float* x, int rows) {
  const bool int8_all = std::all_of(products.begin(), products.end(), [&](const Product& p) {
    return !p.w->quantized.empty() && p.w->quantized.int8_activations && p.w->cols == products.begin()->w->cols;
  });
  if (!int8_all) {
    for (const Product& p : products) matmul(*p.w, x, rows, p.y);
    return;
  }
  thread_local ActivationBlocks blocks;
  quantize_activations(x, rows, products.begin()->w->cols, blocks);
  for (const Product& p : products) matmul_quantized(p.w->quantized, blocks, p.y);
}

void rms_norm(const float* x, const float* weight, int rows, int dim, float eps, float* y) {
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + static_cast<std::size_t>(r) * dim;
    float* yr = y + static_cast<std::size_t>(r) * dim;
    double sum = 0.0;
    for (int i = 0; i < dim; ++i) sum += static_cast<double>(xr[i]) * xr[i];
    const float scale = static_cast<float>(1.0 / std::sqrt(sum / dim + eps));
    for (int i = 0; i < dim; ++i) yr[i] = xr[i] * scale * weight[i];
  }
}

LlamaModel::LlamaModel(const GgufFile& file, WeightFormat format) : format_(format) {
  const std::string arch = file.get_string("general.architecture");
  if (arch != "llama")
    throw std::runtime_error(file.path() + ": architecture '" + arch + "' is not llama");
  auto& c = config_;
  c.num_layers = static_cast<int>(file.get_int("llama.block_count"));
  c.dim = static_cast<int>(file.get_int("llama.embedding_length"));
  c.ffn_dim = static_cast<int>(file.get_int("llama.feed_forward_length"));
  c.num_q_heads = static_cast<int>(file.get_int("llama.attention.head_count"));
  c.num_kv_heads = static_cast<int>(file.has("llama.attention.head_count_kv")
                                        ? file.get_int("llama.attention.head_count_kv")
                                        : c.num_q_heads);
  c.head_dim = c.dim / c.num_q_heads;
  c.context_length = static_cast<int>(file.get_int("llama.context_length"));
  c.rms_eps = static_cast<float>(file.get_real("llama.attention.layer_norm_rms_epsilon"));
  c.rope_base = file.has("llama.rope.freq_base") ? static_cast<float>(file.get_real("llama.rope.freq_base")) : 10000.0f;
  if (file.has("llama.rope.dimension_count") && file.get_int("llama.rope.dimension_count") != c.head_dim)
    throw std::runtime_error("partial RoPE (rope.dimension_count != head_dim) is not supported");
  if (c.num_q_heads % c.num_kv_heads != 0) throw std::runtime_error("q heads not a multiple of kv heads");

  const TensorInfo& emb = file.tensor("token_embd.weight");
  c.vocab_size = static_cast<int>(emb.dims.at(1));
  token_embedding_ = load_matrix(file, "token_embd.weight", c.vocab_size, c.dim, format);
  if (file.find_tensor("output.weight")) {
    output_ = load_matrix(file, "output.weight", c.vocab_size, c.dim, format);
  } else {
    tied_output_ = true;  // SmolLM2 ties the LM head to the embedding
  }
  output_norm_ = load_vector(file, "output_norm.weight", c.dim);
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    Layer layer;
    layer.attn_norm = load_vector(file, p + "attn_norm.weight", c.dim);
    layer.ffn_norm = load_vector(file, p + "ffn_norm.weight", c.dim);
    layer.wq = load_matrix(file, p + "attn_q.weight", c.q_width(), c.dim, format);
    layer.wk = load_matrix(file, p + "attn_k.weight", c.kv_width(), c.dim, format);
    layer.wv = load_matrix(file, p + "attn_v.weight", c.kv_width(), c.dim, format);
    layer.wo = load_matrix(file, p + "attn_output.weight", c.dim, c.q_width(), format);
    layer.w_gate = load_matrix(file, p + "ffn_gate.weight", c.ffn_dim, c.dim, format);
    layer.w_up = load_matrix(file, p + "ffn_up.weight", c.ffn_dim, c.dim, format);
    layer.w_down = load_matrix(file, p + "ffn_down.weight", c.dim, c.ffn_dim, format);
    layers_.push_back(std::move(layer));
  }
  for (int i = 0; i < c.head_dim / 2; ++i)
    rope_inv_freq_.push_back(static_cast<float>(std::pow(static_cast<double>(c.rope_base), -2.0 * i / c.head_dim)));
}

void LlamaModel::embed(std::span<const std::int32_t> tokens, float* x) const {
  for (std::size_t r = 0; r < tokens.size(); ++r) {
    if (tokens[r] < 0 || tokens[r] >= config_.vocab_size)
      throw std::out_of_range("token id " + std::to_string(tokens[r]) + " outside the vocabulary");
    token_embedding_.copy_row(tokens[r], x + r * config_.dim);
  }
}

void LlamaModel::apply_rope(float* vectors, int heads, std::int32_t position) const {
  // llama.cpp's converter permutes the Q/K weight rows so that GGML's "normal" RoPE, which
  // rotates adjacent pairs (2i, 2i+1) by position * base^(-2i/d), equals HF's rotate_half RoPE.
  const int half = config_.head_dim / 2;
  for (int i = 0; i < half; ++i) {
    const double angle = static_cast<double>(position) * rope_inv_freq_[i];
    const float cos_a = static_cast<float>(std::cos(angle));
    const float sin_a = static_cast<float>(std::sin(angle));
    for (int h = 0; h < heads; ++h) {
      float* pair = vectors + h * config_.head_dim + 2 * i;
      const float a = pair[0], b = pair[1];
      pair[0] = a * cos_a - b * sin_a;
      pair[1] = a * sin_a + b * cos_a;
    }
  }
}

void LlamaModel::attention_inputs(int layer, const float* x, int rows, const std::int32_t* positions,
                                  float* q, float* k, float* v) const {
  const auto& L = layers_.at(layer);
  std::vector<float> h(static_cast<std::size_t>(rows) * config_.dim);
  rms_norm(x, L.attn_norm.data(), rows, config_.dim, config_.rms_eps, h.data());
  matmul_same_input({{&L.wq, q}, {&L.wk, k}, {&L.wv, v}}, h.data(), rows);
  for (int r = 0; r < rows; ++r) {
    apply_rope(q + static_cast<std::size_t>(r) * config_.q_width(), config_.num_q_heads, positions[r]);
    apply_rope(k + static_cast<std::size_t>(r) * config_.kv_width(), config_.num_kv_heads, positions[r]);
  }
}

void LlamaModel::attention_output_and_mlp(int layer, float* x, const float* attention_output, int rows) const {
  const auto& L = layers_.at(layer);
  const std::size_t n = static_cast<std::size_t>(rows) * config_.dim;
  std::vector<float> projected(n), h(n);
  matmul(L.wo, attention_output, rows, projected.data());
  for (std::size_t i = 0; i < n; ++i) x[i] += projected[i];
  rms_norm(x, L.ffn_norm.data(), rows, config_.dim, config_.rms_eps, h.data());
  const std::size_t m = static_cast<std::size_t>(rows) * config_.ffn_dim;
  std::vector<float> gate(m), up(m);
  matmul_same_input({{&L.w_gate, gate.data()}, {&L.w_up, up.data()}}, h.data(), rows);
  for (std::size_t i = 0; i < m; ++i) gate[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];  // SiLU(g) * u
  matmul(L.w_down, gate.data(), rows, projected.data());
  for (std::size_t i = 0; i < n; ++i) x[i] += projected[i];
}

void LlamaModel::logits(const float* x, int rows, float* out) const {
  std::vector<float> h(static_cast<std::size_t>(rows) * config_.dim);
  rms_norm(x, output_norm_.data(), rows, config_.dim, config_.rms_eps, h.data());
  matmul(tied_output_ ? token_embedding_ : output_, h.data(), rows, out);
}

void attend_heads(const float* q, int heads, const float* const* keys, const float* const* values, int n,
                  int head_dim, float* out, float* scores) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  for (int j = 0; j < n; ++j)
    for (int g = 0; g < heads; ++g) scores[static_cast<std::size_t>(g) * n + j] = dot(q + g * head_dim, keys[j], head_dim) * scale;
  for (int g = 0; g < heads; ++g) {
    float* s = scores + static_cast<std::size_t>(g) * n;
    const float top = *std::max_element(s, s + n);
    float total = 0.0f;
    for (int j = 0; j < n; ++j) total += (s[j] = std::exp(s[j] - top));
    for (int j = 0; j < n; ++j) s[j] /= total;
  }
  std::fill_n(out, static_cast<std::size_t>(heads) * head_dim, 0.0f);
  for (int j = 0; j < n; ++j) {
    const float* vj = values[j];
    for (int g = 0; g < heads; ++g) {
      const float w = scores[static_cast<std::size_t>(g) * n + j];
      float* o = out + g * head_dim;
      for (int i = 0; i < head_dim; ++i) o[i] += w * vj[i];
    }
  }
}

}  // namespace smollm2
