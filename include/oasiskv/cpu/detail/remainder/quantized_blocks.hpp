// QuantizedBlocks: the CPU backend's store of RemainderEstimate::quantized. Every full block of a
// (sequence slot, layer, kv head) holds its rows coded at CacheConfig::remainder_bits
// (quantized_rows.hpp), written when an append fills the block (its key summary is final then) and
// copied by a fork for the blocks below the fork point. A partial block has no codes: the
// recent ring always holds it, and remainder codes one it meets from its host rows (code_rows) so
// that every non-resident row is counted the same way. remainder is the CPU backend's
// Cache::remainder for this estimate.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "oasiskv/config.hpp"
#include "oasiskv/detail/checked.hpp"
#include "oasiskv/dtype.hpp"
#include "oasiskv/kit/quantized_rows.hpp"
#include "oasiskv/kit/reserved_array.hpp"

namespace oasiskv {
inline namespace v0 {
namespace detail {

class QuantizedBlocks {
 public:
  explicit QuantizedBlocks(const CacheLayout& layout)
      : layout_(layout),
        enabled_(layout.config.remainder == RemainderEstimate::quantized),
        codes_(layout.remainder.quantized_bytes, "remainder = quantized: the block codes") {}

  bool enabled() const noexcept { return enabled_; }
  int bits() const noexcept { return layout_.config.remainder_bits; }
  // Address space for every block's codes; pages are committed as blocks fill.
  std::size_t bytes_reserved() const noexcept { return codes_.bytes(); }

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

  // Cache::remainder for batch entry `entry` and kv head `kv_head` of (slot, layer) at `length`:
  // per query row r < rows of q ([entries * rows][q_heads][head_dim]) and query head g of the kv
  // head's group, the attention over the decoded rows of every block of [0, blocks_for(length))
  // outside the ascending resident blocks [res, res_end), each score lowered by its noise offset,
  // into out / lse at the state's index (lse -inf, out 0 when no block is left out). Each block is
  // decoded once for the group's states. summary(b): block b's [max | min][head_dim]; rows(b): its
  // host rows (a partial block, normally held by the recent ring, is coded from them here).
  template <class Summary, class Rows>
  void remainder(int slot, int layer, int kv_head, std::int64_t length, const std::int32_t* res,
                 const std::int32_t* res_end, RowsView q, std::int64_t entry, std::int64_t rows, Summary&& summary,
                 Rows&& host_rows, float* out, float* lse) {
    const int G = layout_.group_size, d = layout_.head_dim(), Q = layout_.num_q_heads(), bt = layout_.block_tokens();
    const auto D = static_cast<std::size_t>(d), states = static_cast<std::size_t>(rows) * static_cast<std::size_t>(G);
    const float scale = layout_.softmax_scale;
    decoded_.resize(2 * static_cast<std::size_t>(bt) * D);
    noise_.resize(D);
    partial_.resize(static_cast<std::size_t>(layout_.remainder.quantized_block_bytes));
    scores_.resize(static_cast<std::size_t>(bt));
    query_.resize(states * D);
    const auto state_of = [&](std::size_t s) {  // s = r * G + g -> [entry * rows + r][kv_head * G + g]
      return (entry * rows + static_cast<std::int64_t>(s) / G) * Q + kv_head * G + static_cast<std::int64_t>(s) % G;
    };
    for (std::size_t s = 0; s < states; ++s) {
      const auto src = static_cast<std::size_t>(state_of(s)) * D;
      for (std::size_t c = 0; c < D; ++c) query_[s * D + c] = load_as_float(q.data, q.dtype, src + c);
    }
    attention_.assign(states, RowsAttention{});
    acc_.assign(states * D, 0.0f);
    float* keys = decoded_.data();
    float* values = decoded_.data() + static_cast<std::size_t>(bt) * D;
    for (std::int64_t b = 0; b < layout_.blocks_for(length); ++b) {
      if (res != res_end && *res == b) {
        ++res;
        continue;
      }
      const int n = static_cast<int>(std::min<std::int64_t>(bt, length - b * bt));
      const float* sm = summary(b);
      const std::uint8_t* block_codes = codes(slot, layer, kv_head, b);
      if (n < bt) {
        code_rows(host_rows(b), n, sm, partial_.data());
        block_codes = partial_.data();
      }
      decode_quantized_block(block_codes, n, bt, d, bits(), sm, sm + d, keys, values);
      quantized_key_noise(sm, sm + d, d, bits(), noise_.data());
      for (std::size_t s = 0; s < states; ++s) {
        const float* qs = query_.data() + s * D;
        attend_rows(qs, keys, values, n, d, scale, quantized_score_offset(qs, noise_.data(), d, scale), attention_[s],
                    acc_.data() + s * D, scores_.data());
      }
    }
    for (std::size_t s = 0; s < states; ++s) {
      const auto state = static_cast<std::size_t>(state_of(s));
      const RowsAttention& st = attention_[s];
      const float inv = st.sum > 0.0f ? 1.0f / st.sum : 0.0f;
      for (std::size_t c = 0; c < D; ++c) out[state * D + c] = acc_[s * D + c] * inv;
      lse[state] = st.sum > 0.0f ? st.max + std::log(st.sum) : -INFINITY;
    }
  }

  // A fork: dst's first `blocks` blocks of `layer` take src's codes, every kv head.
  void copy(int src, int dst, int layer, std::int64_t blocks) {
    if (!enabled_ || blocks <= 0) return;
    for (int h = 0; h < layout_.config.shape.num_kv_heads; ++h) {
      std::memcpy(codes_.data() + offset(dst, layer, h, 0), codes_.data() + offset(src, layer, h, 0),
                  static_cast<std::size_t>(blocks * layout_.remainder.quantized_block_bytes));
    }
  }

 private:
  std::size_t offset(int slot, int layer, int kv_head, std::int64_t b) const noexcept {
    return static_cast<std::size_t>(layout_.quantized_offset(slot, layer, kv_head, b));
  }

  CacheLayout layout_;
  bool enabled_;
  ReservedArray<std::uint8_t> codes_;
  std::vector<float> keys_, values_;  // scratch: one block's rows as floats (code_rows)
  // remainder's scratch: a block's decoded rows, its key noise, the group's queries, sums and scores
  std::vector<float> decoded_, noise_, query_, acc_, scores_;
  std::vector<RowsAttention> attention_;
  std::vector<std::uint8_t> partial_;  // a partial block's codes
};

}  // namespace detail
}  // namespace v0
}  // namespace oasiskv
