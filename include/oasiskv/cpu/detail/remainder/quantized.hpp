// QuantizedRemainder<T>: `remainder = quantized` on the CPU: every full block's rows at
// CacheConfig::remainder_bits (QuantizedBlocks, coded when an append fills the block, against its
// final key summary; copied by a fork), and the estimate: the attention over the non-resident
// rows, decoded. A cache with this estimate refuses admissions (check_admission: the message
// carries no codes), so the admission hooks have nothing to do.
#pragma once

#include <cstdint>
#include <span>

#include "oasiskv/config.hpp"
#include "oasiskv/cpu/detail/remainder/quantized_blocks.hpp"
#include "oasiskv/cpu/detail/remainder/remainder_store.hpp"
#include "oasiskv/cpu/detail/summary_store.hpp"
#include "oasiskv/kit/tier.hpp"

namespace oasiskv {
inline namespace v0 {
namespace detail {

template <KvElement T>
class QuantizedRemainder final : public RemainderStore<T> {
 public:
  QuantizedRemainder(const CacheLayout& layout, const HostTier<T>& host, const SummaryStore& summaries)
      : layout_(layout), host_(host), summaries_(summaries), codes_(layout) {}

  const QuantizedBlocks& blocks() const noexcept { return codes_; }

  void appended(int slot, int layer, std::int64_t from, std::int64_t to) override {
    const std::int64_t bt = layout_.block_tokens();
    for (std::int64_t b = from / bt; b < to / bt; ++b) {  // the blocks this append filled
      for (int h = 0; h < layout_.num_kv_heads(); ++h) {
        codes_.encode(slot, layer, h, b, host_.block(slot, layer, h, b), summaries_.block(slot, layer, h, b));
      }
    }
  }
  // Blocks past the cut keep stale codes: a block is coded again when an append fills it, and the
  // partial one is coded from its rows at estimate time.
  void truncated(int, int, std::int64_t) override {}
  void forked(int src, int dst, int layer, std::int64_t length) override {
    codes_.copy(src, dst, layer, length / layout_.block_tokens());  // the partial block has none
  }
  void reset(int) override {}

  void estimate(int slot, int layer, int kv_head, std::int64_t length, std::span<const std::int32_t> resident,
                const RowsView& q, std::int64_t entry, std::int64_t rows, float* out, float* lse) override {
    codes_.remainder(
        slot, layer, kv_head, length, resident.data(), resident.data() + resident.size(), q, entry, rows,
        [&](std::int64_t b) { return summaries_.block(slot, layer, kv_head, b); },
        [&](std::int64_t b) { return host_.block(slot, layer, kv_head, b); }, out, lse);
  }

  void export_admission(int, std::int64_t, AdmissionMessage&) const override {}
  void admit(int, const AdmissionMessage&) override {}

 private:
  CacheLayout layout_;
  const HostTier<T>& host_;
  const SummaryStore& summaries_;
  QuantizedBlocks codes_;
};

}  // namespace detail
}  // namespace v0
}  // namespace oasiskv
