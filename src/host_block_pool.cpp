#include "oasiskv/kit/host_block_pool.hpp"

#include <algorithm>

#include "oasiskv/error.hpp"

namespace oasiskv {
inline namespace v0 {

HostBlockPool::HostBlockPool(const CacheLayout& layout)
    : block_tokens_(layout.block_tokens()),
      max_blocks_(layout.max_blocks),
      map_(static_cast<std::size_t>(layout.config.max_sequences) * static_cast<std::size_t>(layout.max_blocks),
           kNoHostBlock),
      mapped_(static_cast<std::size_t>(layout.config.max_sequences), 0),
      refs_(static_cast<std::size_t>(layout.pool_blocks), 0) {
  free_.reserve(refs_.size());
  for (std::int64_t p = layout.pool_blocks - 1; p >= 0; --p) free_.push_back(static_cast<std::int32_t>(p));
}

namespace {
// Calls f(slot, block) for every block an append of `entries` writes, in order.
template <class F>
void for_each_written(std::span<const AppendEntry> entries, std::int64_t block_tokens, F&& f) {
  for (const AppendEntry& e : entries) {
    if (e.rows <= 0) continue;
    for (std::int64_t b = e.length / block_tokens; b <= (e.length + e.rows - 1) / block_tokens; ++b) f(e.slot, b);
  }
}
}  // namespace

// A shared block written by several sequences of one append: map_for_append gives each writer a
// copy while another holder remains, so the last of them writes the block itself. Copies of pool
// block p: min(its writers, refcount(p) - 1).
std::int64_t HostBlockPool::copies_on_write(std::span<const AppendEntry> entries) const {
  std::vector<std::int32_t> shared;  // one entry per write of a shared block
  for_each_written(entries, block_tokens_, [&](int slot, std::int64_t b) {
    const std::int32_t p = at(slot, b);
    if (p >= 0 && refcount(p) > 1) shared.push_back(p);
  });
  std::sort(shared.begin(), shared.end());
  std::int64_t n = 0;
  for (std::size_t i = 0; i < shared.size();) {
    std::size_t j = i;
    while (j < shared.size() && shared[j] == shared[i]) ++j;
    n += std::min<std::int64_t>(static_cast<std::int64_t>(j - i), refcount(shared[i]) - 1);
    i = j;
  }
  return n;
}

std::int64_t HostBlockPool::blocks_needed(std::span<const AppendEntry> entries) const {
  std::int64_t fresh = 0;
  for_each_written(entries, block_tokens_,
                   [&](int slot, std::int64_t b) { fresh += at(slot, b) == kNoHostBlock ? 1 : 0; });
  return fresh + copies_on_write(entries);
}

void HostBlockPool::map_for_append(std::span<const AppendEntry> entries, std::vector<BlockRemap>& changes) {
  for_each_written(entries, block_tokens_, [&](int slot, std::int64_t b) {
    const std::int32_t p = at(slot, b);
    if (p == kRemoteBlock) fail("host pool: an append writes remote block {} of slot {} (internal)", b, slot);
    if (p != kNoHostBlock && refcount(p) == 1) return;
    const std::int32_t q = take();
    if (p != kNoHostBlock) --refs_[static_cast<std::size_t>(p)];  // still held by another sequence
    map_[index(slot, b)] = q;
    // Appends are contiguous, so an unmapped block is the next one after the prefix.
    auto& mapped = mapped_[static_cast<std::size_t>(slot)];
    if (b >= mapped) mapped = b + 1;
    changes.push_back(BlockRemap{slot, b, p, q});
  });
}

void HostBlockPool::share(int src, int dst, std::int64_t blocks) {
  for (std::int64_t b = 0; b < blocks; ++b) {
    const std::int32_t p = map_[index(src, b)];
    map_[index(dst, b)] = p;
    if (p >= 0) ++refs_[static_cast<std::size_t>(p)];
  }
  mapped_[static_cast<std::size_t>(dst)] = blocks;
}

std::int64_t HostBlockPool::remote_end(int slot) const noexcept {
  for (std::int64_t b = mapped_blocks(slot) - 1; b >= 0; --b) {
    if (map_[index(slot, b)] == kRemoteBlock) return b + 1;
  }
  return 0;
}

std::int32_t HostBlockPool::map_next(int slot, bool remote) {
  auto& mapped = mapped_[static_cast<std::size_t>(slot)];
  const std::int32_t p = remote ? kRemoteBlock : take();
  map_[index(slot, mapped)] = p;
  ++mapped;
  return p;
}

void HostBlockPool::release_from(int slot, std::int64_t first) {
  auto& mapped = mapped_[static_cast<std::size_t>(slot)];
  for (std::int64_t b = mapped - 1; b >= first; --b) {
    drop(map_[index(slot, b)]);
    map_[index(slot, b)] = kNoHostBlock;
  }
  mapped = std::min(mapped, std::max<std::int64_t>(first, 0));
}

void HostBlockPool::undo(std::span<const BlockRemap> changes) {
  for (auto it = changes.rbegin(); it != changes.rend(); ++it) {
    drop(it->to);
    map_[index(it->slot, it->block)] = it->from;
    auto& mapped = mapped_[static_cast<std::size_t>(it->slot)];
    if (it->from == kNoHostBlock) {
      mapped = std::min(mapped, it->block);
    } else {
      ++refs_[static_cast<std::size_t>(it->from)];
    }
  }
}

std::int32_t HostBlockPool::take() {
  if (free_.empty()) fail("host pool: no free block (internal: the Cache checks blocks_needed first)");
  const std::int32_t p = free_.back();
  free_.pop_back();
  refs_[static_cast<std::size_t>(p)] = 1;
  return p;
}

void HostBlockPool::drop(std::int32_t p) {
  if (p == kRemoteBlock) return;  // not the pool's
  if (--refs_[static_cast<std::size_t>(p)] == 0) free_.push_back(p);
}

}  // namespace v0
}  // namespace oasiskv
