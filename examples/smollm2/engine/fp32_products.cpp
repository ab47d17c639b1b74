// The fp32 dot products and the fp32 weight path's matrix product, compiled once per level
// (isa_kernels.hpp): plain loops over sixteen independent lanes, which each level's compiler flags
// vectorise (with FMA from avx2 on) without permission to reassociate float sums.
#include <algorithm>
#include <cstddef>

#include "isa_kernels.hpp"
#include "thread_pool.hpp"

namespace smollm2::SMOLLM2_ISA_NAMESPACE {
namespace {

// Sixteen independent lanes: the compiler vectorises the lane loop without needing permission to
// reassociate float sums (no -ffast-math), and each lane is one SIMD element.
constexpr int kLanes = 16;

// a * b + c in one rounding where the level has FMA. The level files are compiled with
// -ffp-contract=off, so every fused multiply-add is one written here: whether the compiler
// vectorises a loop (at avx512 it turns a short in-order sum into unfused vector multiplies)
// cannot change the bits between avx2 and avx512.
inline float mul_add(float a, float b, float c) {
#ifdef __FMA__
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

}  // namespace

float dot(const float* a, const float* b, int n) {
  float acc[kLanes] = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] = mul_add(a[i + j], b[i + j], acc[j]);
  float s = 0.0f;
  for (; i < n; ++i) s = mul_add(a[i], b[i], s);
  for (int j = 0; j < kLanes; ++j) s += acc[j];
  return s;
}

// Four activation rows against one weight row: each weight load feeds four accumulators.
void dot4(const float* w, const float* x0, const float* x1, const float* x2, const float* x3, int n, float* out) {
  float a0[kLanes] = {}, a1[kLanes] = {}, a2[kLanes] = {}, a3[kLanes] = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float wj = w[i + j];
      a0[j] = mul_add(wj, x0[i + j], a0[j]);
      a1[j] = mul_add(wj, x1[i + j], a1[j]);
      a2[j] = mul_add(wj, x2[i + j], a2[j]);
      a3[j] = mul_add(wj, x3[i + j], a3[j]);
    }
  }
  float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  for (; i < n; ++i) {
    s0 = mul_add(w[i], x0[i], s0);
    s1 = mul_add(w[i], x1[i], s1);
    s2 = mul_add(w[i], x2[i], s2);
    s3 = mul_add(w[i], x3[i], s3);
  }
  for (int j = 0; j < kLanes; ++j) {
    s0 += a0[j];
    s1 += a1[j];
    s2 += a2[j];
    s3 += a3[j];
  }
  out[0] = s0;
  out[1] = s1;
  out[2] = s2;
  out[3] = s3;
}

void matmul_fp32(const float* w, int out, int in, const float* x, int rows, float* y) {
  // Output rows in chunks over the engine's threads; activation rows in tiles that stay in L2
  // while the chunk's weight rows stream past them once.
  constexpr int kRowTile = 64;
  ThreadPool& pool = engine_pool();
  const int chunk = std::max(8, (out + 8 * pool.threads() - 1) / (8 * pool.threads()));
  pool.run((out + chunk - 1) / chunk, [&](int task) {
    const int o0 = task * chunk, o1 = std::min(out, o0 + chunk);
    for (int r0 = 0; r0 < rows; r0 += kRowTile) {
      const int r1 = std::min(rows, r0 + kRowTile);
      for (int o = o0; o < o1; ++o) {
        const float* wr = w + static_cast<std::size_t>(o) * in;
        int r = r0;
        for (; r + 4 <= r1; r += 4) {
          float s[4];
          const float* xr = x + static_cast<std::size_t>(r) * in;
          dot4(wr, xr, xr + in, xr + 2 * in, xr + 3 * in, in, s);
          for (int j = 0; j < 4; ++j) y[static_cast<std::size_t>(r + j) * out + o] = s[j];
        }
        for (; r < r1; ++r) y[static_cast<std::size_t>(r) * out + o] = dot(wr, x + static_cast<std::size_t>(r) * in, in);
      }
    }
  });
}

}  // namespace smollm2::SMOLLM2_ISA_NAMESPACE
