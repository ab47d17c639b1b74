// detail::copy_blocks: the CPU copy engine's loop (CopyWorker, and the benchmark that measures it).
//
// Why a memcpy per block is slow for a large batch (bench/bench_gather_copy.cpp): each 8 KiB
// destination is a cold slot, so every line written is first read from memory (write-allocate),
// 1.5x the traffic of the copy, and glibc's memcpy keeps regular stores at these sizes (its
// non-temporal threshold is a share of the L3, hundreds of MiB here); a contiguous copy of the
// same bytes also walks its pages in order, while scattered blocks start a page walk and a
// prefetch stream at every page. So a large batch: streaming (non-temporal) stores, which write
// whole lines without reading them, and a touch of the next copy's pages (one line each, source
// and destination) while this one runs. A small batch keeps memcpy: its destinations may still be
// in cache when attention reads them.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_features.hpp"
#include "oasiskv/cpu/detail/cpu_kernels.hpp"
#include "stream_store.hpp"

namespace oasiskv {
inline namespace v0 {
namespace detail {
namespace {

// Batches from this many bytes stream (about a quarter of a core's L2 on current x86 servers:
// larger batches would not stay cached for the attention that reads them).
constexpr std::size_t kStreamBytes = std::size_t{256} << 10;
constexpr std::size_t kPage = 4096;

void touch_pages(const BlockCopy& c) noexcept {
  const auto* s = static_cast<const char*>(c.src);
  auto* d = static_cast<char*>(c.dst);
  for (std::size_t o = 0; o < c.bytes; o += kPage) {
#if OASISKV_X86_KERNELS
    prefetch_read(s + o);
    prefetch_read(d + o);  // the page walk is the point; prefetchw would read the line to own it
#else
    __builtin_prefetch(s + o, 0);
    __builtin_prefetch(d + o, 1);
#endif
  }
}

#if OASISKV_X86_KERNELS

template <class Stream>
void stream_all(std::span<const BlockCopy> copies, Stream stream) noexcept {
  for (std::size_t i = 0; i < copies.size(); ++i) {
    if (i + 1 < copies.size()) touch_pages(copies[i + 1]);
    const BlockCopy& c = copies[i];
    stream(static_cast<char*>(c.dst), static_cast<const char*>(c.src), c.bytes);
  }
  // Streaming stores are weakly ordered: complete them before anyone is told the copies are done.
  store_fence();
}

#endif  // OASISKV_X86_KERNELS

}  // namespace

void stream_fence() noexcept {
#if OASISKV_X86_KERNELS
  store_fence();
#endif
}

void copy_blocks(std::span<const BlockCopy> copies) noexcept {
  std::size_t total = 0;
  for (const BlockCopy& c : copies) total += c.bytes;
#if OASISKV_X86_KERNELS
  if (total >= kStreamBytes) {
    const CpuFeatures f = usable_features();
    if (f.avx) return stream_all(copies, stream_avx);
    if (f.sse2) return stream_all(copies, stream_sse2);
  }
#endif
  const bool large = total >= kStreamBytes;
  for (std::size_t i = 0; i < copies.size(); ++i) {
    if (large && i + 1 < copies.size()) touch_pages(copies[i + 1]);
    std::memcpy(copies[i].dst, copies[i].src, copies[i].bytes);
  }
}

}  // namespace detail
}  // namespace v0
}  // namespace oasiskv
