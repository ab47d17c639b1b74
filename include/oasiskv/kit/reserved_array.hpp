// ReservedArray<T>: `count` values of a trivially copyable T in a MemoryReservation (tier.hpp):
// zero until written, and no memory committed for capacity that no row has reached. The stores
// sized by the whole capacity (key clusters, quantized block codes) use it as the host tier does.
#pragma once

#include <cstddef>
#include <cstdint>

#include "oasiskv/kit/tier.hpp"

namespace oasiskv {
inline namespace v0 {
namespace detail {

// A reservation of count x size bytes; an Error naming `what` and the bytes when the product
// overflows or the OS refuses (src/tier.cpp).
MemoryReservation reserve_array(std::int64_t count, std::size_t size, const char* what);

}  // namespace detail

template <class T>
class ReservedArray {
 public:
  ReservedArray() = default;
  ReservedArray(std::int64_t count, const char* what) : memory_(detail::reserve_array(count, sizeof(T), what)) {}

  T* data() noexcept { return reinterpret_cast<T*>(memory_.data()); }
  const T* data() const noexcept { return reinterpret_cast<const T*>(memory_.data()); }
  T& operator[](std::size_t i) noexcept { return data()[i]; }
  const T& operator[](std::size_t i) const noexcept { return data()[i]; }
  std::size_t size() const noexcept { return memory_.bytes() / sizeof(T); }
  std::size_t bytes() const noexcept { return memory_.bytes(); }

 private:
  MemoryReservation memory_;
};

}  // namespace v0
}  // namespace oasiskv
