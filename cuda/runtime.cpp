// Host code of the CUDA backend (compiled by the host compiler, linked with the CUDA runtime):
// error translation, device queries and the pinned host region.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "oasiskv/cuda/check.hpp"
#include "oasiskv/cuda/pinned_region.hpp"
#include "oasiskv/error.hpp"

namespace oasiskv {
inline namespace v0 {
namespace gpu {

void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line) {
  (void)cudaGetLastError();  // clear a non-sticky error so that later calls start clean
  throw Error(
      fmt::format("{} failed: {} ({}) [{}:{}]", call, cudaGetErrorName(err), cudaGetErrorString(err), file, line));
}

void throw_error(const std::string& what) { throw Error(what); }

int device_count() noexcept {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

bool device_available() noexcept { return device_count() > 0; }

namespace {
void warn(const std::string& what) { std::fprintf(stderr, "oasiskv: warning: %s\n", what.c_str()); }
}  // namespace

PinnedRegion::PinnedRegion(std::size_t bytes, std::size_t align, std::size_t max_chunk) : bytes_(bytes) {
  if (bytes == 0) return;
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    const int e = errno;
    fail("cannot reserve {} bytes of host memory: {}", bytes, std::strerror(e));
  }
  data_ = static_cast<std::byte*>(p);
  if (!device_available()) {
    warn(fmt::format("no CUDA device: the host tier ({} bytes) stays in ordinary pageable memory", bytes));
    return;
  }
  // Chunks: multiples of both the page size and `align`, at most max_chunk.
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  const std::size_t unit = std::lcm(page, align == 0 ? 1 : align);
  std::size_t chunk = max_chunk / unit * unit;
  if (chunk == 0) chunk = unit;
  for (std::size_t off = 0; off < bytes; off += chunk) {
    const std::size_t len = std::min(chunk, bytes - off);
    const cudaError_t err = cudaHostRegister(data_ + off, len, cudaHostRegisterMapped | cudaHostRegisterPortable);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      warn(
          fmt::format("cudaHostRegister of {} bytes at offset {} failed: {} ({}); the host tier ({} bytes) "
                      "stays in pageable memory (copies are slower, no zero-copy gather)",
                      len, off, cudaGetErrorName(err), cudaGetErrorString(err), bytes));
      release();
      return;
    }
    chunks_.emplace_back(data_ + off, len);
  }
  // Under UVA (every 64-bit platform CUDA 13 supports) the mapped address is the host address;
  // check every chunk, since kernels address the region as one array.
  for (const auto& [ptr, len] : chunks_) {
    void* dp = nullptr;
    const cudaError_t err = cudaHostGetDevicePointer(&dp, ptr, 0);
    if (err != cudaSuccess || dp != ptr) {
      (void)cudaGetLastError();
      warn(
          fmt::format("pinned host memory is not mapped at its host address ({}); the host tier stays in "
                      "pageable memory",
                      err != cudaSuccess ? cudaGetErrorName(err) : "different device address"));
      release();
      return;
    }
  }
  device_ = data_;
  pinned_ = true;
}

void PinnedRegion::release() noexcept {
  for (const auto& c : chunks_) (void)cudaHostUnregister(c.first);
  (void)cudaGetLastError();
  chunks_.clear();
  pinned_ = false;
  device_ = nullptr;
}

PinnedRegion::~PinnedRegion() {
  release();
  if (data_ != nullptr) ::munmap(data_, bytes_);
}

PinnedRegion::PinnedRegion(PinnedRegion&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)),
      device_(std::exchange(o.device_, nullptr)),
      bytes_(std::exchange(o.bytes_, 0)),
      pinned_(std::exchange(o.pinned_, false)),
      chunks_(std::move(o.chunks_)) {}

PinnedRegion& PinnedRegion::operator=(PinnedRegion&& o) noexcept {
  if (this != &o) {
    release();
    if (data_ != nullptr) ::munmap(data_, bytes_);
    data_ = std::exchange(o.data_, nullptr);
    device_ = std::exchange(o.device_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
    pinned_ = std::exchange(o.pinned_, false);
    chunks_ = std::move(o.chunks_);
  }
  return *this;
}

}  // namespace gpu
}  // namespace v0
}  // namespace oasiskv
