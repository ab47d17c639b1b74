// The acceptance test of the remote tier: check_remote_decode (tests/remote_decode.hpp) with the
// prefill cache's blocks exported by a PrefillServer and read over UCX, the admission message
// itself delivered over UCX. Every acquired view must equal the single-process twin's rows.
#include <oasiskv/ucx/remote_tier.hpp>

#include <atomic>
#include <cstdlib>
#include <future>
#include <mutex>
#include <string>
#include <thread>

#include "remote_decode.hpp"
#include "remote_peer_config.hpp"
#include "support.hpp"

using namespace oasiskv;
using namespace std::chrono_literals;

namespace {

const bool kTransportChosen = [] {
  (void)::setenv("UCX_TLS", "tcp", 0);  // as test_remote_tier.cpp
  return true;
}();

constexpr auto kDeadline = 20s;

// The prefill process, on its own thread (a PrefillServer is used by one thread): exports the
// request, sends its admission to the first peer, then serves reads until stopped. Lives until
// the test's checks are done, outside check_remote_decode's lambda.
class Serving {
 public:
  ~Serving() { stop(); }
  void stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }

  // Called from the ExportFn: the prefill cache is only read while this waits for the port.
  std::uint16_t start(const Cache<cpu, float>& prefill, SeqId id, AdmissionMessage message) {
    std::promise<std::uint16_t> port;
    auto ready = port.get_future();
    thread_ = std::thread([this, &prefill, id, message = std::move(message), port = std::move(port)]() mutable {
      try {
        ucx::PrefillServer server("127.0.0.1", 0);
        server.export_request(host_blocks_of(prefill, id), prefill.host_tier().pool_block_bytes(), message);
        request_ = message.request_id;
        port.set_value(server.port());
        bool sent = false;
        while (!stop_) {
          const auto peers = server.progress(1ms);
          if (!sent && !peers.empty()) {
            server.send_admission(peers.front(), message);
            sent = true;
          }
          live_ = server.live_requests();
        }
      } catch (const std::exception& e) {
        const std::lock_guard lock(mutex_);
        error_ = e.what();
        try {
          port.set_exception(std::current_exception());
        } catch (const std::future_error&) {  // the port was already handed back
        }
      }
    });
    REQUIRE(ready.wait_for(kDeadline) == std::future_status::ready);
    return ready.get();
  }
  std::size_t live() const { return live_; }
  std::uint64_t request() const { return request_; }
  std::string error() const {
    const std::lock_guard lock(mutex_);
    return error_;
  }

 private:
  std::atomic<bool> stop_{false};
  std::atomic<std::size_t> live_{1};
  std::atomic<std::uint64_t> request_{0};
  mutable std::mutex mutex_;
  std::string error_;
  std::thread thread_;
};

}  // namespace

TEST_SUITE("remote") {

TEST_CASE("remote decode over UCX: every acquired view of a remote-backed sequence equals the prefill side's rows") {
  OASISKV_SEEDED_RNG(rng);
  CacheConfig config = test::small_config(128, 2048, 3);
  config.fetch_ratio = 0.25;  // as test_remote_admission.cpp's remote_config()
  for (std::int64_t prompt : {40, 300, 777}) {
    CAPTURE(prompt);
    Serving serving;
    std::shared_ptr<ucx::PrefillConnection> connection;
    std::shared_ptr<test::peer::CountingSource> counting;
    const auto result = test::check_remote_decode(
        rng, config, prompt, 60, [&](const Cache<cpu, float>& prefill, SeqId id, AdmissionMessage& message) {
          const std::uint16_t port = serving.start(prefill, id, message);
          connection = ucx::PrefillConnection::connect("127.0.0.1", port, 5s, 5s);
          // What the cache admits is what travelled: the received bytes, decoded.
          message = decode_admission(connection->receive_admission(kDeadline));
          REQUIRE(message.request_id == serving.request());
          counting = std::make_shared<test::peer::CountingSource>(connection->source(message));
          return counting;
        });
    CHECK(serving.error().empty());
    CHECK(result.steps == 60);
    if (prompt > 300) {
      CHECK(result.decode_host_bytes < result.prefill_host_bytes / 2);
      CHECK(counting->reads() > 0);  // the later plans read remote blocks, over UCX
      CHECK(result.remote_blocks_fetched == counting->reads());  // statistics count every block read
    }
    // The decode cache is gone, and the source with it: its release frees the request (the
    // connection is still up, so this is the release, not a failed peer).
    counting.reset();
    const auto deadline = std::chrono::steady_clock::now() + kDeadline;
    while (serving.live() != 0 && std::chrono::steady_clock::now() < deadline) {
      connection->progress();
      std::this_thread::sleep_for(1ms);
    }
    CHECK(serving.live() == 0);
    CHECK(connection->alive());
    CHECK(serving.error().empty());
  }
}

}  // TEST_SUITE
