// The C++ byte-level BPE tokenizer against the reference tokenisation of GPL-3 stored by
// reference.py (HuggingFace `tokenizers` built from the same GGUF vocabulary and merges).
#include <doctest/doctest.h>

#include "model_fixture.hpp"
#include "reference_file.hpp"

TEST_SUITE("model") {
  TEST_CASE("tokenizer matches the reference tokenizer on GPL-3") {
    const auto& tokenizer = *model_tests::model_fixture().tokenizer;
    const auto ref = smollm2::read_reference(model_tests::data_path("reference_gpl3.bin"));
    const std::string text = model_tests::gpl3_text();
    const auto ids = tokenizer.encode(text);
    REQUIRE(ids.size() == ref.text_tokens.size());
    std::size_t first_difference = ids.size();
    for (std::size_t i = 0; i < ids.size() && first_difference == ids.size(); ++i)
      if (ids[i] != ref.text_tokens[i]) first_difference = i;
    CHECK_MESSAGE(first_difference == ids.size(), "first differing token at index " << first_difference);
    CHECK(tokenizer.decode(ids) == text);
  }

  TEST_CASE("tokenizer pre-tokenisation rules") {
    const auto& tokenizer = *model_tests::model_fixture().tokenizer;
    // smollm isolates digits, keeps the GPT-2 contractions, and leaves the last space of a run
    // to the following word.
    const auto pieces = tokenizer.pre_tokenize("it's 2007,  ok\n\n");
    const std::vector<std::string> expected{"it", "'s", " ", "2", "0", "0", "7", ",", " ", " ok", "\n\n"};
    CHECK(pieces == expected);
    const auto chat = tokenizer.encode("<|im_start|>user", /*parse_special=*/true);
    REQUIRE(chat.size() == 2);
    CHECK(chat[0] == tokenizer.id_of("<|im_start|>"));
  }
}
