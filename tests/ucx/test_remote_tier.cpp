// The remote tier on loopback (oasiskv/ucx/remote_tier.hpp): a PrefillServer on its own thread
// (progressing in a loop, running the test's calls between passes) exports requests and sends
// their admission messages; the decode side connects, receives, reads through the sources and
// releases. Lifetimes: release, a decode side gone, a revoke, a prefill side gone; each fault
// is an Error for the affected request or connection only, within the read timeout.
#include <oasiskv/ucx/remote_tier.hpp>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <future>
#include <mutex>
#include <thread>

#include "support.hpp"

using namespace oasiskv;
using namespace std::chrono_literals;

namespace {

const bool kTransportChosen = [] {
  (void)::setenv("UCX_TLS", "tcp", 0);  // as test_transport.cpp: works on every machine
  return true;
}();

constexpr auto kDeadline = 20s;

// The prefill process: the server lives on its own thread; call() runs f(server) there.
class ServerThread {
 public:
  ServerThread() : thread_([this] { run(); }) { port_ = ready_.get_future().get(); }
  ~ServerThread() { stop(); }
  std::uint16_t port() const { return port_; }

  template <class F>
  auto call(F f) -> std::future<decltype(f(std::declval<ucx::PrefillServer&>()))> {
    using R = decltype(f(std::declval<ucx::PrefillServer&>()));
    auto task = std::make_shared<std::packaged_task<R(ucx::PrefillServer&)>>(std::move(f));
    auto future = task->get_future();
    const std::lock_guard lock(mutex_);
    tasks_.push_back([task](ucx::PrefillServer& s) { (*task)(s); });
    return future;
  }
  // Everything destroyed: to its peers the prefill process is gone.
  void stop() {
    exit_ = true;
    if (thread_.joinable()) thread_.join();
  }

  // Polls until `pred(server)` or the deadline; returns the last value of pred.
  bool wait_for(std::function<bool(ucx::PrefillServer&)> pred, const std::function<void()>& meanwhile = [] {}) {
    const auto deadline = std::chrono::steady_clock::now() + kDeadline;
    while (std::chrono::steady_clock::now() < deadline) {
      if (call(pred).get()) return true;
      meanwhile();
      std::this_thread::sleep_for(1ms);
    }
    return false;
  }
  // The id of the newest connected peer once `n` are connected.
  std::uint64_t peer(std::size_t n) {
    std::uint64_t id = 0;
    REQUIRE(wait_for([&](ucx::PrefillServer& s) {
      const auto peers = s.progress();
      if (peers.size() == n) id = peers.back();
      return peers.size() == n;
    }));
    return id;
  }

 private:
  void run() {
    ucx::PrefillServer server("127.0.0.1", 0);
    ready_.set_value(server.port());
    while (!exit_) {
      server.progress();
      std::vector<std::function<void(ucx::PrefillServer&)>> tasks;
      {
        const std::lock_guard lock(mutex_);
        tasks.swap(tasks_);
      }
      for (auto& t : tasks) t(server);
    }
  }
  std::promise<std::uint16_t> ready_;
  std::uint16_t port_ = 0;
  std::mutex mutex_;
  std::vector<std::function<void(ucx::PrefillServer&)>> tasks_;
  std::atomic<bool> exit_{false};
  std::thread thread_;
};

// A request of `blocks` pool blocks with random rows, and its admission message (all but the
// remote fields, which export_request fills).
struct Request {
  ModelShape shape{2, 4, 2, 16};
  int block_tokens = 16;
  std::vector<std::vector<std::byte>> blocks;
  AdmissionMessage message;
  std::size_t block_bytes() const {
    return static_cast<std::size_t>(shape.num_layers) * shape.num_kv_heads * 2 * block_tokens * shape.head_dim * 4;
  }
};

Request make_request(std::mt19937_64& rng, int blocks, int working_set) {
  Request r;
  AdmissionMessage& m = r.message;
  m.shape = r.shape;
  m.block_tokens = r.block_tokens;
  m.length = static_cast<std::int64_t>(blocks) * r.block_tokens - 3;
  const std::size_t heads = static_cast<std::size_t>(r.shape.num_layers) * r.shape.num_kv_heads;
  m.summaries = test::random_summaries(rng, heads * static_cast<std::size_t>(blocks), r.shape.head_dim);
  for (std::size_t p = 0; p < heads; ++p) {
    m.working_set_counts.push_back(working_set);
    for (int b = 0; b < working_set; ++b) m.working_set_blocks.push_back(b);
  }
  const auto rows = test::random_rows<float>(rng, heads * working_set * 2 * r.block_tokens * r.shape.head_dim);
  m.working_set_rows.resize(rows.size() * sizeof(float));  // finite: a message of NaN rows is refused
  if (!rows.empty()) std::memcpy(m.working_set_rows.data(), rows.data(), m.working_set_rows.size());
  m.lookahead_queries = test::random_rows<float>(rng, r.shape.num_layers * r.shape.num_q_heads * r.shape.head_dim);
  r.blocks.resize(blocks);
  for (auto& block : r.blocks) {
    block.resize(r.block_bytes());
    for (auto& b : block) b = static_cast<std::byte>(rng());
  }
  return r;
}

// Exports the request on the server (fills its message) and returns the request id.
std::uint64_t export_on(ServerThread& server, Request& r) {
  return server
      .call([&](ucx::PrefillServer& s) {
        std::vector<const void*> blocks;
        for (const auto& b : r.blocks) blocks.push_back(b.data());
        s.export_request(blocks, r.block_bytes(), r.message);
        return r.message.request_id;
      })
      .get();
}

// Sends the request's admission to `peer` while `connection` receives it (a rendezvous send
// needs both sides progressing); returns the decoded message.
AdmissionMessage deliver(ServerThread& server, std::uint64_t peer, const Request& r, ucx::PrefillConnection& connection) {
  auto sent = server.call([&](ucx::PrefillServer& s) { s.send_admission(peer, r.message); });
  const std::vector<std::byte> bytes = connection.receive_admission(kDeadline);
  sent.get();
  return decode_admission(bytes);
}

std::shared_ptr<ucx::PrefillConnection> connect(const ServerThread& server, std::chrono::milliseconds read_timeout = 5s) {
  return ucx::PrefillConnection::connect("127.0.0.1", server.port(), 5s, read_timeout);
}

// Reads `n` random ranges of the request through `source` and checks them against its blocks.
void check_reads(std::mt19937_64& rng, RemoteBlockSource& source, const AdmissionMessage& m, const Request& r, int n) {
  const std::size_t bb = r.block_bytes();
  std::vector<std::byte> local(static_cast<std::size_t>(n) * bb);
  std::vector<RemoteBlockRead> reads;
  std::vector<std::pair<std::size_t, std::size_t>> where;  // block, offset
  for (int i = 0; i < n; ++i) {
    const std::size_t b = std::uniform_int_distribution<std::size_t>(0, r.blocks.size() - 1)(rng);
    const std::size_t offset = std::uniform_int_distribution<std::size_t>(0, bb - 1)(rng);
    const std::size_t bytes = std::uniform_int_distribution<std::size_t>(1, bb - offset)(rng);
    reads.push_back({local.data() + i * bb, m.block_addresses[b] + offset, bytes});
    where.emplace_back(b, offset);
  }
  source.read(reads);
  for (int i = 0; i < n; ++i) {
    CAPTURE(i);
    REQUIRE(std::memcmp(local.data() + i * bb, r.blocks[where[i].first].data() + where[i].second, reads[i].bytes) == 0);
  }
}

std::size_t live(ServerThread& server) {
  return server.call([](ucx::PrefillServer& s) { return s.live_requests(); }).get();
}

}  // namespace

TEST_SUITE("remote") {

TEST_CASE("remote tier: the admission arrives intact and random reads equal the exported blocks") {
  OASISKV_SEEDED_RNG(rng);
  ServerThread server;
  auto connection = connect(server);
  const std::uint64_t peer = server.peer(1);
  // Small: an eager active message. Large (about 1 MiB of working-set rows): a rendezvous.
  // Over tcp, UCX 1.13 sends a 3 KB admission eagerly; 11 KB and up arrive by rendezvous.
  int blocks = 4, working_set = 0;
  SUBCASE("eager") {}
  SUBCASE("rendezvous") { blocks = working_set = 64; }  // about 0.5 MiB
  CAPTURE(blocks);
  Request r = make_request(rng, blocks, working_set);
  const std::uint64_t id = export_on(server, r);
  CHECK(id >= 1);
  const AdmissionMessage m = deliver(server, peer, r, *connection);
  CHECK(m.request_id == id);
  CHECK(m.length == r.message.length);
  CHECK(m.summaries == r.message.summaries);
  CHECK(m.working_set_counts == r.message.working_set_counts);
  CHECK(m.working_set_blocks == r.message.working_set_blocks);
  CHECK(m.working_set_rows == r.message.working_set_rows);
  CHECK(m.lookahead_queries == r.message.lookahead_queries);
  CHECK(m.block_addresses == r.message.block_addresses);
  CHECK(m.region_base == r.message.region_base);
  CHECK(m.region_bytes == r.blocks.size() * r.block_bytes());
  CHECK(m.region_base % 4096 == 0);
  CHECK(m.packed_rkey == r.message.packed_rkey);
  auto source = connection->source(m);
  CHECK_THROWS_WITH_AS(connection->source(m), doctest::Contains("already has a source"), Error);
  for (int round = 0; round < 10; ++round) check_reads(rng, *source, m, r, 16);
  CHECK(connection->alive());
}

TEST_CASE("remote tier: destroying the source releases the request on the prefill side") {
  OASISKV_SEEDED_RNG(rng);
  ServerThread server;
  auto connection = connect(server);
  const std::uint64_t peer = server.peer(1);
  Request a = make_request(rng, 8, 1), b = make_request(rng, 5, 1);
  export_on(server, a);
  export_on(server, b);
  CHECK(a.message.request_id != b.message.request_id);
  CHECK(server.call([](ucx::PrefillServer& s) { return s.live_bytes(); }).get() ==
        (a.blocks.size() + b.blocks.size()) * a.block_bytes());
  const AdmissionMessage m = deliver(server, peer, a, *connection);
  auto source = connection->source(m);
  check_reads(rng, *source, m, a, 4);
  source.reset();
  CHECK(server.wait_for([](ucx::PrefillServer& s) { return s.live_requests() == 1; }, [&] { connection->progress(); }));
  // A request never sent to a peer is freed by revoke right away.
  server.call([&](ucx::PrefillServer& s) { s.revoke(b.message.request_id); }).get();
  CHECK(live(server) == 0);
  CHECK(server.call([](ucx::PrefillServer& s) { return s.live_bytes(); }).get() == 0);
  CHECK_THROWS_WITH_AS(server.call([](ucx::PrefillServer& s) { s.revoke(99); }).get(),
                       doctest::Contains("request 99"), Error);
}

TEST_CASE("remote tier: a decode side gone frees its requests only") {
  OASISKV_SEEDED_RNG(rng);
  ServerThread server;
  auto first = connect(server);
  const std::uint64_t first_peer = server.peer(1);
  auto second = connect(server);
  const std::uint64_t second_peer = server.peer(2);
  Request a = make_request(rng, 6, 1), b = make_request(rng, 7, 1);
  export_on(server, a);
  export_on(server, b);
  (void)deliver(server, first_peer, a, *first);  // received, no source: only the connection holds it
  const AdmissionMessage mb = deliver(server, second_peer, b, *second);
  auto source = second->source(mb);
  CHECK(live(server) == 2);
  first.reset();  // the decode process exits: its endpoint closes
  CHECK(server.wait_for([](ucx::PrefillServer& s) { return s.live_requests() == 1; }));
  CHECK(server.call([](ucx::PrefillServer& s) { return s.progress().size(); }).get() == 1);
  check_reads(rng, *source, mb, b, 8);
  CHECK_THROWS_WITH_AS(server.call([&](ucx::PrefillServer& s) { s.send_admission(first_peer, a.message); }).get(),
                       doctest::Contains("not connected"), Error);
}

TEST_CASE("remote tier: after a revoke reads fail with an Error naming the request") {
  OASISKV_SEEDED_RNG(rng);
  ServerThread server;
  auto connection = connect(server);
  const std::uint64_t peer = server.peer(1);
  Request r = make_request(rng, 8, 2);
  const std::uint64_t id = export_on(server, r);
  const AdmissionMessage m = deliver(server, peer, r, *connection);
  auto source = connection->source(m);
  check_reads(rng, *source, m, r, 4);
  server.call([&](ucx::PrefillServer& s) { s.revoke(id); }).get();
  // Freed once the decode side acknowledged, which it does as it progresses.
  CHECK(server.wait_for([](ucx::PrefillServer& s) { return s.live_requests() == 0; }, [&] { connection->progress(); }));
  std::vector<std::byte> local(16);
  const RemoteBlockRead read{local.data(), m.block_addresses[0], local.size()};
  CHECK_THROWS_WITH_AS(source->read(std::span(&read, 1)),
                       doctest::Contains(fmt::format("request {}: the prefill side released it", id).c_str()), Error);
  CHECK(connection->alive());  // the connection is untouched
}

// No wall-clock bound is asserted (a loaded machine is slow): a read that did not give up when the
// peer is gone would hang, and ctest's hang guard fails it.
TEST_CASE("remote tier: a prefill side gone fails reads with an Error instead of waiting for it") {
  OASISKV_SEEDED_RNG(rng);
  ServerThread server;
  constexpr auto kReadTimeout = 1000ms;
  auto connection = connect(server, kReadTimeout);
  const std::uint64_t peer = server.peer(1);
  Request r = make_request(rng, 8, 1);
  const AdmissionMessage m = (export_on(server, r), deliver(server, peer, r, *connection));
  auto source = connection->source(m);
  check_reads(rng, *source, m, r, 4);
  server.stop();
  std::vector<std::byte> local(r.block_bytes());
  const RemoteBlockRead read{local.data(), m.block_addresses[1], local.size()};
  CHECK_THROWS_WITH_AS(source->read(std::span(&read, 1)), doctest::Contains(fmt::format("request {}", m.request_id).c_str()),
                       Error);
  CHECK_FALSE(connection->alive());
  CHECK_THROWS_AS(connection->receive_admission(100ms), Error);
  source.reset();  // no release to send: must not throw or hang
}

TEST_CASE("remote tier: a read outside the request's region is refused naming the address") {
  OASISKV_SEEDED_RNG(rng);
  ServerThread server;
  auto connection = connect(server);
  const std::uint64_t peer = server.peer(1);
  Request r = make_request(rng, 4, 1);
  const AdmissionMessage m = (export_on(server, r), deliver(server, peer, r, *connection));
  auto source = connection->source(m);
  std::vector<std::byte> local(64);
  const std::uint64_t end = m.region_base + m.region_bytes;
  for (const std::uint64_t remote : {end - 32, m.region_base - 8, end + 4096}) {
    CAPTURE(remote);
    const RemoteBlockRead read{local.data(), remote, local.size()};
    CHECK_THROWS_WITH_AS(source->read(std::span(&read, 1)), doctest::Contains(fmt::format("{:#x}", remote).c_str()), Error);
  }
  CHECK(connection->alive());  // refused before any UCX call: the connection still reads
  check_reads(rng, *source, m, r, 4);
}

TEST_CASE("remote tier: with two prefill servers one gone leaves the other's reads working") {
  OASISKV_SEEDED_RNG(rng);
  ServerThread left, right;
  auto to_left = connect(left, 1000ms), to_right = connect(right, 1000ms);
  const std::uint64_t left_peer = left.peer(1), right_peer = right.peer(1);
  Request a = make_request(rng, 6, 1), b = make_request(rng, 6, 1);
  const AdmissionMessage ma = (export_on(left, a), deliver(left, left_peer, a, *to_left));
  const AdmissionMessage mb = (export_on(right, b), deliver(right, right_peer, b, *to_right));
  auto source_a = to_left->source(ma), source_b = to_right->source(mb);
  check_reads(rng, *source_a, ma, a, 4);
  left.stop();
  std::vector<std::byte> local(64);
  const RemoteBlockRead read{local.data(), ma.block_addresses[0], local.size()};
  CHECK_THROWS_AS(source_a->read(std::span(&read, 1)), Error);
  for (int round = 0; round < 5; ++round) check_reads(rng, *source_b, mb, b, 8);
  CHECK(to_right->alive());
  source_b.reset();
  CHECK(right.wait_for([](ucx::PrefillServer& s) { return s.live_requests() == 0; }, [&] { to_right->progress(); }));
}

TEST_CASE("remote tier: connecting where no server listens fails with an Error naming the address") {
  std::uint16_t port = 0;
  {
    ServerThread gone;
    port = gone.port();
  }
  CHECK_THROWS_WITH_AS(ucx::PrefillConnection::connect("127.0.0.1", port, 3s, 1s),
                       doctest::Contains(fmt::format("127.0.0.1:{}", port).c_str()), Error);
}

}  // TEST_SUITE
