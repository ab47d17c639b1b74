// Uses an installed OasisKV through its CMake package (see tests/consumer/CMakeLists.txt):
// one decode step through a small cache, checked against dense attention, by the reference and by
// the library's CPU attention (cpu_attend, whose vector code is in the installed library).
#include <oasiskv/oasiskv.hpp>

#include <cmath>
#include <cstdio>
#include <string_view>
#include <vector>

int main() {
  using namespace oasiskv;
  const std::string_view version = version_string();
  std::printf("oasiskv %.*s\n", static_cast<int>(version.size()), version.data());

  CacheConfig config;
  config.shape = ModelShape{1, 4, 2, 8};
  config.budget_tokens = 256;  // more than the context: sparse must equal dense
  config.max_tokens_per_sequence = 100;
  Cache<cpu, float> cache(config);
  cache.add_sequence(1);
  const std::vector<SeqId> batch{1};
  const std::int64_t rows = 100;
  std::vector<float> k(rows * 2 * 8), v(k.size()), q(4 * 8);
  for (std::size_t i = 0; i < k.size(); ++i) {
    k[i] = std::sin(0.37f * static_cast<float>(i));
    v[i] = std::cos(0.11f * static_cast<float>(i));
  }
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::sin(1.3f * static_cast<float>(i));
  cache.append(batch, 0, std::vector<std::int32_t>{static_cast<std::int32_t>(rows)}, rows_view(k.data(), rows),
               rows_view(v.data(), rows));
  const Ticket ticket = cache.prefetch(batch, 0, rows_view(q.data(), 1));
  std::vector<float> sparse(q.size()), fast(q.size()), dense(q.size());
  cache.attend(ticket, [&](const LayerView<float>& view) {
    sparse_attention_reference(view, 4, 0.35f, q.data(), sparse.data());
    cpu_attend(view, q.data(), 4, 1, 0.35f, fast.data());
  });
  dense_attention_reference(k.data(), v.data(), rows, 4, 2, 8, 0.35f, q.data(), dense.data());
  float worst = 0.0f;
  float worst_fast = 0.0f;
  for (std::size_t i = 0; i < q.size(); ++i) {
    worst = std::fmax(worst, std::fabs(sparse[i] - dense[i]));
    worst_fast = std::fmax(worst_fast, std::fabs(fast[i] - dense[i]));
  }
  std::printf("largest difference from dense attention: %g (reference), %g (cpu_attend)\n", static_cast<double>(worst),
              static_cast<double>(worst_fast));
  return version.empty() || worst > 1e-6f || worst_fast > 1e-5f ? 1 : 0;
}
