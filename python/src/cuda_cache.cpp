// make_cuda_cache: Cache<cuda, T> for the module (caches.hpp), built where the module is built
// with the CUDA backend (OASISKV_PYTHON_CUDA). The cache lives on `device`; its compute stream is
// the one the caller named (the current torch stream by default: the Python side picks it).
#include <cuda_runtime_api.h>

#include <memory>

#include "caches.hpp"
#include "oasiskv/cuda/cache.hpp"

namespace oasiskv::python {

bool cuda_built() noexcept { return true; }
int cuda_device_count() noexcept { return gpu::device_count(); }
int cuda_current_device() {
  int d = 0;
  OASISKV_CUDA_CHECK(cudaGetDevice(&d));
  return d;
}

std::unique_ptr<CacheBase> make_cuda_cache(const CacheConfig& config, DType dtype, int device, std::uintptr_t stream) {
  const int devices = cuda_device_count();
  if (devices == 0) {
    fail("Cache(device='cuda'): no CUDA device is present (this module has the CUDA backend, but the CUDA runtime "
         "sees no GPU)");
  }
  if (device < 0 || device >= devices) fail("Cache: device cuda:{} is outside the {} device(s) present", device, devices);
  gpu::DeviceGuard guard(device);  // the cache records the current device
  const CudaOptions options{.compute_stream = reinterpret_cast<cudaStream_t>(stream)};
  const Placement placement{true, device, stream};
  switch (dtype) {
    case DType::f32: return std::make_unique<CacheImpl<cuda, float>>(config, options, placement);
    case DType::f16: return std::make_unique<CacheImpl<cuda, fp16_t>>(config, options, placement);
    case DType::bf16: return std::make_unique<CacheImpl<cuda, bf16_t>>(config, options, placement);
  }
  fail("Cache: unknown dtype {}", static_cast<int>(dtype));
}

}  // namespace oasiskv::python
