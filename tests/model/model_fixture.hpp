// The SmolLM2 model, loaded once per test process. A missing model fails the test with a message
// that says to run scripts/fetch-model, or skips it (exit 77) when OASISKV_SKIP_MODEL_TESTS=1.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "gguf_reader.hpp"
#include "llama_model.hpp"
#include "tokenizer.hpp"

namespace model_tests {

struct ModelFixture {
  std::unique_ptr<smollm2::GgufFile> file;
  std::unique_ptr<smollm2::LlamaModel> model;
  std::unique_ptr<smollm2::Tokenizer> tokenizer;
};

const ModelFixture& model_fixture();

// /usr/share/common-licenses/GPL-3 (Debian's base-files), the real text the tests use.
std::string gpl3_text();
std::vector<std::int32_t> gpl3_tokens();

// tests/model/data/<name>
std::string data_path(const std::string& name);

}  // namespace model_tests
