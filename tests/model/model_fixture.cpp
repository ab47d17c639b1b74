#include "model_fixture.hpp"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>

#include "model_files.hpp"

namespace model_tests {

const ModelFixture& model_fixture() {
  static const ModelFixture fixture = [] {
    std::string path;
    try {
      path = smollm2::find_model();
    } catch (const std::exception& e) {
      const char* skip = std::getenv("OASISKV_SKIP_MODEL_TESTS");
      if (skip && std::string(skip) == "1") {
        std::fprintf(stderr, "skipped (OASISKV_SKIP_MODEL_TESTS=1): %s\n", e.what());
        std::exit(77);  // ctest SKIP_RETURN_CODE
      }
      throw;  // doctest reports the message: run scripts/fetch-model
    }
    ModelFixture f;
    f.file = std::make_unique<smollm2::GgufFile>(path);
    f.model = std::make_unique<smollm2::LlamaModel>(*f.file);
    f.tokenizer = std::make_unique<smollm2::Tokenizer>(*f.file);
    return f;
  }();
  return fixture;
}

std::string gpl3_text() {
  const std::string path = "/usr/share/common-licenses/GPL-3";
  if (!std::filesystem::exists(path))
    throw std::runtime_error(path + " is missing (Debian package base-files); the model tests read it as real text");
  return smollm2::read_text_file(path);
}

std::vector<std::int32_t> gpl3_tokens() {
  return model_fixture().tokenizer->encode(gpl3_text());
}

std::string data_path(const std::string& name) { return std::string(OASISKV_MODEL_TEST_DATA) + "/" + name; }

}  // namespace model_tests
