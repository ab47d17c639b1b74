// oasiskv::cpu_attend (oasiskv/cpu/attention.hpp) over a LayerView of a small model's decode shape
// (SmolLM2-135M: 1 sequence, 3 kv heads, GQA group 3, head dim 64, one query row), 1,024 and 4,096
// resident rows per kv head in fp16 and fp32, on the calling thread. The rate is the bytes of keys
// and values it reads per second, set against one memcpy of the same footprint: attention that
// converts and scores every row once cannot beat reading it.
#include "bench_support.hpp"

#include <oasiskv/cpu/attention.hpp>
#include <oasiskv/cpu/isa.hpp>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace oasiskv::bench {
namespace {

constexpr int kSmallKvHeads = 3, kSmallGroup = 3, kSmallHeadDim = 64;

// A view of `rows` resident rows per kv head: whole blocks, in slots scattered over the pool as a
// cache's slots are.
template <class T>
struct ViewFixture {
  std::vector<SeqId> ids{1};
  std::vector<std::int64_t> seq_len;
  std::vector<std::int32_t> indptr{0}, slot, block, valid;
  std::vector<T> pool;
  std::vector<float> q, out, lse;
  LayerView<T> view;

  explicit ViewFixture(std::int64_t rows) {
    const int blocks = static_cast<int>(rows / kBlockTokens);
    const std::int64_t stride = 2LL * kBlockTokens * kSmallHeadDim;
    std::vector<std::int32_t> order(static_cast<std::size_t>(blocks) * kSmallKvHeads);
    std::iota(order.begin(), order.end(), 0);
    Random r(5);
    for (std::size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[r.next() % i]);
    for (int h = 0; h < kSmallKvHeads; ++h) {
      for (int b = 0; b < blocks; ++b) {
        slot.push_back(order[static_cast<std::size_t>(h) * blocks + b]);
        block.push_back(b);
        valid.push_back(kBlockTokens);
      }
      indptr.push_back(static_cast<std::int32_t>(slot.size()));
    }
    seq_len.push_back(rows);
    std::vector<float> values(order.size() * static_cast<std::size_t>(stride));
    fill_uniform(values, 3);
    pool.resize(values.size());
    std::transform(values.begin(), values.end(), pool.begin(), [](float x) { return from_float<T>(x); });
    q.resize(static_cast<std::size_t>(kSmallKvHeads) * kSmallGroup * kSmallHeadDim);
    fill_uniform(q, 4);
    out.resize(q.size());
    lse.resize(static_cast<std::size_t>(kSmallKvHeads) * kSmallGroup);
    view.batch_size = 1;
    view.num_kv_heads = kSmallKvHeads;
    view.head_dim = kSmallHeadDim;
    view.block_tokens = kBlockTokens;
    view.seq_ids = ids.data();
    view.seq_len = seq_len.data();
    view.indptr = indptr.data();
    view.slot = slot.data();
    view.block = block.data();
    view.valid_tokens = valid.data();
    view.pool = pool.data();
    view.slot_stride = stride;
  }
  std::size_t bytes() const { return pool.size() * sizeof(T); }
};

template <class T>
void BM_CpuAttend(benchmark::State& state) {
  ViewFixture<T> f(state.range(0));
  const float scale = 1.0f / std::sqrt(static_cast<float>(kSmallHeadDim));
  for (auto _ : state) {
    cpu_attend(f.view, f.q.data(), kSmallKvHeads * kSmallGroup, 1, scale, f.out.data(), f.lse.data());
    benchmark::DoNotOptimize(f.out.data());
    benchmark::ClobberMemory();
  }
  set_memcpy_limit(state, f.bytes(), f.bytes());
  state.counters["isa"] = static_cast<double>(cpu_isa());
}

BENCHMARK(BM_CpuAttend<fp16_t>)->ArgName("rows")->Arg(1024)->Arg(4096);
BENCHMARK(BM_CpuAttend<float>)->ArgName("rows")->Arg(1024)->Arg(4096);

}  // namespace
}  // namespace oasiskv::bench
