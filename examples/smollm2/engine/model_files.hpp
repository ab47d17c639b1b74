// Where the SmolLM2 model file lives, and reading the texts the programs take. The model is never
// committed: scripts/fetch-model puts it into $OASISKV_MODEL_DIR or <repo>/.cache/models.
#pragma once

#include <string>

namespace smollm2 {

inline constexpr const char* kModelFileName = "SmolLM2-135M-Instruct.Q4_1.gguf";

// Resolves the model path: an explicit path if given, else $OASISKV_MODEL_PATH, else
// $OASISKV_MODEL_DIR/<file>, else <repo>/.cache/models/<file> (repo root known at build time);
// only the first of these that is set is looked at.
// Throws std::runtime_error telling the user to run scripts/fetch-model when nothing exists.
std::string find_model(const std::string& explicit_path = "");

// Reads a whole file; throws naming the path when it cannot.
std::string read_text_file(const std::string& path);

}  // namespace smollm2
