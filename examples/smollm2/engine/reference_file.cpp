#include "reference_file.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <stdexcept>

#include "dense_attention.hpp"

namespace smollm2 {
namespace {

template <class T>
void read_into(std::ifstream& in, T* data, std::size_t count, const std::string& path) {
  in.read(reinterpret_cast<char*>(data), static_cast<std::streamsize>(count * sizeof(T)));
  if (!in) throw std::runtime_error("reference file '" + path + "' is truncated");
}

}  // namespace

ReferenceLogits read_reference(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open reference file '" + path + "'");
  char magic[8];
  read_into(in, magic, 8, path);
  if (std::memcmp(magic, "OKVREF01", 8) != 0) throw std::runtime_error("'" + path + "' is not a reference file");
  std::int32_t header[4];
  read_into(in, header, 4, path);
  ReferenceLogits ref;
  ref.prompt.resize(header[0]);
  read_into(in, ref.prompt.data(), ref.prompt.size(), path);
  for (int p = 0; p < header[1]; ++p) {
    ReferenceLogits::Position pos;
    read_into(in, &pos.position, 1, path);
    read_into(in, &pos.log_sum_exp, 1, path);
    pos.ids.resize(header[2]);
    pos.logits.resize(header[2]);
    read_into(in, pos.ids.data(), pos.ids.size(), path);
    read_into(in, pos.logits.data(), pos.logits.size(), path);
    ref.positions.push_back(std::move(pos));
  }
  ref.text_tokens.resize(header[3]);
  read_into(in, ref.text_tokens.data(), ref.text_tokens.size(), path);
  return ref;
}

LogitComparison compare_with_reference(const LlamaModel& model, const ReferenceLogits& ref) {
  const ModelConfig& c = model.config();
  DenseKv kv(c.num_layers, c.kv_width(), static_cast<std::int64_t>(ref.prompt.size()));
  const PrefillResult result = prefill(model, kv, ref.prompt, /*keep_all_logits=*/true);
  LogitComparison cmp;
  for (const auto& pos : ref.positions) {
    const float* row = result.all_logits.data() + static_cast<std::size_t>(pos.position) * c.vocab_size;
    double max_logit = -INFINITY, total = 0.0;
    for (int i = 0; i < c.vocab_size; ++i) max_logit = std::max(max_logit, static_cast<double>(row[i]));
    for (int i = 0; i < c.vocab_size; ++i) total += std::exp(row[i] - max_logit);
    const double lse = max_logit + std::log(total);
    const std::int32_t engine_top1 = static_cast<std::int32_t>(std::max_element(row, row + c.vocab_size) - row);
    ++cmp.positions;
    if (engine_top1 != pos.ids.front()) {
      cmp.top1_matches = false;
      ++cmp.top1_mismatches;
      const auto at = std::find(pos.ids.begin(), pos.ids.end(), engine_top1);
      const double margin = at == pos.ids.end() ? INFINITY
                                                : static_cast<double>(pos.logits.front()) - pos.logits[at - pos.ids.begin()];
      cmp.max_mismatch_margin = std::max(cmp.max_mismatch_margin, margin);
    }
    for (std::size_t j = 0; j < pos.ids.size(); ++j) {
      const double engine = row[pos.ids[j]], reference = pos.logits[j];
      cmp.max_abs_diff = std::max(cmp.max_abs_diff, std::abs(engine - reference));
      cmp.max_abs_logit = std::max(cmp.max_abs_logit, std::abs(reference));
      cmp.max_log_prob_diff = std::max(cmp.max_log_prob_diff, std::abs((engine - lse) - (reference - pos.log_sum_exp)));
    }
  }
  return cmp;
}

}  // namespace smollm2
