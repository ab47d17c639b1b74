// Minimal "--name value" command-line parsing shared by the SmolLM2 programs (apps/ and the
// evaluation in experiments/smollm2), and the option syntaxes they share (the block scorer).
#pragma once

#include <cmath>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <oasiskv/config.hpp>

namespace smollm2 {

class CliArgs {
 public:
  // `flags` are options without a value (e.g. --help); every other --name takes one value.
  CliArgs(int argc, char** argv, const std::vector<std::string>& known, const std::vector<std::string>& flags = {}) {
    for (int i = 1; i < argc; ++i) {
      const std::string raw = argv[i];
      if (raw.rfind("--", 0) != 0) throw std::invalid_argument("unexpected argument '" + raw + "'");
      const std::string a(argv[i] + 2);  // (not raw.substr: GCC 12 warns falsely, -Wrestrict)
      bool is_flag = false;
      for (const auto& f : flags) is_flag = is_flag || f == a;
      bool is_known = is_flag;
      for (const auto& k : known) is_known = is_known || k == a;
      if (!is_known) throw std::invalid_argument("unknown option --" + a);
      if (is_flag) {
        flags_.insert(a);
      } else {
        if (i + 1 >= argc) throw std::invalid_argument("option --" + a + " needs a value");
        values_[a] = argv[++i];
      }
    }
  }
  bool has(const std::string& name) const { return values_.count(name) != 0 || flags_.count(name) != 0; }
  std::string get(const std::string& name, const std::string& fallback = "") const {
    auto it = values_.find(name);
    return it == values_.end() ? fallback : it->second;
  }
  int get_int(const std::string& name, int fallback) const {
    return has(name) ? parse<int>(name, get(name)) : fallback;
  }
  double get_double(const std::string& name, double fallback) const {
    return has(name) ? parse<double>(name, get(name)) : fallback;
  }
  template <class T>
  std::vector<T> get_list(const std::string& name, const std::vector<T>& fallback) const {
    if (!has(name)) return fallback;
    std::vector<T> out;
    std::stringstream s(get(name));
    std::string item;
    while (std::getline(s, item, ',')) out.push_back(parse<T>(name, item));
    return out;
  }

 private:
  template <class T>
  static T parse(const std::string& name, const std::string& text) {
    if constexpr (std::is_same_v<T, std::string>) {
      return text;
    } else {
      std::istringstream s(text);
      T value;
      if (!(s >> value) || !s.eof()) throw std::invalid_argument("--" + name + ": cannot parse '" + text + "'");
      return value;
    }
  }
  std::map<std::string, std::string> values_;
  std::set<std::string> flags_;
};

// Sets config.scorer from "quest", "spread[:ALPHA]" (ALPHA: spread_alpha) or "runs[:ROWS]" (ROWS:
// run_tokens); throws std::invalid_argument or oasiskv::Error naming the bad text. The constant is
// checked by CacheLayout::from as usual.
inline void apply_scorer(const std::string& spec, oasiskv::CacheConfig& config) {
  const auto colon = spec.find(':');
  config.scorer = oasiskv::parse_block_score(spec.substr(0, colon));
  if (colon == std::string::npos) return;
  const std::string text = spec.substr(colon + 1);
  std::size_t used = 0;
  float value = 0.0f;
  try {
    value = std::stof(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size()) throw std::invalid_argument("scorer '" + spec + "': '" + text + "' is not a number");
  if (config.scorer == oasiskv::BlockScore::quest) {
    throw std::invalid_argument("scorer '" + spec + "': quest takes no parameter");
  }
  if (config.scorer == oasiskv::BlockScore::runs) {
    if (!(value >= 1.0f && value <= 65536.0f) || value != std::floor(value)) {
      throw std::invalid_argument("scorer '" + spec + "': '" + text + "' is not a whole number of rows (1 to 65536)");
    }
    config.run_tokens = static_cast<int>(value);
    return;
  }
  config.spread_alpha = value;
}

}  // namespace smollm2
