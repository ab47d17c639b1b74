// The remote tier's faults with real processes: prefill processes (oasiskv_remote_peer, spawned)
// killed, sending a bad admission, revoking, or waiting for the decode side to release or exit.
// The decode side is this process: a Cache<cpu, float> admitting from PrefillConnections. Each
// fault must end as an Error or a failed check, never a hang: every wait has a deadline, and
// every child is killed and reaped by its guard, whatever fails.
#include <oasiskv/ucx/remote_tier.hpp>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "remote_decode.hpp"
#include "remote_peer_config.hpp"
#include "support.hpp"

extern char** environ;

using namespace oasiskv;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

const bool kTransportChosen = [] {
  (void)::setenv("UCX_TLS", "tcp", 0);  // the peers inherit it
  return true;
}();

constexpr auto kDeadline = 20s;

// A child process, SIGKILLed and reaped when destroyed, so that a failed check leaks none.
struct Child {
  pid_t pid = -1;
  int out = -1;  // the read end of its stdout
  Child() = default;
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  ~Child() {
    kill_now();
    if (out >= 0) ::close(out);
  }
  void kill_now() {
    if (pid <= 0) return;
    ::kill(pid, SIGKILL);
    while (::waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
    }
    pid = -1;
  }
};

// An oasiskv_remote_peer process (remote_peer.cpp); `serves`: it prints its port first.
class Peer {
 public:
  explicit Peer(const std::vector<std::string>& args, bool serves = true) {
    int fds[2];
    REQUIRE(::pipe2(fds, O_CLOEXEC) == 0);
    child_.out = fds[0];
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
    // Nothing else reaches the child, this process's UCX sockets above all: an inherited socket
    // would hold a connection open after this process closed it.
    posix_spawn_file_actions_addclosefrom_np(&actions, 3);
    std::vector<std::string> words{OASISKV_REMOTE_PEER};
    words.insert(words.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (std::string& w : words) argv.push_back(w.data());
    argv.push_back(nullptr);
    const int rc = ::posix_spawn(&child_.pid, OASISKV_REMOTE_PEER, &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    ::close(fds[1]);
    if (rc != 0) child_.pid = -1;
    REQUIRE_MESSAGE(rc == 0, "posix_spawn " OASISKV_REMOTE_PEER ": " << std::strerror(rc));
    if (serves) {
      const std::string line = read_line(kDeadline);
      REQUIRE_MESSAGE(!line.empty(), "the peer printed no port");
      port_ = static_cast<std::uint16_t>(std::stoi(line));
    }
  }
  std::uint16_t port() const { return port_; }
  void kill() { child_.kill_now(); }

  // The next line the peer prints, or "" if none comes by the deadline (or it exited). Runs
  // `meanwhile` every few ms (the decode side may have to progress for the peer to go on).
  std::string read_line(std::chrono::milliseconds timeout, const std::function<void()>& meanwhile = {}) {
    const auto deadline = Clock::now() + timeout;
    for (;;) {
      if (const auto nl = buffer_.find('\n'); nl != std::string::npos) {
        std::string line = buffer_.substr(0, nl);
        buffer_.erase(0, nl + 1);
        return line;
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) return {};
      pollfd p{child_.out, POLLIN, 0};
      const int n = ::poll(&p, 1, meanwhile ? static_cast<int>(std::min<long long>(left, 2)) : static_cast<int>(left));
      if (meanwhile) meanwhile();
      if (n < 0 && errno != EINTR) return {};
      if (n <= 0) continue;
      char chunk[256];
      const ssize_t got = ::read(child_.out, chunk, sizeof chunk);
      if (got <= 0) return {};  // end of file: the peer exited
      buffer_.append(chunk, static_cast<std::size_t>(got));
    }
  }
  // Its exit status once it exited (128 + signal if killed), or nothing by the deadline.
  std::optional<int> wait_exit(std::chrono::milliseconds timeout) {
    for (const auto deadline = Clock::now() + timeout; Clock::now() < deadline; std::this_thread::sleep_for(5ms)) {
      int status = 0;
      if (::waitpid(child_.pid, &status, WNOHANG) == child_.pid) {
        child_.pid = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
    }
    return std::nullopt;
  }

 private:
  Child child_;
  std::uint16_t port_ = 0;
  std::string buffer_;
};

std::shared_ptr<ucx::PrefillConnection> connect(const Peer& peer, std::chrono::milliseconds read_timeout) {
  return ucx::PrefillConnection::connect("127.0.0.1", peer.port(), 10s, read_timeout);
}

// A request received from a peer, ready to admit.
struct Received {
  std::shared_ptr<ucx::PrefillConnection> connection;
  AdmissionMessage message;
  std::shared_ptr<test::peer::CountingSource> source;
};

Received receive(const Peer& peer, std::chrono::milliseconds read_timeout) {
  Received r;
  r.connection = connect(peer, read_timeout);
  r.message = decode_admission(r.connection->receive_admission(kDeadline));
  r.source = std::make_shared<test::peer::CountingSource>(r.connection->source(r.message));
  return r;
}

// The rows of a sequence admitted from the peer of `seed`: its prompt, regenerated here.
test::RowMirror prompt_mirror(const CacheConfig& c, std::uint64_t seed, std::int64_t length) {
  const test::peer::Prompt p = test::peer::prompt_rows(c, seed, length);
  test::RowMirror m(c.shape.num_layers);
  for (int l = 0; l < c.shape.num_layers; ++l) m.add(l, p.k[static_cast<std::size_t>(l)], p.v[static_cast<std::size_t>(l)]);
  return m;
}

// Admits and checks the first plan's views (the working set the message carried).
void admit(Cache<cpu, float>& cache, SeqId id, const Received& r, const test::RowMirror& rows) {
  for (const Ticket& t : cache.admit(id, r.message, r.source)) {
    const LayerView<float> view = cache.acquire(t);
    CHECK(test::view_holds_rows(cache.layout(), view, 0, rows));
    cache.release(t);
  }
}

// One decode step of `batch` at every layer: a random row appended to each sequence (kept in its
// mirror), a plan from random queries (scaled up, so the selections move and remote blocks are
// fetched), and every acquired view checked against the mirrors. acquire's Error propagates.
void step(std::mt19937_64& rng, Cache<cpu, float>& cache, std::span<const SeqId> batch,
          std::span<test::RowMirror* const> rows) {
  const CacheLayout& L = cache.layout();
  const auto n = static_cast<std::int64_t>(batch.size());
  const auto row = static_cast<std::size_t>(L.row_elems);
  for (int l = 0; l < L.num_layers(); ++l) {
    const auto k = test::random_rows<float>(rng, static_cast<std::size_t>(n) * row);
    const auto v = test::random_rows<float>(rng, k.size());
    for (std::size_t i = 0; i < batch.size(); ++i) {
      rows[i]->add(l, std::vector<float>(k.begin() + i * row, k.begin() + (i + 1) * row),
                   std::vector<float>(v.begin() + i * row, v.begin() + (i + 1) * row));
    }
    cache.append(batch, l, rows_view(k.data(), n), rows_view(v.data(), n));
    const auto q = test::random_rows<float>(rng, static_cast<std::size_t>(n * L.q_row_elems), 4.0f);
    const Ticket t = cache.prefetch(batch, l, rows_view(q.data(), n));
    const LayerView<float> view = cache.acquire(t);
    for (std::size_t i = 0; i < batch.size(); ++i) {
      CAPTURE(l);
      CAPTURE(batch[i]);
      CHECK(test::view_holds_rows(L, view, static_cast<int>(i), *rows[i]));
    }
    cache.release(t);
  }
}

// Steps until one throws (its message), at most `steps` and the deadline; "" if none threw.
std::string step_until_error(std::mt19937_64& rng, Cache<cpu, float>& cache, std::span<const SeqId> batch,
                             std::span<test::RowMirror* const> rows, int steps, std::chrono::milliseconds pause = 0ms) {
  const auto deadline = Clock::now() + kDeadline;
  for (int s = 0; s < steps && Clock::now() < deadline; ++s) {
    try {
      step(rng, cache, batch, rows);
    } catch (const Error& e) {
      return e.what();
    }
    std::this_thread::sleep_for(pause);
  }
  return {};
}

std::vector<std::string> prefill_args(std::uint64_t seed, std::int64_t length, std::vector<std::string> more = {}) {
  std::vector<std::string> args{"--seed", std::to_string(seed), "--length", std::to_string(length)};
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

}  // namespace

TEST_SUITE("remote") {

// The failure must come within a bounded number of steps, each bounded by the read timeout; how
// long they took is printed, not asserted (a loaded machine is slow; a hang meets ctest's guard).
TEST_CASE("remote processes: a prefill process killed mid-decode fails its sequence and the other goes on") {
  OASISKV_SEEDED_RNG(rng);
  const CacheConfig config = test::peer::config();
  constexpr auto kReadTimeout = 2000ms;
  const std::uint64_t seed_a = rng(), seed_b = rng();
  Peer a(prefill_args(seed_a, 700)), b(prefill_args(seed_b, 500));
  Cache<cpu, float> decode(config);
  const Received ra = receive(a, kReadTimeout), rb = receive(b, kReadTimeout);
  test::RowMirror rows_a = prompt_mirror(config, seed_a, 700), rows_b = prompt_mirror(config, seed_b, 500);
  const SeqId A = 10, B = 20;
  admit(decode, A, ra, rows_a);
  admit(decode, B, rb, rows_b);
  const SeqId both[] = {A, B};
  test::RowMirror* const both_rows[] = {&rows_a, &rows_b};
  for (int s = 0; s < 5; ++s) step(rng, decode, both, both_rows);
  CHECK(ra.source->reads() > 0);
  a.kill();
  const auto killed = Clock::now();
  const std::string why = step_until_error(rng, decode, both, both_rows, 1000);
  const auto took = Clock::now() - killed;
  INFO("acquire failed ", std::chrono::duration_cast<std::chrono::milliseconds>(took).count(), " ms after the kill: ", why);
  REQUIRE_MESSAGE(!why.empty(), "no acquire failed after the prefill process was killed");
  CHECK(why.find("sequence 10 failed") != std::string::npos);
  CHECK(why.find(fmt::format("request {}", ra.message.request_id)) != std::string::npos);
  CHECK_FALSE(ra.connection->alive());
  decode.remove_sequence(A);
  // B goes on: planned again at every layer, every view holding its true rows.
  const std::size_t reads_before = rb.source->reads();
  const SeqId only[] = {B};
  test::RowMirror* const only_rows[] = {&rows_b};
  for (int s = 0; s < 15; ++s) step(rng, decode, only, only_rows);
  CHECK(rb.source->reads() > reads_before);
  CHECK(rb.connection->alive());
  CHECK_FALSE(decode.has_sequence(A));
}

TEST_CASE("remote processes: an admission message truncated or corrupted or of another shape is refused and admits nothing") {
  OASISKV_SEEDED_RNG(rng);
  const CacheConfig config = test::peer::config();
  struct Bad {
    const char* mode;
    const char* stage;  // which call refuses it
    const char* why;
  };
  for (const Bad bad : {Bad{"corrupt", "decode_admission", "checksum mismatch"},
                        Bad{"truncate", "decode_admission", "truncated"},
                        Bad{"other-shape", "admit", "is not the cache's"}}) {
    CAPTURE(bad.mode);
    Peer peer(prefill_args(rng(), 600, {"--mode", bad.mode}));
    Cache<cpu, float> decode(config);
    auto connection = connect(peer, 2s);
    const std::vector<std::byte> bytes = connection->receive_admission(kDeadline);
    std::string stage = "decode_admission", why;
    try {
      const AdmissionMessage m = decode_admission(bytes);
      stage = "admit";
      (void)decode.admit(5, m, connection->source(m));
      stage = "nothing";
    } catch (const Error& e) {
      why = e.what();
    }
    INFO(why);
    CHECK(stage == bad.stage);
    CHECK(why.find(bad.why) != std::string::npos);
    CHECK_FALSE(decode.has_sequence(5));
    CHECK(decode.num_sequences() == 0);
    CHECK(decode.statistics().host_blocks_in_use == 0);
    CHECK(connection->alive());  // a bad message fails its admission, not the connection
  }
}

TEST_CASE("remote processes: a read after the prefill process released the request fails with a clear Error") {
  OASISKV_SEEDED_RNG(rng);
  const CacheConfig config = test::peer::config();
  const std::uint64_t seed = rng();
  Peer peer(prefill_args(seed, 700, {"--revoke-after-ms", "300"}));
  Cache<cpu, float> decode(config);
  const Received r = receive(peer, 2s);
  test::RowMirror rows = prompt_mirror(config, seed, 700);
  admit(decode, 7, r, rows);
  const SeqId only[] = {7};
  test::RowMirror* const only_rows[] = {&rows};
  // Paced, so that the revoke comes mid-decode and well before max_tokens_per_sequence.
  const std::string why = step_until_error(rng, decode, only, only_rows, 1000, 5ms);
  INFO(why);
  REQUIRE_MESSAGE(!why.empty(), "no acquire failed after the revoke");
  CHECK(why.find("sequence 7 failed") != std::string::npos);
  CHECK(why.find(fmt::format("request {}: the prefill side released it", r.message.request_id)) != std::string::npos);
  CHECK(r.source->reads() > 0);
  CHECK(r.connection->alive());  // the revoke fails that request only
  // The decode side acknowledged the revoke as it progressed: the prefill process freed it.
  CHECK(peer.read_line(kDeadline, [&] { r.connection->progress(); }) == "freed");
  decode.remove_sequence(7);
}

TEST_CASE("remote processes: the decode side releasing or exiting frees the request in the prefill process") {
  OASISKV_SEEDED_RNG(rng);
  const CacheConfig config = test::peer::config();
  const std::uint64_t seed = rng();
  Peer peer(prefill_args(seed, 600, {"--exit-after-release"}));
  // Admits, decodes a few steps (remote reads included), and leaves the cache holding the source.
  const auto decode_some = [&](Cache<cpu, float>& decode, Received& r) {
    test::RowMirror rows = prompt_mirror(config, seed, 600);
    admit(decode, 7, r, rows);
    const SeqId only[] = {7};
    test::RowMirror* const only_rows[] = {&rows};
    for (int s = 0; s < 5; ++s) step(rng, decode, only, only_rows);
    r.source.reset();  // the cache holds the only reference
  };
  SUBCASE("the sequence removed") {
    Cache<cpu, float> decode(config);
    Received r = receive(peer, 2s);
    decode_some(decode, r);
    decode.remove_sequence(7);  // drops the source: its release frees the request
    CHECK(peer.read_line(kDeadline, [&] { r.connection->progress(); }) == "freed");
    CHECK(peer.wait_exit(kDeadline) == 0);
  }
  SUBCASE("the decode side's cache and connection destroyed without a remove (an exit)") {
    {
      Cache<cpu, float> decode(config);
      Received r = receive(peer, 2s);
      decode_some(decode, r);
    }
    CHECK(peer.read_line(kDeadline) == "freed");
    CHECK(peer.wait_exit(kDeadline) == 0);
  }
  SUBCASE("a decode process killed") {
    Peer client({"--mode", "client", "--port", std::to_string(peer.port())}, false);
    REQUIRE(client.read_line(kDeadline) == "admitted");
    client.kill();  // no release: the prefill process sees its connection fail
    CHECK(peer.read_line(kDeadline) == "freed");
    CHECK(peer.wait_exit(kDeadline) == 0);
  }
}

}  // TEST_SUITE
