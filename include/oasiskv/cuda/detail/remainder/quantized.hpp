// DeviceQuantizedRemainder<T>: `remainder = quantized` on the device (the twin of the CPU's
// cpu/detail/remainder/quantized.hpp): every block's codes (CacheLayout::quantized_offset),
// written by append's, truncate's and fork's companions from the host rows and the summaries, so
// every block with rows has codes (the partial one's of its rows so far: the bytes the CPU codes
// when it meets it), and the attention over the decoded rows the view leaves out. Such a cache
// refuses admissions (check_admission). Host code.
#pragma once

#include <cstdint>
#include <span>

#include "oasiskv/cuda/detail/remainder/device_remainder.hpp"
#include "oasiskv/cuda/device_memory.hpp"

namespace oasiskv {
inline namespace v0 {
namespace gpu::detail {

template <KvElement T>
class DeviceQuantizedRemainder final : public DeviceRemainder<T> {
 public:
  explicit DeviceQuantizedRemainder(const RemainderContext<T>& ctx)
      : ctx_(ctx), codes_(static_cast<std::size_t>(ctx.layout->remainder.quantized_bytes)) {}

  // The block codes on the device (for tests).
  const std::uint8_t* codes() const noexcept { return codes_.data(); }

  void reset(int) override {}
  void appended(int layer, const DeviceBatch& batch, const std::int32_t* row_offset, const T*, const T*,
                std::span<const AppendEntry>) override {
    append_quantized<T>(*ctx_.device_layout, layer, batch, row_offset, ctx_.host, ctx_.summaries, codes_.data(),
                        ctx_.compute);
  }
  void truncated(int slot, int layer, std::int64_t length) override {
    rebuild_quantized<T>(*ctx_.device_layout, slot, slot, layer, length, ctx_.host, ctx_.summaries, codes_.data(),
                         ctx_.compute);
  }
  void forked(int src, int dst, int layer, std::int64_t length) override {
    rebuild_quantized<T>(*ctx_.device_layout, src, dst, layer, length, ctx_.host, ctx_.summaries, codes_.data(),
                         ctx_.compute);
  }
  void estimate(int layer, const DeviceBatch& batch, const std::int32_t* indptr, const std::int32_t* block,
                const RowsView& q, std::int64_t rows, float* out, float* lse) override {
    if (q.dtype == DType::f32) {
      remainder_quantized<float>(*ctx_.device_layout, layer, batch, indptr, block, static_cast<const float*>(q.data),
                                 static_cast<int>(rows), ctx_.summaries, codes_.data(), out, lse, ctx_.compute);
    } else {
      remainder_quantized<T>(*ctx_.device_layout, layer, batch, indptr, block, static_cast<const T*>(q.data),
                             static_cast<int>(rows), ctx_.summaries, codes_.data(), out, lse, ctx_.compute);
    }
  }
  void admit(int, const AdmissionMessage&) override {}  // refused before (check_admission)

 private:
  RemainderContext<T> ctx_;
  DeviceBuffer<std::uint8_t> codes_;
};

}  // namespace gpu::detail
}  // namespace v0
}  // namespace oasiskv
