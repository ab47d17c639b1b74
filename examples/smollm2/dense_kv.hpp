// A full-precision copy of every key and value row, per layer: the dense engine's KV cache, and
// in sparse runs the ground truth that recall and attention error are measured against.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <vector>

namespace smollm2 {

class DenseKv {
 public:
  DenseKv(int num_layers, int row_width, std::int64_t capacity)
      : row_width_(row_width), capacity_(capacity), keys_(num_layers), values_(num_layers), length_(num_layers, 0) {
    for (int l = 0; l < num_layers; ++l) {
      keys_[l].resize(static_cast<std::size_t>(capacity) * row_width);
      values_[l].resize(static_cast<std::size_t>(capacity) * row_width);
    }
  }
  // Appends `rows` rows ([rows][kv_heads][head_dim]) to one layer.
  void append(int layer, const float* k, const float* v, int rows) {
    auto& n = length_.at(layer);
    if (n + rows > capacity_) throw std::length_error("DenseKv: capacity " + std::to_string(capacity_) + " exceeded");
    std::copy_n(k, static_cast<std::size_t>(rows) * row_width_, keys_[layer].data() + n * row_width_);
    std::copy_n(v, static_cast<std::size_t>(rows) * row_width_, values_[layer].data() + n * row_width_);
    n += rows;
  }
  std::int64_t length(int layer) const { return length_.at(layer); }
  const float* key(int layer, std::int64_t token) const { return keys_[layer].data() + token * row_width_; }
  const float* value(int layer, std::int64_t token) const { return values_[layer].data() + token * row_width_; }
  const float* keys(int layer) const { return keys_[layer].data(); }
  const float* values(int layer) const { return values_[layer].data(); }
  int row_width() const { return row_width_; }
  // Forgets everything after `tokens` in every layer (a new run reusing the same prompt).
  void truncate(std::int64_t tokens) {
    for (auto& n : length_) n = std::min(n, tokens);
  }

 private:
  int row_width_;
  std::int64_t capacity_;
  std::vector<std::vector<float>> keys_, values_;
  std::vector<std::int64_t> length_;
};

}  // namespace smollm2
