#include "oasiskv/kit/tier.hpp"
#include "oasiskv/kit/reserved_array.hpp"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "oasiskv/detail/checked.hpp"
#include "oasiskv/error.hpp"

namespace oasiskv {
inline namespace v0 {

MemoryReservation::MemoryReservation(std::size_t bytes) : bytes_(bytes) {
  if (bytes == 0) return;
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    fail("cannot reserve {} bytes of memory: {}", bytes, std::strerror(err));
  }
  data_ = static_cast<std::byte*>(p);
}

MemoryReservation::~MemoryReservation() {
  if (data_ != nullptr) ::munmap(data_, bytes_);
}

MemoryReservation::MemoryReservation(MemoryReservation&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

MemoryReservation& MemoryReservation::operator=(MemoryReservation&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) ::munmap(data_, bytes_);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

MemoryReservation detail::reserve_array(std::int64_t count, std::size_t size, const char* what) {
  const std::int64_t bytes = checked_mul(count, static_cast<std::int64_t>(size), what);
  try {
    return MemoryReservation(static_cast<std::size_t>(bytes));
  } catch (const Error& e) {
    fail("{}: {}", what, e.what());
  }
}

}  // namespace v0
}  // namespace oasiskv
