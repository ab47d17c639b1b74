// Quickstart: a synthetic model shape decodes through the OasisKV cache with a user attention
// callback, and every step is checked against dense attention over the whole context.
//
// Synthetic KV with sparse attention: each block of each kv head is about one of a few topics
// (its keys lean towards the topic's direction); each decode step's query is about one topic,
// which drifts every few steps. The lookahead row is the next step's query plus noise, as a
// drafter's would be. Usage: quickstart [--context N] [--steps N] [--budget N] [--fetch-ratio R]
#include <oasiskv/oasiskv.hpp>

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

using namespace oasiskv;

namespace {

struct Options {
  std::int64_t context = 16384;
  int steps = 64;
  int budget = 2048;
  double fetch_ratio = 1.0;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw Error(fmt::format("quickstart: {} needs a value", a));
      return argv[++i];
    };
    if (a == "--context") o.context = std::stoll(value());
    else if (a == "--steps") o.steps = std::stoi(value());
    else if (a == "--budget") o.budget = std::stoi(value());
    else if (a == "--fetch-ratio") o.fetch_ratio = std::stod(value());
    else throw Error(fmt::format("quickstart: unknown argument '{}' (try --context, --steps, --budget, --fetch-ratio)", a));
  }
  return o;
}

// Keys, values and queries of the synthetic model.
struct SyntheticModel {
  ModelShape shape;
  int topics = 8;  // 128 blocks per topic at 16K tokens: about one budget
  std::vector<float> directions;  // [layer][kv_head][topic][head_dim], unit vectors
  std::mt19937_64 rng{2026};

  explicit SyntheticModel(ModelShape s) : shape(s) {
    std::normal_distribution<float> n(0.0f, 1.0f);
    directions.resize(static_cast<std::size_t>(s.num_layers * s.num_kv_heads * topics * s.head_dim));
    for (std::size_t i = 0; i < directions.size(); i += static_cast<std::size_t>(s.head_dim)) {
      float norm = 0.0f;
      for (int c = 0; c < s.head_dim; ++c) norm += (directions[i + c] = n(rng)) * directions[i + c];
      for (int c = 0; c < s.head_dim; ++c) directions[i + c] /= std::sqrt(norm);
    }
  }
  const float* direction(int layer, int h, int topic) const {
    return directions.data() + ((layer * shape.num_kv_heads + h) * topics + topic) * shape.head_dim;
  }
  int topic_of_block(std::int64_t block, int layer, int h) const {
    return static_cast<int>((block * 2654435761u + static_cast<std::uint64_t>(layer * 7 + h * 13)) % static_cast<std::uint64_t>(topics));
  }
  // Rows [first, first + n) of one layer: [n][kv_heads][head_dim].
  void rows(int layer, std::int64_t first, std::int64_t n, std::vector<float>& k, std::vector<float>& v) {
    const int H = shape.num_kv_heads, d = shape.head_dim;
    std::normal_distribution<float> noise(0.0f, 1.0f);
    k.resize(static_cast<std::size_t>(n * H * d));
    v.resize(k.size());
    for (std::int64_t t = 0; t < n; ++t) {
      for (int h = 0; h < H; ++h) {
        const float* dir = direction(layer, h, topic_of_block((first + t) / 16, layer, h));
        for (int c = 0; c < d; ++c) {
          const std::size_t i = static_cast<std::size_t>((t * H + h) * d + c);
          k[i] = noise(rng) + 5.0f * dir[c];
          v[i] = noise(rng) + 2.0f * dir[(c + 1) % d];
        }
      }
    }
  }
  // The query of `step`: about one topic per kv head, the topic drifting every 4 steps.
  void query(int layer, int step, float noise_scale, std::vector<float>& q) {
    const int Hq = shape.num_q_heads, d = shape.head_dim, group = Hq / shape.num_kv_heads;
    std::normal_distribution<float> noise(0.0f, noise_scale);
    q.resize(static_cast<std::size_t>(Hq * d));
    for (int g = 0; g < Hq; ++g) {
      const int topic = static_cast<int>((static_cast<unsigned>(step / 4) * 40503u + static_cast<unsigned>(g / group) * 7u) % static_cast<unsigned>(topics));
      const float* dir = direction(layer, g / group, topic);
      for (int c = 0; c < d; ++c) q[static_cast<std::size_t>(g * d + c)] = 10.0f * dir[c] + noise(rng);
    }
  }
};

}  // namespace

int main(int argc, char** argv) try {
  const Options opt = parse(argc, argv);
  CacheConfig config;
  config.shape = ModelShape{4, 8, 2, 64};
  config.budget_tokens = opt.budget;
  config.fetch_ratio = opt.fetch_ratio;
  config.max_sequences = 1;
  config.max_tokens_per_sequence = opt.context + opt.steps;
  Cache<cpu, float> cache(config);
  const auto& shape = config.shape;
  const int L = shape.num_layers, H = shape.num_kv_heads, Hq = shape.num_q_heads, d = shape.head_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));

  SyntheticModel model(shape);
  const std::vector<SeqId> batch{1};
  cache.add_sequence(1);
  fmt::print("OasisKV {} quickstart: {} layers, {} query / {} kv heads, head dim {}, {} tokens, budget {} tokens per kv head ({}%), fetch ratio {}\n",
             version_string(), L, Hq, H, d, opt.context, opt.budget, 100.0 * opt.budget / static_cast<double>(opt.context), opt.fetch_ratio);
  fmt::print("CPU kernels: {}\n", cpu_isa_description());  // OASISKV_CPU_ISA caps the level

  // Prefill, and the first working set from the last prompt token's lookahead row.
  std::vector<std::vector<float>> all_k(static_cast<std::size_t>(L)), all_v(static_cast<std::size_t>(L));
  std::vector<Ticket> previous(static_cast<std::size_t>(L));
  std::vector<float> k, v, q, q_lookahead;
  for (int l = 0; l < L; ++l) {
    model.rows(l, 0, opt.context, all_k[static_cast<std::size_t>(l)], all_v[static_cast<std::size_t>(l)]);
    auto& kk = all_k[static_cast<std::size_t>(l)];
    auto& vv = all_v[static_cast<std::size_t>(l)];
    cache.append(batch, l, std::vector<std::int32_t>{static_cast<std::int32_t>(opt.context)}, rows_view(kk.data(), opt.context), rows_view(vv.data(), opt.context));
    model.query(l, 0, 0.3f, q_lookahead);
    previous[static_cast<std::size_t>(l)] = cache.prefetch(batch, l, rows_view(q_lookahead.data(), 1));
  }

  double worst_error = 0.0, sum_error = 0.0;
  std::int64_t errors = 0;
  std::vector<float> sparse(static_cast<std::size_t>(Hq * d)), dense(sparse.size());
  const auto start = std::chrono::steady_clock::now();
  for (int step = 0; step < opt.steps; ++step) {
    for (int l = 0; l < L; ++l) {
      auto& kk = all_k[static_cast<std::size_t>(l)];
      auto& vv = all_v[static_cast<std::size_t>(l)];
      const std::int64_t pos = opt.context + step;
      model.rows(l, pos, 1, k, v);
      kk.insert(kk.end(), k.begin(), k.end());
      vv.insert(vv.end(), v.begin(), v.end());
      cache.append(batch, l, rows_view(k.data(), 1), rows_view(v.data(), 1));
      // The drafter's guess at the next step's query.
      model.query(l, step + 1, 0.3f, q_lookahead);
      const Ticket next = cache.prefetch(batch, l, rows_view(q_lookahead.data(), 1));
      model.query(l, step, 0.3f, q);
      // The engine's attention kernel is a callback over the resident blocks.
      const Ticket& current = previous[static_cast<std::size_t>(l)];
      cache.attend(current, [&](const LayerView<float>& view) {
        cache.observe(current, rows_view(q.data(), 1));
        sparse_attention_reference(view, Hq, scale, q.data(), sparse.data());
      });
      previous[static_cast<std::size_t>(l)] = next;
      dense_attention_reference(kk.data(), vv.data(), pos + 1, Hq, H, d, scale, q.data(), dense.data());
      for (int g = 0; g < Hq; ++g) {
        double num = 0.0, den = 0.0;
        for (int c = 0; c < d; ++c) {
          const double diff = sparse[static_cast<std::size_t>(g * d + c)] - dense[static_cast<std::size_t>(g * d + c)];
          num += diff * diff;
          den += static_cast<double>(dense[static_cast<std::size_t>(g * d + c)]) * dense[static_cast<std::size_t>(g * d + c)];
        }
        const double e = std::sqrt(num / std::max(den, 1e-30));
        worst_error = std::max(worst_error, e);
        sum_error += e;
        ++errors;
      }
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const LayerStatistics total = cache.statistics().total();
  const double steps = opt.steps;
  fmt::print("decoded {} steps x {} layers in {:.2f} s (dense reference included)\n", opt.steps, L, seconds);
  fmt::print("hit rate (true top-K blocks resident when attending): {:.2f}%\n", 100.0 * total.recall());
  fmt::print("blocks fetched: {} ({:.1f} per layer and step), bytes moved: {:.2f} MiB ({:.1f} KiB per layer and step)\n",
             total.blocks_fetched, static_cast<double>(total.blocks_fetched) / (steps * L),
             static_cast<double>(total.bytes_fetched) / (1 << 20), static_cast<double>(total.bytes_fetched) / 1024.0 / (steps * L));
  fmt::print("admits dropped by the fetch cap: {}, time waited in acquire: {:.3f} ms\n", total.admits_capped, total.acquire_wait_ns / 1e6);
  fmt::print("attention error against dense (relative L2 per query head): mean {:.2e}, largest {:.2e}\n", sum_error / static_cast<double>(errors), worst_error);
  return 0;
} catch (const std::exception& e) {
  fmt::print(stderr, "quickstart: {}\n", e.what());
  return 1;
}
