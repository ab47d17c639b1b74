// Host code using oasiskv::cuda: runs anywhere (reports whether a device is present).
#include <cstdio>

#include <oasiskv/cuda/components.cuh>
#include <oasiskv/cuda/ops.cuh>

int main() {
  const int n = oasiskv::gpu::device_count();
  std::printf("consumer_cuda: %d CUDA device(s)\n", n);
  return 0;
}
