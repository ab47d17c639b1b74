// make_cpu_cache: Cache<cpu, T> for the module (caches.hpp).
#include <memory>

#include "caches.hpp"
#include "oasiskv/cpu/cache.hpp"

namespace oasiskv::python {

std::unique_ptr<CacheBase> make_cpu_cache(const CacheConfig& config, DType dtype, bool copy_thread, int threads) {
  if (threads < 1) fail("Cache: threads {} is below 1", threads);
  const CpuOptions options{.copy_thread = copy_thread};
  auto pool = threads > 1 ? std::make_unique<ThreadPool>(threads) : nullptr;
  switch (dtype) {
    case DType::f32: return std::make_unique<CacheImpl<cpu, float>>(config, std::move(pool), options, Placement{});
    case DType::f16: return std::make_unique<CacheImpl<cpu, fp16_t>>(config, std::move(pool), options, Placement{});
    case DType::bf16: return std::make_unique<CacheImpl<cpu, bf16_t>>(config, std::move(pool), options, Placement{});
  }
  fail("Cache: unknown dtype {}", static_cast<int>(dtype));
}

}  // namespace oasiskv::python
