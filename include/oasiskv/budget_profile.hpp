// BudgetProfile: the slot budget of every (layer, kv head), under the total the user configured
// (CacheConfig::budget_tokens per head on average), split by need. A Cache
// built with a profile packs its slot pools per (layer, kv head); without one every head has
// budget_tokens / block_tokens slots.
//
// Text format (version 1), '#' starts a comment, blank lines are ignored:
//   oasiskv-budget-profile 1
//   layers 30 kv_heads 3 block_tokens 16
//   layer 0 64 64 64
//   layer 1 28 28 28
//   ...
// The first line names the format and its version; the second the shape and block size the
// profile was made for; then one line per layer, in order, with each kv head's budget in blocks
// (pinned sinks and recent ring included).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "oasiskv/config.hpp"

namespace oasiskv {
inline namespace v0 {

class BudgetProfile {
 public:
  BudgetProfile() = default;
  // blocks: [layer][kv head]; throws oasiskv::Error unless the shape is positive and every budget
  // is positive.
  BudgetProfile(int num_layers, int num_kv_heads, int block_tokens, std::vector<int> blocks);

  int num_layers() const noexcept { return layers_; }
  int num_kv_heads() const noexcept { return heads_; }
  int block_tokens() const noexcept { return block_tokens_; }
  int blocks(int layer, int kv_head) const noexcept {
    return blocks_[static_cast<std::size_t>(layer) * static_cast<std::size_t>(heads_) +
                   static_cast<std::size_t>(kv_head)];
  }
  std::span<const int> blocks() const noexcept { return blocks_; }
  std::int64_t total_blocks() const noexcept;
  // Whether every head has the same budget.
  bool uniform() const noexcept;

  // The text format above. parse names `origin` (a file name) and the line of the first problem.
  static BudgetProfile parse(std::string_view text, std::string_view origin = "budget profile");
  static BudgetProfile load(const std::string& path);
  std::string text() const;
  void save(const std::string& path) const;

  // Throws oasiskv::Error naming the first mismatch unless the profile fits `config` (validated
  // first): the same layers, kv heads and block size; every head at least its pinned slots (sink
  // blocks + ring blocks) and at most the sequence's max blocks (or the configured budget when
  // that is larger: a uniform profile is always valid); the sum num_layers x num_kv_heads x
  // budget_tokens / block_tokens (the configured total).
  void validate(const CacheConfig& config) const;

  // Every head budget_tokens / block_tokens.
  static BudgetProfile uniform(const CacheConfig& config);
  // Layers below `dense_layers` get every block of a `context_tokens`-token sequence (the
  // smallest budget whose top-K covers every candidate: blocks_for(context_tokens), at least the
  // pinned slots, at most the max blocks); the other heads share what is left of the total
  // equally (the first ones one block more when it does not divide). Throws when the rest do not
  // fit between their minimum and maximum, or context_tokens is outside [1, max_tokens_per_sequence].
  static BudgetProfile first_layers_dense(const CacheConfig& config, int dense_layers, std::int64_t context_tokens);
  // Water-filling over measured curves: curves[layer * num_kv_heads + h][k] is the attention mass
  // (any consistent unit) captured when head h of `layer` selects the best k blocks beside its
  // pinned ones, k = 0, 1, ... (missing points: no further gain). Every head starts at its pinned
  // slots; each further block of the total goes to the head with the largest marginal gain
  // (ties to the lower (layer, head)), no head above the max blocks. For concave curves (the mass
  // of the best k blocks is) this maximises the total mass captured.
  static BudgetProfile from_mass_curves(const CacheConfig& config, std::span<const std::vector<double>> curves);

 private:
  int layers_ = 0, heads_ = 0, block_tokens_ = 0;
  std::vector<int> blocks_;
};

// The slot arithmetic of a non-uniform profile for one config: what CacheLayout::head_budgets and
// layer_pools point to. The Cache owns it for its lifetime.
struct BudgetTable {
  std::vector<HeadBudget> heads;   // [layer][kv head]
  std::vector<LayerSlots> layers;  // [layer]
  std::int64_t sequence_residency = 0;

  // Validates the profile against the config; null when it is uniform (the layout stays as
  // CacheLayout::from makes it, bit for bit).
  static std::shared_ptr<const BudgetTable> make(const CacheConfig& config, const BudgetProfile& profile);
  // `uniform` (CacheLayout::from of the same config) pointing at this table.
  CacheLayout apply(CacheLayout uniform) const noexcept;
};

}  // namespace v0
}  // namespace oasiskv
