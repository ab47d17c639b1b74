// Gather copy: 8 KB blocks (one kv head's K and V for 16 tokens of fp16, head dim 128) from
// random places in a host pool into random slots of a slot pool, as the prefetch pipeline's copy
// engine does, against one contiguous memcpy of the same bytes with equally cold sources.
#include "bench_support.hpp"

#include <cstring>
#include <memory>
#include <vector>

namespace oasiskv::bench {
namespace {

// A host pool bigger than the last-level cache (so sources come from DRAM, as the host tier's do)
// and a slot pool the size of one layer's device tier for batch 8 (8 x 8 kv heads x 128 slots).
// Both are MemoryReservations, the memory of the CPU backend's host tier and slot pool: page
// aligned, so blocks start on cache lines as they do there (a malloc'ed pool starts 16 bytes into
// a page, and every block copy would then split cache lines).
struct Pools {
  static constexpr std::size_t kHostBlocks = 65536;  // 512 MiB
  static constexpr std::size_t kSlots = kBatch * kKvHeads * (kBudgetTokens / kBlockTokens);  // 64 MiB
  MemoryReservation host_memory{kHostBlocks * kBlockBytes};
  MemoryReservation slot_memory{kSlots * kBlockBytes};
  struct Base {
    std::byte* p;
    std::byte* get() const noexcept { return p; }
  };
  Base host{host_memory.data()};
  Base slots{slot_memory.data()};
  Pools() {
    std::memset(host.get(), 1, kHostBlocks * kBlockBytes);
    std::memset(slots.get(), 2, kSlots * kBlockBytes);
  }
  static Pools& get() {
    static Pools pools;
    return pools;
  }
};

// `rounds` different copy lists of `blocks` copies each: distinct random slots, random sources.
std::vector<std::vector<BlockCopy>> copy_lists(std::size_t blocks, std::size_t rounds) {
  Pools& p = Pools::get();
  Random r(17);
  std::vector<std::size_t> slot_order(Pools::kSlots);
  for (std::size_t i = 0; i < slot_order.size(); ++i) slot_order[i] = i;
  std::vector<std::vector<BlockCopy>> lists(rounds);
  for (auto& list : lists) {
    for (std::size_t i = 0; i < blocks; ++i) std::swap(slot_order[i], slot_order[i + r.next() % (slot_order.size() - i)]);
    for (std::size_t i = 0; i < blocks; ++i) {
      list.push_back(BlockCopy{p.host.get() + (r.next() % Pools::kHostBlocks) * kBlockBytes,
                               p.slots.get() + slot_order[i] * kBlockBytes, kBlockBytes});
    }
  }
  return lists;
}

constexpr std::size_t kRounds = 16;

// The copy engine's inner loop (CopyWorker::run): detail::copy_blocks over one list (streaming
// stores for a batch this large: src/cpu/block_copy.cpp says why).
void BM_GatherCopy(benchmark::State& state) {
  const auto blocks = static_cast<std::size_t>(state.range(0));
  const auto lists = copy_lists(blocks, kRounds);
  std::size_t round = 0;
  for (auto _ : state) {
    detail::copy_blocks(lists[round]);
    benchmark::ClobberMemory();
    round = (round + 1) % kRounds;
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(blocks * kBlockBytes) * state.iterations());
  set_reference(state, "BM_MemcpyContiguous/blocks:" + std::to_string(blocks));
}

// The same copies through the CPU backend's CopyWorker: submit one ticket of 8 per-sequence
// plans, copied on the worker thread, and wait for it (thread hand-off included).
void BM_PipelineGather(benchmark::State& state) {
  const auto blocks = static_cast<std::size_t>(state.range(0));
  const auto lists = copy_lists(blocks, kRounds);
  CopyWorker worker(kBatch, /*layers*/ 1, /*threaded*/ true);
  std::size_t round = 0;
  std::uint64_t ticket = 1;
  for (auto _ : state) {
    std::vector<PlanCopies> plans(kBatch);
    const auto& list = lists[round];
    for (int s = 0; s < kBatch; ++s) {
      auto& p = plans[static_cast<std::size_t>(s)];
      p.seq_slot = s;
      const std::size_t begin = list.size() * static_cast<std::size_t>(s) / kBatch;
      const std::size_t end = list.size() * static_cast<std::size_t>(s + 1) / kBatch;
      p.copies.assign(list.begin() + static_cast<std::ptrdiff_t>(begin), list.begin() + static_cast<std::ptrdiff_t>(end));
    }
    worker.submit(ticket, std::move(plans));
    worker.wait(ticket);
    ++ticket;
    round = (round + 1) % kRounds;
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(blocks * kBlockBytes) * state.iterations());
  set_reference(state, "BM_MemcpyContiguous/blocks:" + std::to_string(blocks));
}

// Reference: one memcpy of the same bytes, source and destination moving through the same
// pools so that the source is as cold as the gather's.
void BM_MemcpyContiguous(benchmark::State& state) {
  const auto blocks = static_cast<std::size_t>(state.range(0));
  Pools& p = Pools::get();
  const std::size_t bytes = blocks * kBlockBytes;
  const std::size_t host_positions = Pools::kHostBlocks / blocks, slot_positions = Pools::kSlots / blocks;
  std::size_t i = 0;
  for (auto _ : state) {
    std::memcpy(p.slots.get() + (i % slot_positions) * bytes, p.host.get() + (i * 7 % host_positions) * bytes, bytes);
    benchmark::ClobberMemory();
    ++i;
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
}

// 384 blocks: fetch ratio 0.05 for one layer of batch 8 (64 pairs x 6 admits, 3 MiB);
// 7,808: every selectable slot of the layer refreshed (64 x 122, 61 MiB).
constexpr std::int64_t kCappedBlocks = kBatch * kKvHeads * 6;
constexpr std::int64_t kAllBlocks = kBatch * kKvHeads * 122;
BENCHMARK(BM_GatherCopy)->UseRealTime()->ArgName("blocks")->Arg(kCappedBlocks)->Arg(kAllBlocks);
BENCHMARK(BM_PipelineGather)->UseRealTime()->ArgName("blocks")->Arg(kCappedBlocks)->Arg(kAllBlocks);
BENCHMARK(BM_MemcpyContiguous)->UseRealTime()->ArgName("blocks")->Arg(kCappedBlocks)->Arg(kAllBlocks);

}  // namespace
}  // namespace oasiskv::bench
