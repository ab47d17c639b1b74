// make_cuda_cache where the module is built without the CUDA backend: a refusal that says how to
// build it (caches.hpp).
#include <memory>

#include "caches.hpp"
#include "oasiskv/error.hpp"

namespace oasiskv::python {

bool cuda_built() noexcept { return false; }
int cuda_device_count() noexcept { return 0; }
int cuda_current_device() { return 0; }

std::unique_ptr<CacheBase> make_cuda_cache(const CacheConfig&, DType, int, std::uintptr_t) {
  fail("Cache(device='cuda'): this oasiskv module was built without the CUDA backend; build it with nvcc present: "
       "pip install . -C cmake.define.OASISKV_PYTHON_CUDA=ON");
}

}  // namespace oasiskv::python
