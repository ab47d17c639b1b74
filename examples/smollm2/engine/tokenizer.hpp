// Byte-level BPE tokenizer (GPT-2 family) built from a GGUF file's tokenizer.ggml.* metadata.
//
// Pre-tokenisation follows tokenizer.ggml.pre: "smollm" (and the StarCoder family) first isolates
// every numeric codepoint, then applies the GPT-2 regex
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// which is hand-coded here over codepoints (no regex engine: std::regex has no \p classes).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "gguf_reader.hpp"

namespace smollm2 {

class Tokenizer {
 public:
  explicit Tokenizer(const GgufFile& file);

  // Encodes UTF-8 text. With parse_special, occurrences of control tokens (e.g. <|im_start|>)
  // become their ids; otherwise they are tokenised as plain text.
  std::vector<std::int32_t> encode(std::string_view text, bool parse_special = false) const;
  std::string decode(const std::vector<std::int32_t>& ids) const;
  std::string token_text(std::int32_t id) const;  // decoded bytes of one token

  int vocab_size() const { return static_cast<int>(tokens_.size()); }
  std::int32_t bos_id() const { return bos_id_; }
  std::int32_t eos_id() const { return eos_id_; }
  std::int32_t id_of(const std::string& token) const;  // -1 when absent

  // The pre-tokeniser alone (exposed for tests): pieces of the text, as UTF-8.
  std::vector<std::string> pre_tokenize(std::string_view text) const;

 private:
  void encode_piece(std::string_view piece, std::vector<std::int32_t>& out) const;

  std::vector<std::string> tokens_;                   // byte-level unicode strings
  std::unordered_map<std::string, std::int32_t> token_ids_;
  std::unordered_map<std::string, int> merge_ranks_;  // "left right" -> rank
  std::vector<std::pair<std::string, std::int32_t>> special_tokens_;  // longest first
  std::string byte_to_symbol_[256];                   // GPT-2 byte -> unicode symbol (UTF-8)
  std::unordered_map<std::uint32_t, std::uint8_t> symbol_to_byte_;
  bool split_digits_ = false;
  std::int32_t bos_id_ = -1, eos_id_ = -1;
};

}  // namespace smollm2
