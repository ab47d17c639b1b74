// make_remainder_store: the CPU engine's store for CacheConfig::remainder (remainder_store.hpp),
// or none. The one place the CPU backend tells the estimates apart.
#pragma once

#include <memory>

#include "oasiskv/config.hpp"
#include "oasiskv/cpu/detail/remainder/clusters.hpp"
#include "oasiskv/cpu/detail/remainder/quantized.hpp"
#include "oasiskv/cpu/detail/remainder/remainder_store.hpp"
#include "oasiskv/cpu/detail/summary_store.hpp"
#include "oasiskv/kit/tier.hpp"

namespace oasiskv {
inline namespace v0 {
namespace detail {

template <KvElement T>
std::unique_ptr<RemainderStore<T>> make_remainder_store(const CacheLayout& layout, const HostTier<T>& host,
                                                        const SummaryStore& summaries) {
  switch (layout.config.remainder) {
    case RemainderEstimate::none: return nullptr;
    case RemainderEstimate::clusters: return std::make_unique<ClustersRemainder<T>>(layout, host);
    case RemainderEstimate::quantized: return std::make_unique<QuantizedRemainder<T>>(layout, host, summaries);
  }
  return nullptr;  // CacheLayout::from refused any other value
}

}  // namespace detail
}  // namespace v0
}  // namespace oasiskv
