#include "tokenizer.hpp"

#include <algorithm>
#include <climits>
#include <stdexcept>

namespace smollm2 {
namespace {

struct CodepointRange {
  std::uint32_t first, last;
};
#include "unicode_tables.inc"

template <std::size_t N>
bool in_ranges(const CodepointRange (&ranges)[N], std::uint32_t cp) {
  auto it = std::upper_bound(std::begin(ranges), std::end(ranges), cp,
                             [](std::uint32_t v, const CodepointRange& r) { return v < r.first; });
  return it != std::begin(ranges) && cp <= (it - 1)->last;
}

bool is_letter(std::uint32_t cp) {
  if (cp < 128) return (cp | 0x20) >= 'a' && (cp | 0x20) <= 'z';
  return in_ranges(kLetterRanges, cp);
}
bool is_number(std::uint32_t cp) {
  if (cp < 128) return cp >= '0' && cp <= '9';
  return in_ranges(kNumberRanges, cp);
}
bool is_space(std::uint32_t cp) {  // Unicode White_Space, as \s in the HF/llama.cpp regex
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

// Decodes UTF-8 to codepoints, remembering each codepoint's byte offset. Invalid bytes become
// one-byte codepoints (U+FFFD class: neither letter, number nor space) so no input is rejected.
struct Utf8Text {
  std::vector<std::uint32_t> cps;
  std::vector<std::size_t> offsets;  // size cps.size() + 1
};
Utf8Text decode_utf8(std::string_view s) {
  Utf8Text t;
  std::size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    int len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    std::uint32_t cp = 0xFFFD;
    if (len == 0 || i + len > s.size()) {
      len = 1;
    } else {
      cp = len == 1 ? c : c & (0xFF >> (len + 1));
      for (int k = 1; k < len; ++k) {
        const auto cc = static_cast<unsigned char>(s[i + k]);
        if ((cc & 0xC0) != 0x80) { cp = 0xFFFD; len = 1; break; }
        cp = (cp << 6) | (cc & 0x3F);
      }
    }
    t.cps.push_back(cp);
    t.offsets.push_back(i);
    i += len;
  }
  t.offsets.push_back(s.size());
  return t;
}

std::string encode_utf8(std::uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    s += static_cast<char>(0xE0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    s += static_cast<char>(0xF0 | (cp >> 18));
    s += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

// Length (in codepoints) of the GPT-2 regex match starting at i within [i, end).
std::size_t gpt2_match_length(const std::vector<std::uint32_t>& cp, std::size_t i, std::size_t end) {
  auto at = [&](std::size_t k) -> std::uint32_t { return k < end ? cp[k] : 0xFFFFFFFFu; };
  auto other = [&](std::uint32_t c) { return c != 0xFFFFFFFFu && !is_space(c) && !is_letter(c) && !is_number(c); };
  const std::uint32_t c = cp[i];
  if (c == '\'') {  // contractions, case-sensitive as in GPT-2
    const auto n1 = at(i + 1), n2 = at(i + 2);
    if (n1 == 's' || n1 == 't' || n1 == 'm' || n1 == 'd') return 2;
    if ((n1 == 'r' && n2 == 'e') || (n1 == 'v' && n2 == 'e') || (n1 == 'l' && n2 == 'l')) return 3;
  }
  const std::size_t start = (c == ' ' && i + 1 < end) ? i + 1 : i;  // the optional leading space
  const std::uint32_t first = cp[start];
  std::size_t j = start;
  if (start < end) {
    if (is_letter(first)) {
      while (j < end && is_letter(cp[j])) ++j;
      return j - i;
    }
    if (is_number(first)) {
      while (j < end && is_number(cp[j])) ++j;
      return j - i;
    }
    if (other(first)) {
      while (j < end && other(cp[j])) ++j;
      return j - i;
    }
  }
  // Whitespace: \s+(?!\S) takes the run but leaves its last character for the next match when a
  // non-space follows; a lone space before a non-space falls through to \s+ (one character).
  j = i;
  while (j < end && is_space(cp[j])) ++j;
  if (j == end || j - i == 1) return j - i;
  return j - i - 1;
}

}  // namespace

Tokenizer::Tokenizer(const GgufFile& file) {
  const std::string model = file.get_string("tokenizer.ggml.model");
  if (model != "gpt2") throw std::runtime_error("tokenizer model '" + model + "' is not gpt2 (byte-level BPE)");
  const std::string pre = file.has("tokenizer.ggml.pre") ? file.get_string("tokenizer.ggml.pre") : "default";
  if (pre == "smollm" || pre == "starcoder" || pre == "refact" || pre == "codeshell")
    split_digits_ = true;
  else if (pre != "gpt-2" && pre != "gpt2" && pre != "default")
    throw std::runtime_error("pre-tokenizer '" + pre + "' is not implemented");
  tokens_ = file.get("tokenizer.ggml.tokens").strings;
  const auto& types = file.get("tokenizer.ggml.token_type").integers;
  for (std::size_t i = 0; i < tokens_.size(); ++i) {
    token_ids_.emplace(tokens_[i], static_cast<std::int32_t>(i));
    // 3 = control, 4 = user defined: matched verbatim when parse_special is on.
    if (i < types.size() && (types[i] == 3 || types[i] == 4))
      special_tokens_.emplace_back(tokens_[i], static_cast<std::int32_t>(i));
  }
  std::sort(special_tokens_.begin(), special_tokens_.end(),
            [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  const auto& merges = file.get("tokenizer.ggml.merges").strings;
  for (std::size_t r = 0; r < merges.size(); ++r) merge_ranks_.emplace(merges[r], static_cast<int>(r));
  bos_id_ = file.has("tokenizer.ggml.bos_token_id") ? static_cast<std::int32_t>(file.get_int("tokenizer.ggml.bos_token_id")) : -1;
  eos_id_ = file.has("tokenizer.ggml.eos_token_id") ? static_cast<std::int32_t>(file.get_int("tokenizer.ggml.eos_token_id")) : -1;

  // GPT-2's reversible byte -> printable unicode map: printable Latin-1 bytes map to themselves,
  // the rest to U+0100 onwards in byte order.
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    const std::uint32_t cp = printable ? static_cast<std::uint32_t>(b) : static_cast<std::uint32_t>(next++);
    byte_to_symbol_[b] = encode_utf8(cp);
    symbol_to_byte_[cp] = static_cast<std::uint8_t>(b);
  }
}

std::int32_t Tokenizer::id_of(const std::string& token) const {
  auto it = token_ids_.find(token);
  return it == token_ids_.end() ? -1 : it->second;
}

std::vector<std::string> Tokenizer::pre_tokenize(std::string_view text) const {
  const Utf8Text t = decode_utf8(text);
  std::vector<std::string> pieces;
  auto emit = [&](std::size_t a, std::size_t b) {
    pieces.emplace_back(text.substr(t.offsets[a], t.offsets[b] - t.offsets[a]));
  };
  // Stage 1 (digit isolation) cuts the text into segments; stage 2 (GPT-2 regex) runs in each.
  std::size_t seg_start = 0;
  auto run_regex = [&](std::size_t a, std::size_t b) {
    while (a < b) {
      const std::size_t n = gpt2_match_length(t.cps, a, b);
      emit(a, a + n);
      a += n;
    }
  };
  for (std::size_t i = 0; i < t.cps.size(); ++i) {
    if (split_digits_ && is_number(t.cps[i])) {
      run_regex(seg_start, i);
      emit(i, i + 1);
      seg_start = i + 1;
    }
  }
  run_regex(seg_start, t.cps.size());
  return pieces;
}

void Tokenizer::encode_piece(std::string_view piece, std::vector<std::int32_t>& out) const {
  std::vector<std::string> symbols;
  for (unsigned char b : piece) symbols.push_back(byte_to_symbol_[b]);
  // Classic BPE: repeatedly merge the adjacent pair with the lowest merge rank.
  std::string key;
  while (symbols.size() > 1) {
    int best_rank = INT_MAX;
    std::size_t best = 0;
    for (std::size_t i = 0; i + 1 < symbols.size(); ++i) {
      key.assign(symbols[i]).append(" ").append(symbols[i + 1]);
      auto it = merge_ranks_.find(key);
      if (it != merge_ranks_.end() && it->second < best_rank) {
        best_rank = it->second;
        best = i;
      }
    }
    if (best_rank == INT_MAX) break;
    symbols[best] += symbols[best + 1];
    symbols.erase(symbols.begin() + static_cast<std::ptrdiff_t>(best) + 1);
  }
  for (const auto& s : symbols) {
    auto id = id_of(s);
    if (id < 0) throw std::runtime_error("BPE produced symbol '" + s + "' missing from the vocabulary");
    out.push_back(id);
  }
}

std::vector<std::int32_t> Tokenizer::encode(std::string_view text, bool parse_special) const {
  std::vector<std::int32_t> ids;
  auto encode_plain = [&](std::string_view part) {
    for (const auto& piece : pre_tokenize(part)) encode_piece(piece, ids);
  };
  if (!parse_special) {
    encode_plain(text);
    return ids;
  }
  std::size_t start = 0, i = 0;
  while (i < text.size()) {
    bool matched = false;
    for (const auto& [s, id] : special_tokens_) {
      if (text.compare(i, s.size(), s) == 0) {
        encode_plain(text.substr(start, i - start));
        ids.push_back(id);
        i += s.size();
        start = i;
        matched = true;
        break;
      }
    }
    if (!matched) ++i;
  }
  encode_plain(text.substr(start));
  return ids;
}

std::string Tokenizer::token_text(std::int32_t id) const {
  if (id < 0 || id >= vocab_size()) throw std::out_of_range("token id " + std::to_string(id) + " outside the vocabulary");
  const std::string& s = tokens_[id];
  for (const auto& [text, special] : special_tokens_)
    if (special == id) return text;
  std::string bytes;
  const Utf8Text t = decode_utf8(s);
  for (auto cp : t.cps) {
    auto it = symbol_to_byte_.find(cp);
    if (it == symbol_to_byte_.end()) return s;  // not a byte-level token: keep it verbatim
    bytes += static_cast<char>(it->second);
  }
  return bytes;
}

std::string Tokenizer::decode(const std::vector<std::int32_t>& ids) const {
  std::string out;
  for (auto id : ids) out += token_text(id);
  return out;
}

}  // namespace smollm2
