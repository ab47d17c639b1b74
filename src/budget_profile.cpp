// BudgetProfile: parse, save, validation, builders; BudgetTable: its slot arithmetic.
#include "oasiskv/budget_profile.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <fstream>
#include <limits>
#include <queue>
#include <sstream>
#include <utility>

#include "oasiskv/detail/checked.hpp"
#include "oasiskv/error.hpp"

namespace oasiskv {
inline namespace v0 {
namespace {

constexpr std::string_view kMagic = "oasiskv-budget-profile";
constexpr int kVersion = 1;

std::vector<std::string_view> words(std::string_view line) {
  std::vector<std::string_view> out;
  std::size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t' || line[i] == '\r')) ++i;
    const std::size_t j = i;
    while (i < line.size() && line[i] != ' ' && line[i] != '\t' && line[i] != '\r') ++i;
    if (i > j) out.push_back(line.substr(j, i - j));
  }
  return out;
}

// A whole-word non-negative int, or an error naming the word and the line.
int to_int(std::string_view w, std::string_view what, std::string_view origin, int line) {
  int v = 0;
  const auto [end, ec] = std::from_chars(w.data(), w.data() + w.size(), v);
  if (ec != std::errc{} || end != w.data() + w.size() || v < 0) {
    fail("{} line {}: {} must be a non-negative integer (int), got '{}'", origin, line, what, w);
  }
  return v;
}

// The pinned slots and the largest budget of one head under `config`.
struct HeadBounds {
  int min = 0, max = 0;
};
// The max is the sequence's blocks, or the configured budget when that is larger (the uniform
// profile of any valid config is valid).
HeadBounds bounds_of(const CacheLayout& l) {
  const std::int64_t max = std::max<std::int64_t>(l.max_blocks, l.budget_blocks);
  return HeadBounds{l.sink_blocks + l.ring_blocks,
                    static_cast<int>(std::min<std::int64_t>(max, std::numeric_limits<int>::max()))};
}

std::int64_t configured_total(const CacheLayout& l) {
  return detail::checked_product("BudgetProfile: total budget blocks (num_layers x num_kv_heads x budget blocks)",
                                 l.num_layers(), l.num_kv_heads(), l.budget_blocks);
}

}  // namespace

BudgetProfile::BudgetProfile(int num_layers, int num_kv_heads, int block_tokens, std::vector<int> blocks)
    : layers_(num_layers), heads_(num_kv_heads), block_tokens_(block_tokens), blocks_(std::move(blocks)) {
  if (num_layers <= 0 || num_kv_heads <= 0 || block_tokens <= 0) {
    fail("BudgetProfile: layers ({}), kv_heads ({}) and block_tokens ({}) must be positive", num_layers, num_kv_heads,
         block_tokens);
  }
  const std::int64_t n = detail::checked_product("BudgetProfile: heads", num_layers, num_kv_heads);
  if (static_cast<std::int64_t>(blocks_.size()) != n) {
    fail("BudgetProfile: {} budgets given for {} layers x {} kv heads = {}", blocks_.size(), num_layers, num_kv_heads,
         n);
  }
  for (std::size_t i = 0; i < blocks_.size(); ++i) {
    if (blocks_[i] <= 0) {
      fail("BudgetProfile: layer {} kv head {} has a budget of {} blocks; it must be positive",
           static_cast<int>(i) / num_kv_heads, static_cast<int>(i) % num_kv_heads, blocks_[i]);
    }
  }
}

std::int64_t BudgetProfile::total_blocks() const noexcept {
  std::int64_t s = 0;
  for (int b : blocks_) s += b;
  return s;
}

bool BudgetProfile::uniform() const noexcept {
  return std::all_of(blocks_.begin(), blocks_.end(), [&](int b) { return b == blocks_.front(); });
}

BudgetProfile BudgetProfile::parse(std::string_view text, std::string_view origin) {
  int line_no = 0;
  int layers = -1, heads = -1, block_tokens = -1;
  bool header = false;
  int next_layer = 0;
  std::vector<int> blocks;
  std::size_t at = 0;
  while (at <= text.size()) {
    std::size_t end = text.find('\n', at);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(at, end - at);
    at = end + 1;
    ++line_no;
    if (const std::size_t hash = line.find('#'); hash != std::string_view::npos) line = line.substr(0, hash);
    const std::vector<std::string_view> w = words(line);
    if (w.empty()) continue;
    if (!header) {
      if (w[0] != kMagic) {
        fail("{} line {}: expected the header '{} {}', got '{}'", origin, line_no, kMagic, kVersion, w[0]);
      }
      if (w.size() != 2) fail("{} line {}: the header is '{} VERSION'", origin, line_no, kMagic);
      const int v = to_int(w[1], "the version", origin, line_no);
      if (v != kVersion)
        fail("{} line {}: version {} is not supported (this library reads {})", origin, line_no, v, kVersion);
      header = true;
      continue;
    }
    if (layers < 0) {
      if (w.size() != 6 || w[0] != "layers" || w[2] != "kv_heads" || w[4] != "block_tokens") {
        fail("{} line {}: expected 'layers L kv_heads H block_tokens B'", origin, line_no);
      }
      layers = to_int(w[1], "layers", origin, line_no);
      heads = to_int(w[3], "kv_heads", origin, line_no);
      block_tokens = to_int(w[5], "block_tokens", origin, line_no);
      if (layers == 0 || heads == 0 || block_tokens == 0) {
        fail("{} line {}: layers ({}), kv_heads ({}) and block_tokens ({}) must be positive", origin, line_no, layers,
             heads, block_tokens);
      }
      continue;  // nothing reserved from the header's counts: the layer lines that follow must match them
    }
    if (w[0] != "layer") fail("{} line {}: expected 'layer {} ...', got '{}'", origin, line_no, next_layer, w[0]);
    if (w.size() < 2) fail("{} line {}: 'layer' without a layer number", origin, line_no);
    const int l = to_int(w[1], "the layer", origin, line_no);
    if (next_layer >= layers) fail("{} line {}: layer {} is past the header's {} layers", origin, line_no, l, layers);
    if (l != next_layer) fail("{} line {}: layer {} out of order, expected layer {}", origin, line_no, l, next_layer);
    if (static_cast<int>(w.size()) - 2 != heads) {
      fail("{} line {}: layer {} has {} budgets, the header says {} kv heads", origin, line_no, l, w.size() - 2, heads);
    }
    for (std::size_t i = 2; i < w.size(); ++i) {
      const int b = to_int(w[i], "a budget", origin, line_no);
      if (b == 0) fail("{} line {}: layer {} kv head {} has a budget of 0 blocks", origin, line_no, l, i - 2);
      blocks.push_back(b);
    }
    ++next_layer;
  }
  if (!header) fail("{}: empty; expected the header '{} {}'", origin, kMagic, kVersion);
  if (layers < 0) fail("{}: no 'layers L kv_heads H block_tokens B' line", origin);
  if (next_layer != layers) fail("{}: {} layer lines, the header says {} layers", origin, next_layer, layers);
  return BudgetProfile(layers, heads, block_tokens, std::move(blocks));
}

BudgetProfile BudgetProfile::load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("BudgetProfile: cannot open '{}'", path);
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) fail("BudgetProfile: cannot read '{}'", path);
  return parse(ss.str(), path);
}

std::string BudgetProfile::text() const {
  std::string s = fmt::format("{} {}\n# budgets in blocks of {} tokens per kv head, pinned slots included; total {}\n",
                              kMagic, kVersion, block_tokens_, total_blocks());
  s += fmt::format("layers {} kv_heads {} block_tokens {}\n", layers_, heads_, block_tokens_);
  for (int l = 0; l < layers_; ++l) {
    s += fmt::format("layer {}", l);
    for (int h = 0; h < heads_; ++h) s += fmt::format(" {}", blocks(l, h));
    s += '\n';
  }
  return s;
}

void BudgetProfile::save(const std::string& path) const {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) fail("BudgetProfile: cannot write '{}'", path);
  out << text();
  out.flush();
  if (!out) fail("BudgetProfile: writing '{}' failed", path);
}

void BudgetProfile::validate(const CacheConfig& config) const {
  const CacheLayout l = CacheLayout::from(config);
  if (blocks_.empty()) fail("BudgetProfile: empty profile (no layers)");
  if (layers_ != l.num_layers() || heads_ != l.num_kv_heads() || block_tokens_ != l.block_tokens()) {
    fail("BudgetProfile: made for {} layers x {} kv heads of {}-token blocks, the cache has {} x {} of {}", layers_,
         heads_, block_tokens_, l.num_layers(), l.num_kv_heads(), l.block_tokens());
  }
  const HeadBounds b = bounds_of(l);
  for (int layer = 0; layer < layers_; ++layer) {
    for (int h = 0; h < heads_; ++h) {
      const int n = blocks(layer, h);
      if (n < b.min) {
        fail("BudgetProfile: layer {} kv head {} has {} blocks, fewer than its {} pinned slots ({} sink + {} ring)",
             layer, h, n, b.min, l.sink_blocks, l.ring_blocks);
      }
      if (n > b.max) {
        fail(
            "BudgetProfile: layer {} kv head {} has {} blocks, more than the {} blocks of a sequence "
            "(max_tokens_per_sequence {}, or the configured budget if larger)",
            layer, h, n, b.max, config.max_tokens_per_sequence);
      }
    }
  }
  if (const std::int64_t want = configured_total(l); total_blocks() != want) {
    fail(
        "BudgetProfile: the budgets sum to {} blocks, but the configured total is {} ({} layers x {} kv heads x {} "
        "blocks of budget_tokens {})",
        total_blocks(), want, layers_, heads_, l.budget_blocks, config.budget_tokens);
  }
}

BudgetProfile BudgetProfile::uniform(const CacheConfig& config) {
  const CacheLayout l = CacheLayout::from(config);
  return BudgetProfile(l.num_layers(), l.num_kv_heads(), l.block_tokens(),
                       std::vector<int>(static_cast<std::size_t>(l.num_layers()) *
                                            static_cast<std::size_t>(l.num_kv_heads()),
                                        l.budget_blocks));
}

BudgetProfile BudgetProfile::first_layers_dense(const CacheConfig& config, int dense_layers,
                                                std::int64_t context_tokens) {
  const CacheLayout l = CacheLayout::from(config);
  const int L = l.num_layers(), H = l.num_kv_heads();
  if (dense_layers < 0 || dense_layers > L) {
    fail("BudgetProfile::first_layers_dense: dense_layers must be in [0, {}], got {}", L, dense_layers);
  }
  if (context_tokens <= 0 || context_tokens > config.max_tokens_per_sequence) {
    fail("BudgetProfile::first_layers_dense: context_tokens must be in [1, {}] (max_tokens_per_sequence), got {}",
         config.max_tokens_per_sequence, context_tokens);
  }
  const HeadBounds b = bounds_of(l);
  // The candidates of a plan for a step of length n are below blocks_for(n) - ring_blocks: a
  // budget of blocks_for(context) selects every one of them.
  const int dense = static_cast<int>(std::clamp<std::int64_t>(l.blocks_for(context_tokens), b.min, b.max));
  const std::int64_t total = configured_total(l);
  const std::int64_t dense_heads = static_cast<std::int64_t>(dense_layers) * H;
  const std::int64_t rest_heads = static_cast<std::int64_t>(L - dense_layers) * H;
  const std::int64_t left = total - dense_heads * dense;
  std::vector<int> blocks(static_cast<std::size_t>(L) * static_cast<std::size_t>(H), dense);
  if (rest_heads == 0) {
    if (left != 0) {
      fail(
          "BudgetProfile::first_layers_dense: every layer dense at {} blocks makes {} blocks, but the configured "
          "total is {}",
          dense, dense_heads * dense, total);
    }
  } else {
    const std::int64_t each = left / rest_heads, extra = left - each * rest_heads;
    if (left < 0 || each < b.min || each + (extra > 0) > b.max) {
      fail(
          "BudgetProfile::first_layers_dense: {} dense layers of {} blocks per kv head leave {} blocks of the total {} "
          "for the other {} kv heads, each of which needs between {} and {}",
          dense_layers, dense, left, total, rest_heads, b.min, b.max);
    }
    for (std::int64_t i = 0; i < rest_heads; ++i) {
      blocks[static_cast<std::size_t>(dense_heads + i)] = static_cast<int>(each + (i < extra));
    }
  }
  return BudgetProfile(L, H, l.block_tokens(), std::move(blocks));
}

BudgetProfile BudgetProfile::from_mass_curves(const CacheConfig& config, std::span<const std::vector<double>> curves) {
  const CacheLayout l = CacheLayout::from(config);
  const int L = l.num_layers(), H = l.num_kv_heads();
  const auto n = static_cast<std::size_t>(L) * static_cast<std::size_t>(H);
  if (curves.size() != n) {
    fail("BudgetProfile::from_mass_curves: {} curves for {} layers x {} kv heads = {}", curves.size(), L, H, n);
  }
  for (std::size_t i = 0; i < n; ++i) {
    for (std::size_t k = 0; k < curves[i].size(); ++k) {
      if (!std::isfinite(curves[i][k])) {
        fail("BudgetProfile::from_mass_curves: layer {} kv head {} point {} is not finite ({})",
             i / static_cast<std::size_t>(H), i % static_cast<std::size_t>(H), k, curves[i][k]);
      }
    }
  }
  const HeadBounds b = bounds_of(l);
  const std::int64_t total = configured_total(l);
  std::int64_t left = total - static_cast<std::int64_t>(n) * b.min;
  if (left > static_cast<std::int64_t>(n) * (b.max - b.min)) {
    fail("BudgetProfile::from_mass_curves: the total of {} blocks is more than every kv head at its max of {} blocks",
         total, b.max);
  }
  // gain of head i's k-th selectable block (k from 0): curve[k + 1] - curve[k], 0 past the curve.
  const auto gain = [&](std::size_t i, int k) {
    const std::vector<double>& c = curves[i];
    return static_cast<std::size_t>(k) + 1 < c.size()
               ? c[static_cast<std::size_t>(k) + 1] - c[static_cast<std::size_t>(k)]
               : 0.0;
  };
  std::vector<int> k(n, 0);
  // Largest gain first; ties to the lower head index.
  using Item = std::pair<double, std::size_t>;
  const auto worse = [](const Item& a, const Item& c) {
    return a.first < c.first || (a.first == c.first && a.second > c.second);
  };
  std::priority_queue<Item, std::vector<Item>, decltype(worse)> heap(worse);
  if (b.max > b.min) {
    for (std::size_t i = 0; i < n; ++i) heap.emplace(gain(i, 0), i);
  }
  for (; left > 0; --left) {
    const std::size_t i = heap.top().second;
    heap.pop();
    if (++k[i] < b.max - b.min) heap.emplace(gain(i, k[i]), i);
  }
  std::vector<int> blocks(n);
  for (std::size_t i = 0; i < n; ++i) blocks[i] = b.min + k[i];
  return BudgetProfile(L, H, l.block_tokens(), std::move(blocks));
}

std::shared_ptr<const BudgetTable> BudgetTable::make(const CacheConfig& config, const BudgetProfile& profile) {
  profile.validate(config);
  if (profile.uniform()) return nullptr;
  const CacheLayout u = CacheLayout::from(config);
  const int L = u.num_layers(), H = u.num_kv_heads();
  auto t = std::make_shared<BudgetTable>();
  t->heads.resize(static_cast<std::size_t>(L) * static_cast<std::size_t>(H));
  t->layers.resize(static_cast<std::size_t>(L));
  std::int64_t residency = 0, pool = 0;
  constexpr std::int64_t int32_max = std::numeric_limits<std::int32_t>::max();
  for (int l = 0; l < L; ++l) {
    std::int64_t slots = 0;
    for (int h = 0; h < H; ++h) {
      HeadBudget& hb =
          t->heads[static_cast<std::size_t>(l) * static_cast<std::size_t>(H) + static_cast<std::size_t>(h)];
      hb.budget_blocks = profile.blocks(l, h);
      hb.selectable_blocks = hb.budget_blocks - u.sink_blocks - u.ring_blocks;
      const auto cap = static_cast<int>(std::floor(config.fetch_ratio * hb.budget_blocks));
      hb.fetch_cap = cap < 1 ? 1 : cap;
      hb.slot_offset = static_cast<int>(slots);
      hb.residency_offset = residency;
      slots += hb.budget_blocks;
      residency += hb.selectable_blocks;
    }
    const std::int64_t layer_slots =
        detail::checked_product("BudgetProfile: slots of a layer", slots, config.max_sequences);
    if (layer_slots > int32_max) {
      fail(
          "BudgetProfile: layer {} needs {} slots (max_sequences {} x {} blocks), more than the {} slot ids (int32) a "
          "LayerView holds",
          l, layer_slots, config.max_sequences, slots, int32_max);
    }
    t->layers[static_cast<std::size_t>(l)] = LayerSlots{pool, slots};
    pool += layer_slots;
  }
  t->sequence_residency = residency;
  return t;
}

CacheLayout BudgetTable::apply(CacheLayout l) const noexcept {
  l.head_budgets = heads.data();
  l.layer_pools = layers.data();
  l.sequence_residency = sequence_residency;
  std::int64_t largest = 0;
  for (std::size_t i = 0; i < layers.size(); ++i) largest = std::max(largest, l.layer_slots(static_cast<int>(i)));
  l.slots_per_layer = largest;
  for (const HeadBudget& h : heads) {
    l.max_budget_blocks = std::max(l.max_budget_blocks, h.budget_blocks);
    l.max_selectable_blocks = std::max(l.max_selectable_blocks, h.selectable_blocks);
  }
  return l;
}

}  // namespace v0
}  // namespace oasiskv
