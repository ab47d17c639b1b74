// Where a decode step's time goes (smollm2-generate --profile, oasiskv_engine_bench --profile): wall
// time per phase of the calling thread, summed over steps. The phases add up to the step: the
// engine's weight products (q/k/v, output and MLP, LM head), its attention kernel, and each cache
// call of the sparse path (append, prefetch with its planning, and attend less the kernel inside
// it: acquire, its wait for copies, release). The cache's own counters (LayerStatistics:
// acquire_wait_ns, copy_ns) and the pool's (ThreadPool::times) complete the picture.
#pragma once

#include <chrono>
#include <cstdint>

namespace smollm2 {

struct StepProfile {
  std::int64_t steps = 0;
  std::int64_t total_ns = 0;         // whole steps, embedding to logits
  std::int64_t qkv_ns = 0;           // RMSNorm, q/k/v products, RoPE
  std::int64_t attention_ns = 0;     // the attention kernel (dense, or over the view)
  std::int64_t output_mlp_ns = 0;    // output product and MLP
  std::int64_t logits_ns = 0;        // final norm and LM head
  std::int64_t append_ns = 0;        // Cache::append (and the rows' fp16 rounding)
  std::int64_t prefetch_ns = 0;      // Cache::prefetch: scoring, top-K, plan, copies it starts
  std::int64_t attend_cache_ns = 0;  // Cache::attend less the kernel: acquire (and its wait), release

  // Wall time since `start`, added to `field` when the profile is on.
  struct Phase {
    StepProfile* profile;
    std::int64_t StepProfile::*field;
    std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
    ~Phase() {
      if (profile != nullptr) {
        profile->*field +=
            std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
      }
    }
  };
};

}  // namespace smollm2
