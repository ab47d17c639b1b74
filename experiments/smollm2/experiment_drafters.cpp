#include "experiment_drafters.hpp"

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "dense_attention.hpp"

namespace smollm2 {

std::optional<std::int32_t> OracleDrafter::draft(std::span<const std::int32_t> history, std::int32_t true_next) {
  return true_next >= 0 ? true_next : history.back();
}

std::optional<std::int32_t> EarlyExitDrafter::draft(std::span<const std::int32_t> history, std::int32_t) {
  const ModelConfig& c = model_.config();
  const std::int32_t position = static_cast<std::int32_t>(history.size() - 1);
  std::vector<float> x(c.dim), q(c.q_width()), k(c.kv_width()), v(c.kv_width()), out(c.q_width());
  model_.embed(history.subspan(history.size() - 1), x.data());
  for (int l = 0; l < layers_; ++l) {
    model_.attention_inputs(l, x.data(), 1, &position, q.data(), k.data(), v.data());
    attend_dense_row(c, kv_, l, position, q.data(), k.data(), v.data(), 1, out.data());
    model_.attention_output_and_mlp(l, x.data(), out.data(), 1);
  }
  std::vector<float> logits(c.vocab_size);
  model_.logits(x.data(), 1, logits.data());
  return static_cast<std::int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

std::unique_ptr<Drafter> make_experiment_drafter(const std::string& name, const LlamaModel& model, const DenseKv& kv,
                                                 int early_exit_layers) {
  if (name == "oracle") return std::make_unique<OracleDrafter>();
  if (name == "ngram" || name.rfind("ngram:", 0) == 0 || name == "previous") return make_drafter(name);
  if (name.rfind("early-exit:", 0) == 0) {  // early-exit:N overrides the layer count
    std::size_t used = 0;
    int layers = -1;
    try {
      layers = std::stoi(name.substr(11), &used);
    } catch (const std::exception&) {
    }
    if (used == 0 || used != name.size() - 11) throw std::invalid_argument("bad drafter '" + name + "' (early-exit:N)");
    return make_experiment_drafter("early-exit", model, kv, layers);
  }
  if (name == "early-exit") {
    if (early_exit_layers < 1 || early_exit_layers > model.config().num_layers)
      throw std::invalid_argument("early-exit layers must be in [1, " + std::to_string(model.config().num_layers) + "]");
    return std::make_unique<EarlyExitDrafter>(model, kv, early_exit_layers);
  }
  throw std::invalid_argument("unknown drafter '" + name + "' (oracle, ngram, ngram:N, early-exit, early-exit:N, previous)");
}

}  // namespace smollm2
