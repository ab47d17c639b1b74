// QuantizedBlocks: the CPU backend's store of RemainderEstimate::quantized. Every full block of a
// (sequence slot, layer, kv head) holds its rows coded at CacheConfig::remainder_bits
// (quantized_rows.hpp), written when an append fills the block (its key summary is final then) and
// copied by a fork for the blocks below the fork point. A partial block has no codes: the
// recent ring always holds it, and Cache::remainder codes one it meets from its host rows
// (rows_codes) so that every non-resident row is counted the same way.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "oasiskv/config.hpp"
#include "oasiskv/detail/checked.hpp"
#include "oasiskv/dtype.hpp"
#include "oasiskv/quantized_rows.hpp"

namespace oasiskv {
inline namespace v0 {
namespace detail {

class QuantizedBlocks {
 public:
  explicit QuantizedBlocks(const CacheLayout& layout)
      : layout_(layout),
        enabled_(layout.config.remainder == RemainderEstimate::quantized),
        codes_(static_cast<std::size_t>(layout.quantized_bytes)) {}

  bool enabled() const noexcept { return enabled_; }
  int bits() const noexcept { return layout_.config.remainder_bits; }
  std::size_t bytes_reserved() const noexcept { return codes_.size(); }

  // Block b's codes (quantized_block_bytes of them).
  const std::uint8_t* codes(int slot, int layer, int kv_head, std::int64_t b) const noexcept {
    return codes_.data() + offset(slot, layer, kv_head, b);
  }

  // Codes block b of (slot, layer, kv_head) from its host rows (block: [K | V][block_tokens][head_dim]
  // of T) and its key summary ([max | min][head_dim]).
  template <class T>
  void encode(int slot, int layer, int kv_head, std::int64_t b, const T* block, const float* summary) {
    code_rows(block, layout_.config.block_tokens, summary, codes_.data() + offset(slot, layer, kv_head, b));
  }

  // The first `rows` rows of a host block coded into out (quantized_block_bytes bytes).
  template <class T>
  void code_rows(const T* block, int rows, const float* summary, std::uint8_t* out) {
    const int bt = layout_.config.block_tokens, d = layout_.config.shape.head_dim;
    keys_.resize(static_cast<std::size_t>(rows) * static_cast<std::size_t>(d));
    values_.resize(keys_.size());
    for (std::size_t i = 0; i < keys_.size(); ++i) {
      keys_[i] = to_float(block[i]);
      values_[i] = to_float(block[static_cast<std::size_t>(bt) * static_cast<std::size_t>(d) + i]);
    }
    encode_quantized_block(keys_.data(), values_.data(), rows, bt, d, bits(), summary, summary + d, out);
  }

  // A fork: dst's first `blocks` blocks of `layer` take src's codes, every kv head.
  void copy(int src, int dst, int layer, std::int64_t blocks) {
    if (!enabled_ || blocks <= 0) return;
    for (int h = 0; h < layout_.config.shape.num_kv_heads; ++h) {
      std::memcpy(codes_.data() + offset(dst, layer, h, 0), codes_.data() + offset(src, layer, h, 0),
                  static_cast<std::size_t>(blocks * layout_.quantized_block_bytes));
    }
  }

 private:
  std::size_t offset(int slot, int layer, int kv_head, std::int64_t b) const noexcept {
    return static_cast<std::size_t>(layout_.quantized_offset(slot, layer, kv_head, b));
  }

  CacheLayout layout_;
  bool enabled_;
  std::vector<std::uint8_t> codes_;
  std::vector<float> keys_, values_;  // scratch: one block's rows as floats
};

}  // namespace detail
}  // namespace v0
}  // namespace oasiskv
