// oasiskv_remote_peer: a prefill process without a model, for test_remote_processes.cpp, which
// needs a peer it can kill, or that misbehaves, from outside the test process.
//
//   oasiskv_remote_peer --seed S --length N [--mode serve|corrupt|truncate|other-shape]
//                       [--revoke-after-ms T] [--exit-after-release]
//   oasiskv_remote_peer --mode client --port P
//
// Prefill modes: a Cache<cpu, float> (remote_peer_config.hpp's config) holds one sequence of N
// rows generated from S (the test regenerates them), its admission is made and exported, a
// PrefillServer listens on 127.0.0.1 (any port) and the port is printed on stdout. The first
// decode peer to connect gets the admission: as it is (serve), one byte flipped (corrupt), cut
// short (truncate), or a message of a cache with another head_dim (other-shape); then reads are
// served. --revoke-after-ms revokes the request T ms after sending it. "freed" is printed once
// the sent request is freed (released, revoked, or its peer gone); --exit-after-release then
// exits 0. Exits 3 after 60 s whatever happens, 1 on an error, 2 on bad arguments.
// Client mode: a decode process that admits from the server at port P, reads a block, prints
// "admitted" and waits to be killed (the test's "decode process killed" case).
#include <oasiskv/cpu/admission_export.hpp>
#include <oasiskv/ucx/remote_tier.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <thread>

#include "remote_peer_config.hpp"

using namespace oasiskv;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

namespace {

constexpr auto kSafetyTimeout = 60s;

struct Args {
  std::uint64_t seed = 1;
  std::int64_t length = 0;
  std::string mode = "serve";
  long long revoke_after_ms = -1;
  bool exit_after_release = false;
  int port = 0;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--seed") a.seed = std::stoull(value());
    else if (arg == "--length") a.length = std::stoll(value());
    else if (arg == "--mode") a.mode = value();
    else if (arg == "--revoke-after-ms") a.revoke_after_ms = std::stoll(value());
    else if (arg == "--exit-after-release") a.exit_after_release = true;
    else if (arg == "--port") a.port = std::stoi(value());
    else throw std::invalid_argument("unknown argument " + arg);
  }
  return a;
}

void say(const char* line) {
  std::printf("%s\n", line);
  std::fflush(stdout);
}

int run_client(const Args& a) {
  auto connection = ucx::PrefillConnection::connect("127.0.0.1", static_cast<std::uint16_t>(a.port), 10s, 2s);
  const AdmissionMessage m = decode_admission(connection->receive_admission(20s));
  auto source = connection->source(m);
  std::vector<std::byte> local(64);
  const RemoteBlockRead read{local.data(), m.block_addresses.at(0), local.size()};
  source->read(std::span(&read, 1));
  say("admitted");
  for (const auto deadline = Clock::now() + kSafetyTimeout; Clock::now() < deadline;) {
    connection->progress();  // keeps the connection answering until the test kills this process
    std::this_thread::sleep_for(10ms);
  }
  return 3;
}

// The admission of the peer's sequence in a cache of `config`, exported on `server`.
AdmissionMessage exported(ucx::PrefillServer& server, const CacheConfig& config, const Args& a) {
  Cache<cpu, float> cache(config);
  const SeqId id = 1;
  test::peer::fill(cache, id, test::peer::prompt_rows(config, a.seed, a.length), a.length);
  AdmissionMessage m = make_admission(cache, id, test::peer::lookahead_queries(config, a.seed), 1);
  // export_request copies the blocks: the cache may go once it returns.
  server.export_request(host_blocks_of(cache, id), cache.host_tier().pool_block_bytes(), m);
  return m;
}

int run_prefill(const Args& a) {
  const CacheConfig config = test::peer::config();
  ucx::PrefillServer server("127.0.0.1", 0);
  AdmissionMessage message = exported(server, config, a);
  std::vector<std::byte> raw;  // sent instead of `message` when set
  if (a.mode == "corrupt") {
    raw = encode_admission(message);
    raw[raw.size() / 2] ^= std::byte{0x5a};  // inside the payload: the checksum must catch it
  } else if (a.mode == "truncate") {
    raw = encode_admission(message);
    raw.resize(raw.size() / 2);
  } else if (a.mode == "other-shape") {
    CacheConfig wide = config;
    wide.shape.head_dim = 32;
    raw = encode_admission(exported(server, wide, a));  // well-formed, but not for the decode cache
  } else if (a.mode != "serve") {
    throw std::invalid_argument("unknown --mode " + a.mode);
  }
  std::printf("%u\n", static_cast<unsigned>(server.port()));
  std::fflush(stdout);

  std::optional<Clock::time_point> sent_at;
  bool revoked = false, freed = false;
  for (const auto deadline = Clock::now() + kSafetyTimeout; Clock::now() < deadline;) {
    const auto peers = server.progress(5ms);
    if (!sent_at && !peers.empty()) {
      if (raw.empty()) server.send_admission(peers.front(), message);
      else server.send_admission_bytes(peers.front(), raw);
      sent_at = Clock::now();
    }
    if (sent_at && a.revoke_after_ms >= 0 && !revoked &&
        Clock::now() >= *sent_at + std::chrono::milliseconds(a.revoke_after_ms)) {
      server.revoke(message.request_id);
      revoked = true;
    }
    // A raw send binds no request: only `serve` (and revoke) can free what it sent.
    if (sent_at && raw.empty() && !freed && server.live_requests() == 0) {
      say("freed");
      if (a.exit_after_release) return 0;
      freed = true;
    }
  }
  std::fprintf(stderr, "oasiskv_remote_peer: safety timeout (%lld s)\n", static_cast<long long>(kSafetyTimeout.count()));
  return 3;
}

}  // namespace

int main(int argc, char** argv) {
  (void)::setenv("UCX_TLS", "tcp", 0);  // as the tests: works on every machine
  Args args;
  try {
    args = parse(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "oasiskv_remote_peer: %s\n", e.what());
    return 2;
  }
  try {
    return args.mode == "client" ? run_client(args) : run_prefill(args);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "oasiskv_remote_peer: %s\n", e.what());
    return 1;
  }
}
