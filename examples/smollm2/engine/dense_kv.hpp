// Every key and value row, per layer: the dense engine's KV cache (float, or fp16 as llama.cpp
// keeps it by default), and in the evaluation's sparse runs (experiments/smollm2) the float
// mirror that recall and attention error are measured against.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <oasiskv/dtype.hpp>

namespace smollm2 {

enum class KvPrecision { fp32, fp16 };
KvPrecision parse_kv_precision(const std::string& name);
const char* kv_precision_name(KvPrecision p);

class DenseKv {
 public:
  DenseKv(int num_layers, int row_width, std::int64_t capacity, KvPrecision precision = KvPrecision::fp32)
      : row_width_(row_width), capacity_(capacity), precision_(precision), length_(num_layers, 0) {
    const auto n = static_cast<std::size_t>(capacity) * static_cast<std::size_t>(row_width);
    if (precision == KvPrecision::fp32) {
      keys_.assign(num_layers, std::vector<float>(n));
      values_.assign(num_layers, std::vector<float>(n));
    } else {
      keys16_.assign(num_layers, std::vector<oasiskv::fp16_t>(n));
      values16_.assign(num_layers, std::vector<oasiskv::fp16_t>(n));
    }
  }
  KvPrecision precision() const { return precision_; }
  // Appends `rows` rows ([rows][kv_heads][head_dim]) to one layer (rounded to fp16 if kept so).
  void append(int layer, const float* k, const float* v, int rows) {
    auto& n = length_.at(layer);
    if (n + rows > capacity_) throw std::length_error("DenseKv: capacity " + std::to_string(capacity_) + " exceeded");
    const auto count = static_cast<std::size_t>(rows) * row_width_;
    const auto at = static_cast<std::size_t>(n) * row_width_;
    if (precision_ == KvPrecision::fp32) {
      std::copy_n(k, count, keys_[layer].data() + at);
      std::copy_n(v, count, values_[layer].data() + at);
    } else {
      for (std::size_t i = 0; i < count; ++i) {
        keys16_[layer][at + i] = oasiskv::to_fp16(k[i]);
        values16_[layer][at + i] = oasiskv::to_fp16(v[i]);
      }
    }
    n += rows;
  }
  std::int64_t length(int layer) const { return length_.at(layer); }
  // Float rows (fp32 caches only).
  const float* key(int layer, std::int64_t token) const { return keys(layer) + token * row_width_; }
  const float* value(int layer, std::int64_t token) const { return values(layer) + token * row_width_; }
  const float* keys(int layer) const { return float_rows(keys_, layer); }
  const float* values(int layer) const { return float_rows(values_, layer); }
  // fp16 rows (fp16 caches only).
  const oasiskv::fp16_t* keys16(int layer) const { return half_rows(keys16_, layer); }
  const oasiskv::fp16_t* values16(int layer) const { return half_rows(values16_, layer); }
  int row_width() const { return row_width_; }
  int num_layers() const { return static_cast<int>(length_.size()); }
  // The first `rows` rows of every layer in a float cache of that capacity (an fp16 cache's rows
  // widened, exactly).
  DenseKv to_fp32(std::int64_t rows) const {
    DenseKv out(num_layers(), row_width_, rows);
    const auto count = static_cast<std::size_t>(rows) * row_width_;
    std::vector<float> k(count), v(count);
    for (int l = 0; l < num_layers(); ++l) {
      if (rows > length(l)) throw std::out_of_range("DenseKv::to_fp32: more rows than layer " + std::to_string(l) + " holds");
      for (std::size_t i = 0; i < count; ++i) {
        k[i] = precision_ == KvPrecision::fp32 ? keys_[l][i] : oasiskv::to_float(keys16_[l][i]);
        v[i] = precision_ == KvPrecision::fp32 ? values_[l][i] : oasiskv::to_float(values16_[l][i]);
      }
      out.append(l, k.data(), v.data(), static_cast<int>(rows));
    }
    return out;
  }
  // Forgets everything after `tokens` in every layer (a new run reusing the same prompt).
  void truncate(std::int64_t tokens) {
    for (auto& n : length_) n = std::min(n, tokens);
  }

 private:
  const float* float_rows(const std::vector<std::vector<float>>& rows, int layer) const {
    if (precision_ != KvPrecision::fp32) throw std::logic_error("DenseKv: float rows of an fp16 cache");
    return rows[layer].data();
  }
  const oasiskv::fp16_t* half_rows(const std::vector<std::vector<oasiskv::fp16_t>>& rows, int layer) const {
    if (precision_ != KvPrecision::fp16) throw std::logic_error("DenseKv: fp16 rows of a float cache");
    return rows[layer].data();
  }
  int row_width_;
  std::int64_t capacity_;
  KvPrecision precision_;
  std::vector<std::vector<float>> keys_, values_;
  std::vector<std::vector<oasiskv::fp16_t>> keys16_, values16_;
  std::vector<std::int64_t> length_;
};

}  // namespace smollm2
