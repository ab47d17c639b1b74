// The remote tier's UCX transport on loopback (oasiskv/ucx/transport.hpp): a "prefill" thread
// registers random memory and progresses its worker; the reader connects, unpacks the key and
// reads random blocks, which must equal the exported bytes. Faults: a peer that stops progressing
// and a peer that goes away make the read fail with an Error (the deadline bounds it), never hang.
#include <oasiskv/ucx/transport.hpp>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <future>
#include <thread>

#include "support.hpp"

using namespace oasiskv;

namespace {

// tcp unless the user chose transports: it works on every machine (loopback, namespaces).
const bool kTransportChosen = [] {
  (void)::setenv("UCX_TLS", "tcp", 0);
  return true;
}();

struct Exported {
  std::uint16_t port = 0;
  std::uint64_t base = 0;
  std::vector<std::byte> key;
};

// The exporting side on its own thread: registers `memory`, accepts connections, progresses
// until told to stall (alive, not progressing) or to exit (everything closed: the peer is gone).
class Exporter {
 public:
  explicit Exporter(std::vector<std::byte>& memory) : memory_(memory), thread_([this] { run(); }) {}
  ~Exporter() {
    exit_ = true;
    thread_.join();
  }
  Exported info() { return ready_.get_future().get(); }
  // Returns once the exporter thread is stalled: no progress call of its can still serve a read.
  void stall(bool on) {
    stall_ = on;
    while (on && !stalled_) std::this_thread::yield();
  }
  void exit_now() {
    exit_ = true;
    thread_.join();
    thread_ = std::thread([] {});
  }

 private:
  void run() {
    ucx::Context context;
    ucx::Worker worker(context);
    ucx::Listener listener(worker, "127.0.0.1", 0);
    ucx::Registration registration(context, memory_.data(), memory_.size());
    ready_.set_value(Exported{listener.port(), registration.base(), registration.packed_key()});
    std::vector<ucx::Endpoint> endpoints;
    while (!exit_) {
      if (stall_) {
        stalled_ = true;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        continue;
      }
      worker.progress();
      for (auto& e : listener.accept()) endpoints.push_back(std::move(e));
    }
  }
  std::vector<std::byte>& memory_;
  std::promise<Exported> ready_;
  std::atomic<bool> stall_{false}, stalled_{false}, exit_{false};
  std::thread thread_;
};

std::vector<std::byte> random_bytes(std::mt19937_64& rng, std::size_t n) {
  std::vector<std::byte> out(n);
  for (auto& b : out) b = static_cast<std::byte>(rng());
  return out;
}

// The reading side, connected to an exporter.
struct ReaderSide {
  explicit ReaderSide(const Exported& e)
      : worker(context), endpoint(ucx::Endpoint::connect(worker, "127.0.0.1", e.port)), key(endpoint, e.key) {}
  ucx::Context context;
  ucx::Worker worker;
  ucx::Endpoint endpoint;
  ucx::RemoteKey key;  // after the endpoint: destroyed first
};

}  // namespace

TEST_SUITE("remote") {

TEST_CASE("ucx: random remote block reads over loopback equal the exported bytes") {
  OASISKV_SEEDED_RNG(rng);
  constexpr std::size_t kBlock = 4096;
  std::vector<std::byte> memory = random_bytes(rng, 256 * kBlock);
  Exporter exporter(memory);
  const Exported e = exporter.info();
  ReaderSide side(e);
  auto& endpoint = side.endpoint;
  const auto& key = side.key;
  std::vector<std::byte> local(64 * kBlock);
  for (int round = 0; round < 20; ++round) {
    std::vector<ucx::RemoteRead> reads;
    std::vector<std::size_t> source;
    const auto n = std::uniform_int_distribution<std::size_t>(1, 64)(rng);
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t b = std::uniform_int_distribution<std::size_t>(0, 255)(rng);
      const std::size_t bytes = std::uniform_int_distribution<std::size_t>(1, kBlock)(rng);
      source.push_back(b);
      reads.push_back({local.data() + i * kBlock, e.base + b * kBlock, bytes});
    }
    std::fill(local.begin(), local.end(), std::byte{0});
    ucx::read(endpoint, key, reads, std::chrono::seconds(20));
    for (std::size_t i = 0; i < n; ++i) {
      CAPTURE(i);
      REQUIRE(std::memcmp(local.data() + i * kBlock, memory.data() + source[i] * kBlock, reads[i].bytes) == 0);
    }
  }
  CHECK(endpoint.status() == UCS_OK);
}

TEST_CASE("ucx: a peer that stops progressing or goes away fails the read with an Error") {
  OASISKV_SEEDED_RNG(rng);
  std::vector<std::byte> memory = random_bytes(rng, 64 * 1024);
  Exporter exporter(memory);
  const Exported e = exporter.info();
  ReaderSide side(e);
  auto& endpoint = side.endpoint;
  const auto& key = side.key;
  std::vector<std::byte> local(memory.size());
  const ucx::RemoteRead all{local.data(), e.base, memory.size()};
  ucx::read(endpoint, key, std::span(&all, 1), std::chrono::seconds(20));
  CHECK(std::memcmp(local.data(), memory.data(), memory.size()) == 0);

  SUBCASE("stalled") {
    exporter.stall(true);
    CHECK_THROWS_WITH_AS(ucx::read(endpoint, key, std::span(&all, 1), std::chrono::milliseconds(300)),
                         doctest::Contains("timed out after 300 ms"), Error);
    CHECK(endpoint.get() == nullptr);  // closed: the reads in flight completed before the throw
    CHECK_THROWS_WITH_AS(ucx::read(endpoint, key, std::span(&all, 1), std::chrono::milliseconds(300)),
                         doctest::Contains("closed endpoint"), Error);
    // Known limitation, not yet handled: over tcp, UCX 1.13 emulates get with active messages, and
    // an exporter that resumes progress after the reader force-closed with a get outstanding aborts
    // in ucp_get_req_handler ("unexpected error: Endpoint timeout"). The exporter exits stalled.
    exporter.exit_now();
  }
  SUBCASE("gone") {
    exporter.exit_now();
    CHECK_THROWS_AS(ucx::read(endpoint, key, std::span(&all, 1), std::chrono::seconds(5)), Error);
  }
}

TEST_CASE("ucx: bad addresses and keys are refused") {
  ucx::Context context;
  ucx::Worker worker(context);
  CHECK_THROWS_WITH_AS(ucx::Endpoint::connect(worker, "not-an-ip", 1), doctest::Contains("'not-an-ip' is not an IPv4 address"), Error);
  int x = 0;
  CHECK_THROWS_WITH_AS(ucx::Registration(context, &x, 0), doctest::Contains("cannot register an empty region"), Error);
}

}  // TEST_SUITE
