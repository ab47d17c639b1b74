// Backend tags. Components are templated on one of them; the CPU backend defines correctness.
#pragma once

namespace oasiskv {
inline namespace v0 {

// Everything in host memory; the copy engine is a worker thread.
struct cpu {};

// Working set in GPU memory; kernels in cuda/ (target oasiskv::cuda).
struct cuda {};

}  // namespace v0
}  // namespace oasiskv
