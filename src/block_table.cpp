#include <atomic>

#include "oasiskv/detail/block_table.hpp"

namespace oasiskv {
inline namespace v0 {

// Process-wide: a ticket of one cache can never carry a generation another cache's slot has.
std::uint32_t BlockTable::next_generation() noexcept {
  static std::atomic<std::uint32_t> last{0};
  return last.fetch_add(1, std::memory_order_relaxed) + 1;
}

}  // namespace v0
}  // namespace oasiskv

namespace oasiskv {
inline namespace v0 {
namespace detail {

std::uint64_t next_cache_id() noexcept {
  static std::atomic<std::uint64_t> last{0};
  return last.fetch_add(1, std::memory_order_relaxed) + 1;
}

}  // namespace detail
}  // namespace v0
}  // namespace oasiskv
