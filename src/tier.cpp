#include "oasiskv/tier.hpp"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "oasiskv/error.hpp"

namespace oasiskv {
inline namespace v0 {

MemoryReservation::MemoryReservation(std::size_t bytes) : bytes_(bytes) {
  if (bytes == 0) return;
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
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

}  // namespace v0
}  // namespace oasiskv
