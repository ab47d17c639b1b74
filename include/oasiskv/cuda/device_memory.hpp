// RAII handles of the CUDA backend: device memory (DeviceBuffer), streams, events, and the
// current device (DeviceGuard).
//
// Host-only (g++ or nvcc), header-only. Nothing here touches the legacy default stream: a
// DeviceBuffer is allocated uninitialised, and fill_async fills it on the stream the caller
// names, so that the fill is ordered before that stream's later work and nothing else.
#pragma once

#include <cstddef>
#include <utility>

#include <cuda_runtime_api.h>

#include "oasiskv/cuda/check.hpp"

namespace oasiskv {
inline namespace v0 {
namespace gpu {

// cudaMalloc'd array of n elements, uninitialised (no implicit memset).
template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t n) : n_(n) {
    if (n == 0) return;
    void* p = nullptr;
    OASISKV_CUDA_CHECK(cudaMalloc(&p, n * sizeof(T)));
    data_ = static_cast<T*>(p);
  }
  ~DeviceBuffer() {
    if (data_ != nullptr) (void)cudaFree(data_);
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : data_(std::exchange(o.data_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      if (data_ != nullptr) (void)cudaFree(data_);
      data_ = std::exchange(o.data_, nullptr);
      n_ = std::exchange(o.n_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // Sets every byte to `byte` (cudaMemsetAsync on `stream`; capturable). 0xff fills int32 and
  // int64 arrays with -1.
  void fill_async(int byte, cudaStream_t stream) {
    if (data_ != nullptr) OASISKV_CUDA_CHECK(cudaMemsetAsync(data_, byte, bytes(), stream));
  }

  T* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return n_; }
  std::size_t bytes() const noexcept { return n_ * sizeof(T); }

 private:
  T* data_ = nullptr;
  std::size_t n_ = 0;
};

// A non-blocking stream (no implicit synchronisation with the legacy default stream).
class Stream {
 public:
  Stream() { OASISKV_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
  ~Stream() {
    if (s_ != nullptr) (void)cudaStreamDestroy(s_);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const noexcept { return s_; }
  operator cudaStream_t() const noexcept { return s_; }  // NOLINT: a stream handle
  void synchronize() const { OASISKV_CUDA_CHECK(cudaStreamSynchronize(s_)); }

 private:
  cudaStream_t s_ = nullptr;
};

// An event; without timing unless asked (cheapest to record and wait on).
class Event {
 public:
  explicit Event(bool timing = false) {
    OASISKV_CUDA_CHECK(cudaEventCreateWithFlags(&e_, timing ? cudaEventDefault : cudaEventDisableTiming));
  }
  ~Event() {
    if (e_ != nullptr) (void)cudaEventDestroy(e_);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  cudaEvent_t get() const noexcept { return e_; }
  void record(cudaStream_t s) { OASISKV_CUDA_CHECK(cudaEventRecord(e_, s)); }
  // Makes `s` wait for the last record (device side: the host does not wait).
  void wait_on(cudaStream_t s) const { OASISKV_CUDA_CHECK(cudaStreamWaitEvent(s, e_, 0)); }

 private:
  cudaEvent_t e_ = nullptr;
};

// Makes `device` the calling thread's current device for the guard's lifetime: records
// cudaGetDevice, calls cudaSetDevice only when the device differs, and restores the recorded
// device on destruction (errors there are ignored and cleared: a destructor does not throw).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    OASISKV_CUDA_CHECK(cudaGetDevice(&previous_));
    if (device != previous_) {
      OASISKV_CUDA_CHECK(cudaSetDevice(device));
      changed_ = true;
    }
  }
  ~DeviceGuard() {
    if (changed_ && cudaSetDevice(previous_) != cudaSuccess) (void)cudaGetLastError();
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

  int previous() const noexcept { return previous_; }

 private:
  int previous_ = 0;
  bool changed_ = false;
};

}  // namespace gpu
}  // namespace v0
}  // namespace oasiskv
