// smollm2-pd: prefill-decode disaggregation with SmolLM2 over the UCX remote tier, one role per
// process (scripts/pd-demo starts both).
//
// --role prefill: prefills the prompt densely, builds the request's admission message (summaries,
// first working set, the first plan's lookahead queries; OasisKV's make_admission), exports its
// KV blocks (one UCX registration), runs the single-process sparse decode of the same tokens as
// the reference (written to --reference-out), then serves the decode process: sends it the
// message and answers its reads until it releases the request.
// --role decode: connects, admits the request from the message alone and decodes --tokens
// tokens, reading the prompt's blocks from the prefill process as the prefetch pipeline needs
// them; prints one JSON line with its figures and tokens.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <oasiskv/ucx/remote_tier.hpp>

#include "cli_args.hpp"
#include "dense_attention.hpp"
#include "drafters.hpp"
#include "gguf_reader.hpp"
#include "model_files.hpp"
#include "oasiskv_session.hpp"
#include "tokenizer.hpp"

using namespace smollm2;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {

const char* kUsage = R"(usage: smollm2-pd --role prefill|decode [options]
  common:  --model PATH  --tokens M (tokens to decode) [64]  --budget N [256]  --fetch-ratio R [1.0]
           --sink-tokens N / --recent-tokens N   [CacheConfig defaults]
  prefill: --prompt-file FILE  --prompt-tokens N (the first N tokens of the file) [4096]
           --listen IP [127.0.0.1]  --port N [0: any]  --port-file FILE (written once serving)
           --reference-out FILE (the single-process run's tokens, JSON)  --serve-timeout-s S [600]
  decode:  --connect IP:PORT  --read-timeout-ms T [5000]  --connect-timeout-s S [60]
)";

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }
std::int32_t argmax(const std::vector<float>& v) {
  return static_cast<std::int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

// The same config on both sides: the decode process must make the prefill's plans.
oasiskv::CacheConfig cache_config(const CliArgs& args, const ModelConfig& c, std::int64_t capacity) {
  oasiskv::CacheConfig config;
  config.shape = model_shape(c);
  config.budget_tokens = args.get_int("budget", 256);
  config.sink_tokens = args.get_int("sink-tokens", config.sink_tokens);
  config.recent_tokens = args.get_int("recent-tokens", config.recent_tokens);
  config.fetch_ratio = args.get_double("fetch-ratio", 1.0);
  config.max_sequences = 1;
  config.max_tokens_per_sequence = capacity;
  return config;
}

// user_data of the message: the first generated token, then the prompt's tokens (the n-gram
// drafter's history), int32 each.
std::vector<std::byte> pack_tokens(std::int32_t first, const std::vector<std::int32_t>& prompt) {
  std::vector<std::byte> out((prompt.size() + 1) * sizeof(std::int32_t));
  std::memcpy(out.data(), &first, sizeof first);
  if (!prompt.empty()) std::memcpy(out.data() + sizeof first, prompt.data(), prompt.size() * sizeof(std::int32_t));
  return out;
}
std::vector<std::int32_t> unpack_tokens(const std::vector<std::byte>& data) {
  if (data.size() < sizeof(std::int32_t) || data.size() % sizeof(std::int32_t) != 0) {
    throw std::runtime_error(fmt::format("admission user_data: {} bytes is not a list of tokens", data.size()));
  }
  std::vector<std::int32_t> tokens(data.size() / sizeof(std::int32_t));
  std::memcpy(tokens.data(), data.data(), data.size());
  return tokens;
}

std::int64_t full_kv_bytes(const ModelConfig& c, std::int64_t tokens) {
  return tokens * c.num_layers * 2 * static_cast<std::int64_t>(c.kv_width()) * static_cast<std::int64_t>(sizeof(float));
}

// Counts what the decode side reads remotely (the transport's source does the reading).
class CountingSource final : public oasiskv::RemoteBlockSource {
 public:
  explicit CountingSource(std::shared_ptr<oasiskv::RemoteBlockSource> inner) : inner_(std::move(inner)) {}
  void read(std::span<const oasiskv::RemoteBlockRead> reads) override {
    inner_->read(reads);
    for (const auto& r : reads) bytes_ += r.bytes;
    blocks_ += reads.size();
  }
  std::uint64_t bytes() const { return bytes_; }
  std::uint64_t blocks() const { return blocks_; }

 private:
  std::shared_ptr<oasiskv::RemoteBlockSource> inner_;
  std::atomic<std::uint64_t> bytes_{0}, blocks_{0};
};

int run_prefill(const CliArgs& args) {
  GgufFile file(find_model(args.get("model")));
  LlamaModel model(file);
  Tokenizer tokenizer(file);
  const ModelConfig& c = model.config();
  auto tokens = tokenizer.encode(read_text_file(args.get("prompt-file")), false);
  const int want = args.get_int("prompt-tokens", 4096);
  if (static_cast<int>(tokens.size()) < want) {
    throw std::invalid_argument(fmt::format("--prompt-file has {} tokens, fewer than --prompt-tokens {}", tokens.size(), want));
  }
  tokens.resize(static_cast<std::size_t>(want));
  const int n_new = args.get_int("tokens", 64);
  const auto P = static_cast<std::int64_t>(tokens.size());
  const std::int64_t capacity = P + n_new + 2;
  if (capacity > c.context_length) throw std::invalid_argument("prompt + tokens exceed the model context");

  auto t0 = Clock::now();
  DenseKv kv(c.num_layers, c.kv_width(), capacity);
  const PrefillResult pre = prefill(model, kv, tokens);
  const double prefill_s = since(t0);
  const oasiskv::CacheConfig config = cache_config(args, c, capacity);
  OasisKvSession<float> session(model, config, kv, P);
  NgramDrafter drafter;
  std::vector<std::int32_t> history = tokens;
  const std::int32_t first = argmax(pre.last_logits);
  history.push_back(first);
  // The first working set from the draft's row at P, or without a draft from the last prompt row's.
  const auto first_draft = drafter.draft(history, -1);
  const auto lookahead = first_draft ? dense_row_queries(model, kv, *first_draft, static_cast<std::int32_t>(P))
                                     : pre.last_queries;
  std::vector<float> flat;
  for (const auto& q : lookahead) flat.insert(flat.end(), q.begin(), q.end());

  // The request: its message and its blocks, exported before this process decodes on.
  oasiskv::AdmissionMessage message = oasiskv::make_admission(session.cache(), 1, flat, 1, 1);
  message.user_data = pack_tokens(first, tokens);
  oasiskv::ucx::PrefillServer server(args.get("listen", "127.0.0.1"), static_cast<std::uint16_t>(args.get_int("port", 0)));
  server.export_request(oasiskv::host_blocks_of(session.cache(), 1), session.cache().host_tier().pool_block_bytes(), message);

  // The reference: the single-process sparse decode from the same state.
  t0 = Clock::now();
  session.start(lookahead, 1);
  std::vector<std::int32_t> reference{first};
  while (static_cast<int>(reference.size()) < n_new) {
    reference.push_back(argmax(session.step(history.back(), drafter.draft(history, -1))));
    history.push_back(reference.back());
  }
  const double reference_s = since(t0);
  if (args.has("reference-out")) {
    std::ofstream out(args.get("reference-out"));
    out << fmt::format(R"({{"prefill_s": {:.3f}, "reference_decode_s": {:.3f}, "tokens": [{}]}})", prefill_s,
                       reference_s, fmt::join(reference, ", "))
        << "\n";
  }

  // Serve: wait for the decode process, send it the message, answer its reads until it releases.
  if (args.has("port-file")) {
    const std::string tmp = args.get("port-file") + ".tmp";
    std::ofstream(tmp) << server.port() << "\n";
    std::rename(tmp.c_str(), args.get("port-file").c_str());
  }
  std::fprintf(stderr, "smollm2-pd prefill: %lld prompt tokens, prefill %.1f s, serving on port %u\n",
               static_cast<long long>(P), prefill_s, static_cast<unsigned>(server.port()));
  const auto deadline = Clock::now() + std::chrono::seconds(args.get_int("serve-timeout-s", 600));
  bool sent = false;
  while (Clock::now() < deadline) {
    const auto peers = server.progress(milliseconds(10));
    if (!sent && !peers.empty()) {
      server.send_admission(peers.front(), message);
      sent = true;
    }
    if (sent && server.live_requests() == 0) {
      std::fprintf(stderr, "smollm2-pd prefill: the decode process released the request\n");
      return 0;
    }
  }
  throw std::runtime_error("serve timeout: the decode process did not release the request");
}

int run_decode(const CliArgs& args) {
  const std::string where = args.get("connect");
  const auto colon = where.rfind(':');
  if (colon == std::string::npos) throw std::invalid_argument("--connect takes IP:PORT, got '" + where + "'");
  GgufFile file(find_model(args.get("model")));
  LlamaModel model(file);
  const ModelConfig& c = model.config();
  const int n_new = args.get_int("tokens", 64);

  auto connection = oasiskv::ucx::PrefillConnection::connect(
      where.substr(0, colon), static_cast<std::uint16_t>(std::stoi(where.substr(colon + 1))),
      std::chrono::seconds(args.get_int("connect-timeout-s", 60)), milliseconds(args.get_int("read-timeout-ms", 5000)));
  auto t0 = Clock::now();
  std::vector<std::byte> bytes = connection->receive_admission(std::chrono::seconds(args.get_int("connect-timeout-s", 60)));
  const std::size_t admission_bytes = bytes.size();
  auto message = std::make_unique<oasiskv::AdmissionMessage>(oasiskv::decode_admission(bytes));
  bytes = {};  // the decoded message is all the admission holds
  std::vector<std::int32_t> history = unpack_tokens(message->user_data);
  const std::int32_t first = history.front();
  history.erase(history.begin());
  const std::int64_t P = message->length;
  if (static_cast<std::int64_t>(history.size()) != P) {
    throw std::runtime_error(fmt::format("admission user_data: {} prompt tokens for a {}-token request", history.size(), P));
  }
  history.push_back(first);
  const oasiskv::CacheConfig config = cache_config(args, c, P + n_new + 2);
  auto source = std::make_shared<CountingSource>(connection->source(*message));
  OasisKvSession<float> session(model, config, *message, source);
  const double admit_s = since(t0);
  // Host memory of the cache: its host pool, plus the message while admission held it.
  const auto host_bytes = [&] { return static_cast<std::int64_t>(session.cache().statistics().host_bytes_in_use); };
  std::int64_t peak = host_bytes() + static_cast<std::int64_t>(admission_bytes);
  message.reset();
  session.cache().reset_statistics();
  const std::uint64_t admitted_bytes = source->bytes();

  NgramDrafter drafter;
  std::vector<std::int32_t> out{first};
  t0 = Clock::now();
  while (static_cast<int>(out.size()) < n_new) {
    out.push_back(argmax(session.step(history.back(), drafter.draft(history, -1))));
    history.push_back(out.back());
    peak = std::max(peak, host_bytes());
  }
  const double decode_s = since(t0);
  session.cache().synchronize();  // the last plans' reads have landed: count them
  const auto steps = static_cast<double>(std::max<std::size_t>(1, out.size() - 1));
  const auto total = session.cache().statistics().total();
  const std::int64_t full = full_kv_bytes(c, P);
  fmt::print(
      R"({{"role": "decode", "prompt_tokens": {}, "decode_tokens": {}, "admission_bytes": {}, "full_kv_bytes": {}, )"
      R"("kv_ratio": {:.2f}, "decode_host_peak_bytes": {}, "resident_bytes": {}, "fetched_bytes_per_step": {:.0f}, )"
      R"("fetched_blocks_per_step": {:.2f}, "acquire_wait_ms_per_step": {:.3f}, "admit_s": {:.3f}, )"
      R"("decode_tokens_per_s": {:.2f}, "budget_tokens": {}, "fetch_ratio": {}, "tokens": [{}]}})"
      "\n",
      P, out.size(), admission_bytes, full, static_cast<double>(full) / static_cast<double>(admission_bytes), peak,
      session.cache().backend().slot_pool().bytes_reserved(),
      static_cast<double>(source->bytes() - admitted_bytes) / steps,
      static_cast<double>(total.blocks_fetched) / steps, static_cast<double>(total.acquire_wait_ns) / 1e6 / steps, admit_s,
      steps / decode_s, config.budget_tokens, config.fetch_ratio, fmt::join(out, ", "));
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  const CliArgs args(argc, argv,
                     {"role", "model", "tokens", "budget", "fetch-ratio", "sink-tokens", "recent-tokens", "prompt-file",
                      "prompt-tokens", "listen", "port", "port-file", "reference-out", "serve-timeout-s", "connect",
                      "read-timeout-ms", "connect-timeout-s"},
                     {"help"});
  if (args.has("help") || !args.has("role")) {
    std::fputs(kUsage, args.has("help") ? stdout : stderr);
    return args.has("help") ? 0 : 2;
  }
  if (args.get("role") == "prefill") return run_prefill(args);
  if (args.get("role") == "decode") return run_decode(args);
  throw std::invalid_argument("--role must be prefill or decode, got '" + args.get("role") + "'");
} catch (const std::exception& e) {
  std::fprintf(stderr, "smollm2-pd: %s\n", e.what());
  return 1;
}
