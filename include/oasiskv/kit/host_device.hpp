// OASISKV_HD marks functions that device code calls too (the geometry of CacheLayout). Empty
// for a host compiler, __host__ __device__ under nvcc.
#pragma once

#if defined(__CUDACC__)
#define OASISKV_HD __host__ __device__
#else
#define OASISKV_HD
#endif
