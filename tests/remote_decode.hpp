// A decode run over a remote-backed sequence, checked step by step (shared by the CPU tests of
// Cache::admit and the UCX tests of the remote tier). A "prefill" cache holds a random prompt;
// the decode cache admits it from its admission message alone, its blocks read through a
// RemoteBlockSource; a single-process twin holds the same prompt itself. Every decode step
// appends the same rows to both and plans from the same random queries; every acquired view of
// the decode cache must list the twin's blocks and hold the true rows (the prompt's, or the
// appended ones).
#pragma once

#include <oasiskv/cpu/admission_export.hpp>
#include <oasiskv/cache.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <vector>

#include "support.hpp"

namespace oasiskv::test {


// Every row appended to one sequence, per layer: [position][kv head][head dim].
struct RowMirror {
  std::vector<std::vector<float>> k, v;
  explicit RowMirror(int layers) : k(static_cast<std::size_t>(layers)), v(static_cast<std::size_t>(layers)) {}
  void add(int layer, const std::vector<float>& keys, const std::vector<float>& values) {
    auto& K = k[static_cast<std::size_t>(layer)];
    auto& V = v[static_cast<std::size_t>(layer)];
    K.insert(K.end(), keys.begin(), keys.end());
    V.insert(V.end(), values.begin(), values.end());
  }
};

// Whether every entry of `view` (batch entry i) holds the mirror's rows of its block.
inline bool view_holds_rows(const CacheLayout& L, const LayerView<float>& view, int i, const RowMirror& mirror) {
  const int H = L.num_kv_heads(), d = L.head_dim();
  const auto& K = mirror.k[static_cast<std::size_t>(view.layer)];
  const auto& V = mirror.v[static_cast<std::size_t>(view.layer)];
  for (int h = 0; h < H; ++h) {
    for (std::int32_t e = view.indptr[i * H + h]; e < view.indptr[i * H + h + 1]; ++e) {
      for (std::int32_t r = 0; r < view.valid_tokens[e]; ++r) {
        const std::int64_t pos = static_cast<std::int64_t>(view.block[e]) * L.block_tokens() + r;
        const std::size_t at = (static_cast<std::size_t>(pos) * static_cast<std::size_t>(H) + static_cast<std::size_t>(h)) *
                               static_cast<std::size_t>(d);
        if (std::memcmp(view.keys(e) + r * d, K.data() + at, sizeof(float) * static_cast<std::size_t>(d)) != 0 ||
            std::memcmp(view.values(e) + r * d, V.data() + at, sizeof(float) * static_cast<std::size_t>(d)) != 0) {
          return false;
        }
      }
    }
  }
  return true;
}

// The same block lists (the decode cache's and the twin's, one sequence each).
inline bool same_blocks(const LayerView<float>& a, const LayerView<float>& b, int H) {
  for (int p = 0; p <= H; ++p) {
    if (a.indptr[p] != b.indptr[p]) return false;
  }
  for (std::int32_t e = 0; e < a.indptr[H]; ++e) {
    if (a.block[e] != b.block[e] || a.valid_tokens[e] != b.valid_tokens[e]) return false;
  }
  return true;
}

// Exports the prefill cache's sequence: fills the message's remote fields and returns the decode
// side's source of its blocks (the message goes through encode/decode_admission in between).
using ExportFn = std::function<std::shared_ptr<RemoteBlockSource>(const Cache<cpu, float>& prefill, SeqId id,
                                                                   AdmissionMessage& message)>;

struct RemoteDecodeResult {
  int steps = 0;
  std::uint64_t remote_blocks_fetched = 0;  // blocks the decode cache read through its source
  std::uint64_t blocks_fetched = 0;         // all blocks it fetched after admission
  std::uint64_t decode_host_bytes = 0;      // its host pool at the end
  std::uint64_t prefill_host_bytes = 0;
  std::size_t admission_bytes = 0;
  double remainder_mass = 0;  // with a remainder estimate: the sum of exp(lse) it compared
};

// decode_profile: budgets by layer and kv head of the decode cache and its twin (the prefill
// cache keeps the uniform budget).
inline RemoteDecodeResult check_remote_decode(std::mt19937_64& rng, const CacheConfig& config, std::int64_t prompt,
                                              int steps, const ExportFn& export_blocks,
                                              const BudgetProfile* decode_profile = nullptr) {
  const CacheLayout L = CacheLayout::from(config);
  const int layers = L.num_layers();
  Cache<cpu, float> prefill(config);
  Cache<cpu, float> twin = decode_profile ? Cache<cpu, float>(config, *decode_profile) : Cache<cpu, float>(config);
  Cache<cpu, float> decode = decode_profile ? Cache<cpu, float>(config, *decode_profile) : Cache<cpu, float>(config);
  const SeqId pid = 3, did = 11;
  prefill.add_sequence(pid);
  twin.add_sequence(pid);
  RowMirror mirror(layers);
  const std::int32_t rows[] = {static_cast<std::int32_t>(prompt)};
  for (int l = 0; l < layers; ++l) {
    const auto k = random_rows<float>(rng, static_cast<std::size_t>(prompt * L.row_elems));
    const auto v = random_rows<float>(rng, k.size());
    mirror.add(l, k, v);
    for (auto* c : {&prefill, &twin}) c->append(std::span(&pid, 1), l, rows, rows_view(k.data(), prompt), rows_view(v.data(), prompt));
  }
  const auto q0 = random_rows<float>(rng, static_cast<std::size_t>(layers * L.q_row_elems));
  AdmissionMessage sent = make_admission(prefill, pid, q0, 1);
  auto source = export_blocks(prefill, pid, sent);
  const std::vector<std::byte> bytes = encode_admission(sent);
  const AdmissionMessage message = decode_admission(bytes);
  std::vector<Ticket> dt = decode.admit(did, message, std::move(source));
  source.reset();
  REQUIRE(dt.size() == static_cast<std::size_t>(layers));
  std::vector<Ticket> tt;
  for (int l = 0; l < layers; ++l) {
    tt.push_back(twin.prefetch(std::span(&pid, 1), l, rows_view(q0.data() + l * L.q_row_elems, 1)));
  }
  const std::uint64_t fetched_at_admission = [&] {
    std::uint64_t n = 0;
    for (const auto& s : decode.statistics().layers) n += s.blocks_fetched;
    return n;
  }();
  RemoteDecodeResult out;
  out.admission_bytes = bytes.size();
  for (int step = 0; step < steps; ++step) {
    for (int l = 0; l < layers; ++l) {
      const auto k = random_rows<float>(rng, static_cast<std::size_t>(L.row_elems));
      const auto v = random_rows<float>(rng, k.size());
      mirror.add(l, k, v);
      decode.append(std::span(&did, 1), l, rows_view(k.data(), 1), rows_view(v.data(), 1));
      twin.append(std::span(&pid, 1), l, rows_view(k.data(), 1), rows_view(v.data(), 1));
      const auto q = random_rows<float>(rng, static_cast<std::size_t>(L.q_row_elems));
      Ticket dn = decode.prefetch(std::span(&did, 1), l, rows_view(q.data(), 1));
      Ticket tn = twin.prefetch(std::span(&pid, 1), l, rows_view(q.data(), 1));
      const LayerView<float> dv = decode.acquire(dt[static_cast<std::size_t>(l)]);
      const LayerView<float> tv = twin.acquire(tt[static_cast<std::size_t>(l)]);
      CAPTURE(step);
      CAPTURE(l);
      REQUIRE(same_blocks(dv, tv, L.num_kv_heads()));
      REQUIRE(view_holds_rows(L, dv, 0, mirror));
      if (L.remainder.moment_vectors > 0) {
        // The remainder estimate reads the moments the admission message carried (then the
        // appended rows' folds): the twin's, bit for bit.
        const auto qr = random_rows<float>(rng, static_cast<std::size_t>(L.q_row_elems));
        const auto states = static_cast<std::size_t>(L.num_q_heads());
        std::vector<float> d_out(states * static_cast<std::size_t>(L.head_dim())), t_out(d_out.size());
        std::vector<float> d_lse(states), t_lse(states);
        decode.remainder(dt[static_cast<std::size_t>(l)], rows_view(qr.data(), 1), d_out, d_lse);
        twin.remainder(tt[static_cast<std::size_t>(l)], rows_view(qr.data(), 1), t_out, t_lse);
        REQUIRE(std::memcmp(d_out.data(), t_out.data(), d_out.size() * sizeof(float)) == 0);
        REQUIRE(std::memcmp(d_lse.data(), t_lse.data(), d_lse.size() * sizeof(float)) == 0);
        for (float x : d_lse) out.remainder_mass += std::isfinite(x) ? std::exp(static_cast<double>(x)) : 0.0;
      }
      decode.release(dt[static_cast<std::size_t>(l)]);
      twin.release(tt[static_cast<std::size_t>(l)]);
      dt[static_cast<std::size_t>(l)] = dn;
      tt[static_cast<std::size_t>(l)] = tn;
    }
    ++out.steps;
  }
  decode.synchronize();  // the last plans' copies have run: every read planned was made
  const LayerStatistics total = decode.statistics().total();
  out.blocks_fetched = total.blocks_fetched - fetched_at_admission;
  out.remote_blocks_fetched = total.remote_blocks_fetched;
  out.decode_host_bytes = decode.statistics().host_bytes_in_use;
  out.prefill_host_bytes = prefill.statistics().host_bytes_in_use;
  return out;
}

}  // namespace oasiskv::test
