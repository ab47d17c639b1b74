// smollm2-inspect: small utilities around the engine, used by tools/model_reference scripts.
//   smollm2-inspect info                       model configuration and tensor types
//   smollm2-inspect tokenize TEXT OUT.bin      token ids (int32) of a UTF-8 text file
//   smollm2-inspect reference REF.bin          compare dense logits with reference.py's output
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <stdexcept>
#include <string>

#include "gguf_reader.hpp"
#include "llama_model.hpp"
#include "model_files.hpp"
#include "reference_file.hpp"
#include "tokenizer.hpp"

using namespace smollm2;

int main(int argc, char** argv) try {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s info | tokenize TEXT OUT.bin | reference REF.bin  (env OASISKV_MODEL_PATH)\n", argv[0]);
    return 2;
  }
  const std::string command = argv[1];
  GgufFile file(find_model());
  if (command == "info") {
    LlamaModel model(file);
    const auto& c = model.config();
    std::printf("layers %d dim %d ffn %d heads %d/%d head_dim %d vocab %d context %d rope_base %g eps %g\n",
                c.num_layers, c.dim, c.ffn_dim, c.num_q_heads, c.num_kv_heads, c.head_dim, c.vocab_size,
                c.context_length, c.rope_base, c.rms_eps);
    std::map<std::string, int> types;
    for (const auto& t : file.tensors()) ++types[ggml_type_name(t.type)];
    for (const auto& [name, count] : types) std::printf("%s: %d tensors\n", name.c_str(), count);
  } else if (command == "tokenize" && argc == 4) {
    Tokenizer tokenizer(file);
    const std::string text = read_text_file(argv[2]);
    const auto ids = tokenizer.encode(text);
    std::ofstream out(argv[3], std::ios::binary);
    out.write(reinterpret_cast<const char*>(ids.data()), static_cast<std::streamsize>(ids.size() * 4));
    std::fprintf(stderr, "%zu tokens; round trip %s\n", ids.size(), tokenizer.decode(ids) == text ? "exact" : "DIFFERS");
  } else if (command == "reference" && argc == 3) {
    LlamaModel model(file);
    Tokenizer tokenizer(file);
    const ReferenceLogits ref = read_reference(argv[2]);
    const auto cmp = compare_with_reference(model, ref);
    std::printf("max |logit diff| %.3g (logit scale %.3g, relative %.3g); max |log-prob diff| %.3g; top-1 %s\n",
                cmp.max_abs_diff, cmp.max_abs_logit, cmp.max_abs_diff / cmp.max_abs_logit, cmp.max_log_prob_diff,
                cmp.top1_matches ? "matches" : "DIFFERS");
  } else {
    throw std::invalid_argument("unknown command '" + command + "'");
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "smollm2-inspect: %s\n", e.what());
  return 1;
}
