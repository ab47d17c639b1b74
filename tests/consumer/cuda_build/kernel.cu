// The templated device code compiles in a consumer's own CUDA translation unit.
#include <oasiskv/cuda/kernels.cuh>

void launch_consumer_append(const oasiskv::CacheLayout& g, const oasiskv::gpu::DeviceBatch& batch,
                            const std::int32_t* offsets, const float* k, const float* v,
                            const oasiskv::gpu::DeviceHostTier<float>& host, float* pool, float* summaries,
                            cudaStream_t stream) {
  oasiskv::gpu::kernels::append_kernel<float><<<dim3(1, 1), 32, 0, stream>>>(g, 0, batch, offsets, k, v, host, pool,
                                                                            summaries);
}
