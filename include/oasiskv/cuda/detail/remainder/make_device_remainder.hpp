// make_device_remainder: the CUDA engine's remainder for CacheConfig::remainder
// (device_remainder.hpp), or none. The one place the CUDA backend tells the estimates apart.
#pragma once

#include <memory>

#include "oasiskv/config.hpp"
#include "oasiskv/cuda/detail/remainder/clusters.hpp"
#include "oasiskv/cuda/detail/remainder/device_remainder.hpp"
#include "oasiskv/cuda/detail/remainder/quantized.hpp"

namespace oasiskv {
inline namespace v0 {
namespace gpu::detail {

template <KvElement T>
std::unique_ptr<DeviceRemainder<T>> make_device_remainder(const RemainderContext<T>& ctx) {
  switch (ctx.layout->config.remainder) {
    case RemainderEstimate::none: return nullptr;
    case RemainderEstimate::clusters: return std::make_unique<DeviceClustersRemainder<T>>(ctx);
    case RemainderEstimate::quantized: return std::make_unique<DeviceQuantizedRemainder<T>>(ctx);
  }
  return nullptr;  // CacheLayout::from refused any other value
}

}  // namespace gpu::detail
}  // namespace v0
}  // namespace oasiskv
