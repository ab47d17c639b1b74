#include "support.hpp"

using namespace oasiskv;

TEST_CASE("CacheLayout derives sizes from the paper's setting") {
  CacheConfig c;
  c.shape = ModelShape{32, 32, 8, 128};
  c.max_tokens_per_sequence = 32768;
  c.fetch_ratio = 0.05;
  const CacheLayout l = CacheLayout::from(c);
  CHECK(l.group_size == 4);
  CHECK(l.budget_blocks == 128);
  CHECK(l.sink_blocks == 1);
  CHECK(l.ring_blocks == 5);
  CHECK(l.selectable_blocks == 122);
  CHECK(l.fetch_cap == 6);  // floor(0.05 * 128)
  CHECK(l.max_blocks == 2048);
  CHECK(l.block_elems == 2 * 16 * 128);
  CHECK(l.softmax_scale == doctest::Approx(1.0 / std::sqrt(128.0)));
}

TEST_CASE("CacheLayout: pinned slots and the recent ring") {
  CacheConfig c = test::small_config();
  const CacheLayout l = CacheLayout::from(c);  // 1 sink block, ring of 3 blocks
  CHECK(l.ring_start(0) == 1);
  CHECK(l.ring_start(16 * 10) == 7);
  CHECK(l.ring_start(16 * 10 + 1) == 8);
  // Distinct slots for every pinned block of any length.
  for (std::int64_t len = 1; len < 400; ++len) {
    std::vector<int> used;
    for (std::int64_t b = 0; b < std::min<std::int64_t>(l.sink_blocks, l.blocks_for(len)); ++b) used.push_back(l.pinned_slot(b));
    for (std::int64_t b = l.ring_start(len); b < l.blocks_for(len); ++b) used.push_back(l.pinned_slot(b));
    std::sort(used.begin(), used.end());
    CHECK(std::adjacent_find(used.begin(), used.end()) == used.end());
    for (int s : used) CHECK(s < l.sink_blocks + l.ring_blocks);
  }
}

TEST_CASE("parse_reduction") {
  CHECK(parse_reduction("max") == GroupReduction::max);
  CHECK(parse_reduction("softmax_sum") == GroupReduction::softmax_sum);
  CHECK_THROWS_WITH_AS(parse_reduction("mean"), doctest::Contains("'mean'"), Error);
}

TEST_CASE("block scorer: names parse back, unknown names and bad constants are refused with the value named") {
  for (BlockScore s : {BlockScore::quest, BlockScore::spread, BlockScore::runs}) {
    CHECK(parse_block_score(block_score_name(s)) == s);
  }
  CHECK_THROWS_WITH_AS(parse_block_score("mass"),
                       doctest::Contains("unknown block scorer 'mass' (expected quest, spread or runs)"), Error);
  CHECK_THROWS_WITH_AS(parse_block_score("bound"), doctest::Contains("'bound'"), Error);
  CacheConfig c = test::small_config();
  CHECK(CacheLayout::from(c).score.kind == BlockScore::quest);  // the default: today's bound
  for (float bad : {-0.1f, 1.5f, NAN, INFINITY}) {
    c.spread_alpha = bad;
    CHECK_THROWS_WITH_AS((void)CacheLayout::from(c), doctest::Contains("spread_alpha must be in [0, 1]"), Error);
  }
  c.spread_alpha = 0.5f;
  CHECK_THROWS_WITH_AS([&] { c.spread_alpha = 3.0f; (void)CacheLayout::from(c); }(), doctest::Contains("got 3"), Error);
  c.spread_alpha = 0.5f;
  c.scorer = static_cast<BlockScore>(9);
  CHECK_THROWS_WITH_AS((void)CacheLayout::from(c), doctest::Contains("unknown scorer value 9"), Error);
  c.softmax_scale = 0.5f;
  c.scorer = BlockScore::spread;
  CHECK(CacheLayout::from(c).score.half_alpha == 0.25f);
  CHECK(CacheLayout::from(c).score.softmax_scale == 0.5f);
  CHECK(CacheLayout::from(c).run_floats == 0);  // run sums only under the runs scorer
}

TEST_CASE("block scorer runs: run_tokens divides block_tokens, and the run sums are sized from it") {
  CacheConfig c = test::small_config();
  c.scorer = BlockScore::runs;
  for (int bad : {0, -4, 3, 5, 2 * c.block_tokens}) {
    c.run_tokens = bad;
    const std::string want = fmt::format("run_tokens must divide block_tokens ({}), got {}", c.block_tokens, bad);
    CHECK_THROWS_WITH_AS((void)CacheLayout::from(c), doctest::Contains(want.c_str()), Error);
  }
  c.run_tokens = 4;
  const CacheLayout l = CacheLayout::from(c);
  CHECK(l.score.runs == c.block_tokens / 4);
  CHECK(l.score.run_scale == 0.25f);
  CHECK(l.run_stride == (l.max_blocks | 1) * l.score.runs * c.shape.head_dim);
  CHECK(l.run_floats == std::int64_t{c.max_sequences} * c.shape.num_layers * c.shape.num_kv_heads * l.run_stride);
  CHECK(l.run_offset(1, 0, 0, 2) == l.head_index(1, 0, 0) * l.run_stride + 2 * l.score.runs * c.shape.head_dim);
}
