// The library's CPU attention (oasiskv/cpu/attention.hpp) against reference_attention.hpp on fresh
// random views: float, fp16 and bf16 pools, several head dims (tiled and not), GQA groups 1..4,
// batches of 1..3 sequences with 1..3 query rows each (causal by position), random subsets of each
// pair's blocks (empty pairs, partial last blocks), with and without lse, on the calling thread and
// split over four threads. ctest runs this binary once per instruction-set level
// (tests/kernels/CMakeLists.txt), so both copies of the kernel (portable and AVX2) are compared.
#include <oasiskv/cpu/attention.hpp>
#include <oasiskv/reference_attention.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <thread>
#include <vector>

#include "support.hpp"

using namespace oasiskv;

namespace {

constexpr int kBlockTokens = 16;

// A ParallelFor over threads of its own: each call starts `threads` std::threads that take tasks.
struct ThreadsForTest {
  int threads;
  ParallelFor parallel_for() {
    ParallelFor p;
    p.context = this;
    p.threads = threads;
    p.run = [](void* context, int tasks, ParallelFor::Task task, void* arg) {
      const int n = std::min(static_cast<ThreadsForTest*>(context)->threads, tasks);
      std::atomic<int> next{0};
      std::vector<std::thread> pool;
      for (int i = 0; i < n; ++i) {
        pool.emplace_back([&] {
          for (int t = next++; t < tasks; t = next++) task(arg, t);
        });
      }
      for (auto& th : pool) th.join();
    };
    return p;
  }
};

// A random view: each (sequence, kv head) pair holds a random ascending subset of its sequence's
// logical blocks (possibly none), the last block partially valid where seq_len is not a multiple
// of the block size; every slot of the pool random rows.
template <class T>
struct RandomView {
  int batch, heads, d;
  std::vector<SeqId> ids;
  std::vector<std::int64_t> seq_len;
  std::vector<std::int32_t> indptr{0}, slot, block, valid;
  std::vector<T> pool;

  RandomView(std::mt19937_64& rng, int batch_size, int kv_heads, int head_dim, int min_len, int max_len)
      : batch(batch_size), heads(kv_heads), d(head_dim) {
    std::uniform_int_distribution<int> len(min_len, max_len);
    std::bernoulli_distribution keep(0.6), empty(0.1);
    for (int i = 0; i < batch; ++i) {
      ids.push_back(static_cast<SeqId>(i + 1));
      seq_len.push_back(len(rng));
      const int blocks = static_cast<int>((seq_len.back() + kBlockTokens - 1) / kBlockTokens);
      for (int h = 0; h < heads; ++h) {
        const bool none = empty(rng);
        for (int b = 0; b < blocks && !none; ++b) {
          if (!keep(rng)) continue;
          slot.push_back(static_cast<std::int32_t>(slot.size()));
          block.push_back(b);
          valid.push_back(static_cast<std::int32_t>(
              std::min<std::int64_t>(kBlockTokens, seq_len.back() - static_cast<std::int64_t>(b) * kBlockTokens)));
        }
        indptr.push_back(static_cast<std::int32_t>(slot.size()));
      }
    }
    pool = test::random_rows<T>(rng, std::max<std::size_t>(1, slot.size()) * stride(), 1.5f);
  }
  std::int64_t stride() const { return 2LL * kBlockTokens * d; }
  LayerView<T> view() const {
    LayerView<T> v;
    v.batch_size = batch;
    v.num_kv_heads = heads;
    v.head_dim = d;
    v.block_tokens = kBlockTokens;
    v.seq_ids = ids.data();
    v.seq_len = seq_len.data();
    v.indptr = indptr.data();
    v.slot = slot.data();
    v.block = block.data();
    v.valid_tokens = valid.data();
    v.pool = pool.data();
    v.slot_stride = stride();
    return v;
  }
};

// The reference for query row r of `rows`: the view with each entry's valid rows cut at the row's
// position, one query per sequence, through sparse_attention_reference. Returns out and lse as
// [batch * rows][q heads][d] and [batch * rows][q heads].
template <class T>
void reference(const RandomView<T>& rv, const std::vector<float>& q, int q_heads, int rows, float scale,
               std::vector<float>& out, std::vector<float>& lse) {
  const auto width = static_cast<std::size_t>(q_heads) * rv.d;
  out.assign(static_cast<std::size_t>(rv.batch) * rows * width, 0.0f);
  lse.assign(static_cast<std::size_t>(rv.batch) * rows * q_heads, 0.0f);
  for (int r = 0; r < rows; ++r) {
    std::vector<std::int32_t> cut(rv.valid.size());
    std::vector<float> qr(rv.batch * width), outr(qr.size()), lser(static_cast<std::size_t>(rv.batch) * q_heads);
    for (int i = 0; i < rv.batch; ++i) {
      const std::int64_t position = rv.seq_len[i] - rows + r;
      for (int h = 0; h < rv.heads; ++h) {
        const int p = i * rv.heads + h;
        for (std::int32_t e = rv.indptr[p]; e < rv.indptr[p + 1]; ++e) {
          const std::int64_t seen = position - static_cast<std::int64_t>(rv.block[e]) * kBlockTokens + 1;
          cut[e] = static_cast<std::int32_t>(std::clamp<std::int64_t>(seen, 0, rv.valid[e]));
        }
      }
      std::copy_n(q.begin() + static_cast<std::ptrdiff_t>((static_cast<std::size_t>(i) * rows + r) * width), width,
                  qr.begin() + static_cast<std::ptrdiff_t>(i * width));
    }
    LayerView<T> view = rv.view();
    view.valid_tokens = cut.data();
    sparse_attention_reference(view, q_heads, scale, qr.data(), outr.data(), lser.data());
    for (int i = 0; i < rv.batch; ++i) {
      const std::size_t row = static_cast<std::size_t>(i) * rows + r;
      std::copy_n(outr.begin() + static_cast<std::ptrdiff_t>(i * width), width,
                  out.begin() + static_cast<std::ptrdiff_t>(row * width));
      std::copy_n(lser.begin() + static_cast<std::ptrdiff_t>(i) * q_heads, q_heads,
                  lse.begin() + static_cast<std::ptrdiff_t>(row) * q_heads);
    }
  }
}

// Largest |a - b| / max(1, |b|): float rounding of sums of products of magnitude ~1, relative
// where the value is large; equal infinities (a row that sees nothing) count as 0.
float worst_error(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  float worst = 0.0f;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i] == b[i]) continue;  // infinities included
    worst = std::max(worst, std::fabs(a[i] - b[i]) / std::max(1.0f, std::fabs(b[i])));
    if (std::isnan(a[i]) || std::isnan(b[i])) return INFINITY;
  }
  return worst;
}

template <class T>
void check_against_reference(std::mt19937_64& rng, int d, int max_len) {
  ThreadsForTest four{4};
  const ParallelFor threaded = four.parallel_for();
  std::uniform_int_distribution<int> batch(1, 3), heads(1, 2), group(1, 4), rows_of(1, 3);
  for (int round = 0; round < 3; ++round) {
    const int B = batch(rng), H = heads(rng), Q = H * group(rng), rows = rows_of(rng);
    const RandomView<T> rv(rng, B, H, d, rows, max_len);
    const auto q = test::random_rows<float>(rng, static_cast<std::size_t>(B) * rows * Q * d);
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    std::vector<float> ref_out, ref_lse;
    reference(rv, q, Q, rows, scale, ref_out, ref_lse);
    INFO("d " << d << ", batch " << B << ", kv heads " << H << ", q heads " << Q << ", rows " << rows);
    std::vector<float> out(ref_out.size(), NAN), lse(ref_lse.size(), NAN), out_threaded(out.size(), NAN),
        lse_threaded(lse.size(), NAN), out_no_lse(out.size(), NAN);
    cpu_attend(rv.view(), q.data(), Q, rows, scale, out.data(), lse.data());
    cpu_attend(rv.view(), q.data(), Q, rows, scale, out_threaded.data(), lse_threaded.data(), threaded);
    cpu_attend(rv.view(), q.data(), Q, rows, scale, out_no_lse.data());
    CHECK(worst_error(out, ref_out) < 1e-5f);
    CHECK(worst_error(lse, ref_lse) < 1e-5f);
    CHECK(worst_error(out_threaded, ref_out) < 1e-5f);
    CHECK(worst_error(lse_threaded, ref_lse) < 1e-5f);
    // Threaded and not: the same attention summed in parts, so equal to rounding.
    CHECK(worst_error(out_threaded, out) < 1e-5f);
    CHECK(worst_error(lse_threaded, lse) < 1e-5f);
    // lse is optional and changes nothing else.
    CHECK(worst_error(out_no_lse, out) == 0.0f);
  }
}

template <class T>
void check_all_dims(std::mt19937_64& rng) {
  for (int d : {8, 32, 64, 80, 128}) check_against_reference<T>(rng, d, 200);
  check_against_reference<T>(rng, 64, 2600);  // over 1,024 rows a pair: four parts on four threads
}

}  // namespace

TEST_CASE("cpu_attend equals the reference over random float views") {
  OASISKV_SEEDED_RNG(rng);
  check_all_dims<float>(rng);
}

TEST_CASE("cpu_attend equals the reference over random fp16 views") {
  OASISKV_SEEDED_RNG(rng);
  check_all_dims<fp16_t>(rng);
}

TEST_CASE("cpu_attend equals the reference over random bf16 views") {
  OASISKV_SEEDED_RNG(rng);
  check_all_dims<bf16_t>(rng);
}

TEST_CASE("cpu_attend_causal equals dense attention over each row's prefix") {
  OASISKV_SEEDED_RNG(rng);
  for (int d : {64, 40}) {  // 40: the untiled path
    const int heads = 3, rows = 19;
    const std::int64_t n = 150;
    const auto k = test::random_rows<bf16_t>(rng, static_cast<std::size_t>(n) * d);
    const auto v = test::random_rows<bf16_t>(rng, k.size());
    const auto q = test::random_rows<float>(rng, static_cast<std::size_t>(rows) * heads * d);
    std::vector<std::int32_t> positions(rows);
    for (int r = 0; r < rows; ++r) positions[r] = static_cast<std::int32_t>(n - rows + r);
    positions[0] = 2;  // a prefix that ends inside the first tile
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    std::vector<float> out(q.size()), ref(q.size());
    cpu_attend_causal(q.data(), heads * d, rows, positions.data(), heads, d, scale,
                      KvRows<bf16_t>{k.data(), v.data(), n, d}, out.data(), heads * d);
    for (int r = 0; r < rows; ++r) {
      const auto at = static_cast<std::size_t>(r) * heads * d;
      dense_attention_reference(k.data(), v.data(), positions[r] + 1, heads, 1, d, scale, q.data() + at,
                                ref.data() + at);
    }
    INFO("d " << d);
    CHECK(worst_error(out, ref) < 1e-5f);
  }
}

TEST_CASE("cpu_attend refuses bad arguments naming them and writes nothing") {
  OASISKV_SEEDED_RNG(rng);
  const RandomView<float> rv(rng, 2, 2, 32, 4, 60);
  const auto q = test::random_rows<float>(rng, 2 * 3 * 4 * 32);
  std::vector<float> out(q.size(), 7.0f), lse(2 * 3 * 4, 7.0f);
  const LayerView<float> view = rv.view();
  CHECK_THROWS_WITH_AS(cpu_attend(view, q.data(), 3, 1, 1.0f, out.data(), lse.data()),
                       doctest::Contains("num_kv_heads 2, got 3"), Error);
  CHECK_THROWS_WITH_AS(cpu_attend(view, q.data(), 0, 1, 1.0f, out.data(), lse.data()), doctest::Contains("got 0"),
                       Error);
  CHECK_THROWS_WITH_AS(cpu_attend(view, q.data(), 4, 0, 1.0f, out.data(), lse.data()),
                       doctest::Contains("rows must be at least 1, got 0"), Error);
  CHECK_THROWS_WITH_AS(cpu_attend(view, q.data(), 4, 1, NAN, out.data(), lse.data()),
                       doctest::Contains("scale must be finite, got nan"), Error);
  CHECK_THROWS_WITH_AS(cpu_attend(view, static_cast<const float*>(nullptr), 4, 1, 1.0f, out.data(), lse.data()),
                       doctest::Contains("q and out must not be null"), Error);
  CHECK_THROWS_WITH_AS(cpu_attend(view, q.data(), 4, 61, 1.0f, out.data(), lse.data()),
                       doctest::Contains("fewer than the 61 query rows"), Error);
  LayerView<float> bad = view;
  bad.head_dim = 0;
  CHECK_THROWS_WITH_AS(cpu_attend(bad, q.data(), 4, 1, 1.0f, out.data(), lse.data()),
                       doctest::Contains("head_dim must be positive, got 0"), Error);
  CHECK(std::all_of(out.begin(), out.end(), [](float x) { return x == 7.0f; }));
  CHECK(std::all_of(lse.begin(), lse.end(), [](float x) { return x == 7.0f; }));
  // The rows-level entry checks its segment lists.
  const KvRows<float> one{rv.pool.data(), rv.pool.data() + 16 * 32, 4, 32};
  const std::int32_t indptr[] = {0, 2};
  CHECK_THROWS_WITH_AS(cpu_attend_query_row<float>(q.data(), 1, 2, 32, 1.0f, std::span(&one, 1), indptr, out.data()),
                       doctest::Contains("indptr[0..1] = [0, 2)"), Error);
}
