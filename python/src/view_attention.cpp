// LayerView.attention (view_attention.hpp): the baseline kernel and the choice of copy.
#include "view_attention.hpp"

#include <vector>

#include <oasiskv/cpu/isa.hpp>

#define OASISKV_VIEW_ATTENTION_KERNEL view_attention_baseline
#include "view_attention_kernel.inc"

namespace oasiskv::python {
namespace {

using Kernel = void (*)(const ViewAttentionArgs&, int, int, float*, int*);

// The library's level in use (oasiskv/cpu/isa.hpp: the CPU's, capped by OASISKV_CPU_ISA; it throws
// naming a value it cannot honour). avx2 includes FMA.
Kernel pick_kernel() {
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
  if (oasiskv::cpu_isa() >= oasiskv::CpuIsa::avx2) return detail::view_attention_avx2;
#endif
  return detail::view_attention_baseline;
}

}  // namespace

std::int64_t view_attention_scratch(const ViewAttentionArgs& a) {
  const std::int64_t d = a.head_dim, bt = a.block_tokens;
  const std::int64_t queries = static_cast<std::int64_t>(a.num_q_heads / a.num_kv_heads) * a.rows;
  return 2 * bt * d + queries * (d + bt + 2);
}

void view_attention(const ViewAttentionArgs& args) {
  static const Kernel kernel = pick_kernel();
  const int pairs = args.batch_size * args.num_kv_heads;
  if (pairs <= 0) return;
  std::vector<float> scratch(static_cast<std::size_t>(view_attention_scratch(args)));
  std::vector<int> seen_by_row(static_cast<std::size_t>(args.rows));
  kernel(args, 0, pairs, scratch.data(), seen_by_row.data());
}

}  // namespace oasiskv::python
