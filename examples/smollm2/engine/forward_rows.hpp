// The activations of one decode step's forward pass over a few new rows of one sequence: the
// current token and any drafts after it (a lookahead row, or speculative rows), at consecutive
// positions. Every session that decodes through a KV cache (oasiskv_session.cpp, and the
// evaluation's experiments/smollm2/experiment_session.cpp) writes the same scaffolding around its
// cache: embed the rows; per layer their queries, keys and values, the keys and values rounded to
// the cache's element type T for append, the attention output the session fills in, then the
// residual and MLP; last, the logits. This struct is that scaffolding; the session keeps the layer
// loop and what differs between sessions inside it: how it appends, plans and attends, and what it
// profiles or measures around these calls.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <oasiskv/dtype.hpp>

#include "llama_model.hpp"

namespace smollm2 {

template <class T>
struct ForwardRows {
  // Row 0: `token` at first_position; row 1 + i: drafts[i] at first_position + 1 + i. Embeds them.
  ForwardRows(const LlamaModel& model, std::int32_t token, std::span<const std::int32_t> drafts,
              std::int32_t first_position)
      : model(model), c(model.config()), rows(1 + static_cast<int>(drafts.size())) {
    std::vector<std::int32_t> tokens{token};
    positions.push_back(first_position);
    for (std::size_t i = 0; i < drafts.size(); ++i) {
      tokens.push_back(drafts[i]);
      positions.push_back(first_position + 1 + static_cast<std::int32_t>(i));
    }
    const auto R = static_cast<std::size_t>(rows);
    x.resize(R * c.dim);
    q.resize(R * c.q_width());
    k.resize(R * c.kv_width());
    v.resize(k.size());
    out.resize(q.size());
    model.embed(tokens, x.data());
  }

  // q, k, v of every row from x, at `layer`.
  void attention_inputs(int layer) {
    model.attention_inputs(layer, x.data(), rows, positions.data(), q.data(), k.data(), v.data());
  }

  // Every row's k and v in the cache's element type (the caller's buffers, kept across steps).
  void kv_rows(std::vector<T>& k_rows, std::vector<T>& v_rows) const {
    round_rows(k, k_rows);
    round_rows(v, v_rows);
  }

  float* q_row(int r) { return q.data() + static_cast<std::size_t>(r) * c.q_width(); }
  float* out_row(int r) { return out.data() + static_cast<std::size_t>(r) * c.q_width(); }

  // The attention output (out) projected and added to x, then the MLP, for the first `first_rows`
  // rows (rows are independent: a row no later layer reads can be left out).
  void attention_output_and_mlp(int layer, int first_rows) {
    model.attention_output_and_mlp(layer, x.data(), out.data(), first_rows);
  }

  // The logits of row 0 alone.
  std::vector<float> first_row_logits() const {
    std::vector<float> logits(c.vocab_size);
    model.logits(x.data(), 1, logits.data());
    return logits;
  }

  // The logits of every row, a vector a row.
  std::vector<std::vector<float>> logits() const {
    const auto R = static_cast<std::size_t>(rows);
    std::vector<float> all(R * c.vocab_size);
    model.logits(x.data(), rows, all.data());
    std::vector<std::vector<float>> by_row(R);
    for (std::size_t r = 0; r < R; ++r)
      by_row[r].assign(all.begin() + r * c.vocab_size, all.begin() + (r + 1) * c.vocab_size);
    return by_row;
  }

  const LlamaModel& model;
  const ModelConfig& c;
  int rows;
  std::vector<std::int32_t> positions;  // [rows]
  std::vector<float> x;                 // [rows][dim]: the residual stream
  std::vector<float> q, out;            // [rows][q heads][head dim]
  std::vector<float> k, v;              // [rows][kv heads][head dim]

 private:
  static void round_rows(const std::vector<float>& from, std::vector<T>& to) {
    to.resize(from.size());
    for (std::size_t i = 0; i < from.size(); ++i) to[i] = oasiskv::from_float<T>(from[i]);
  }
};

}  // namespace smollm2
