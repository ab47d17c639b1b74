#include "oasiskv/ucx/remote_tier.hpp"

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <utility>

#include "oasiskv/error.hpp"
#include "oasiskv/ucx/transport.hpp"

namespace oasiskv {
inline namespace v0 {
namespace ucx {
namespace {

using Clock = std::chrono::steady_clock;

// Active message ids (remote_tier.hpp). Ids 2..4 carry a u64 request id as their header.
enum : unsigned { kAdmission = 1, kRelease = 2, kRevoked = 3, kRevokeAck = 4 };

// Bounds send_admission's wait: a rendezvous send needs the peer to progress.
constexpr auto kSendTimeout = std::chrono::seconds(30);

std::uint64_t header_id(const void* header, std::size_t length) {
  std::uint64_t id = 0;
  if (length == sizeof(id)) std::memcpy(&id, header, sizeof(id));
  return id;  // 0 is no request: ignored
}

// Small control messages in flight. UCX 1.13 has no "copy header" flag, so the header (the u64
// id) lives here, in a stable list node, until the send completes.
struct Sends {
  struct Send {
    std::uint64_t id;
    void* request;
  };
  std::list<Send> inflight;

  // Posts `am` with header `id`; false if UCX refused it at once.
  bool post(ucp_ep_h ep, unsigned am, std::uint64_t id) {
    Send& s = inflight.emplace_back(Send{id, nullptr});
    ucp_request_param_t p{};
    void* r = ucp_am_send_nbx(ep, am, &s.id, sizeof(s.id), nullptr, 0, &p);
    if (r == nullptr || UCS_PTR_IS_ERR(r)) inflight.pop_back();
    else s.request = r;
    return !UCS_PTR_IS_ERR(r);
  }
  void reap() {
    for (auto it = inflight.begin(); it != inflight.end();) {
      if (ucp_request_check_status(it->request) == UCS_INPROGRESS) { ++it; continue; }
      ucp_request_free(it->request);
      it = inflight.erase(it);
    }
  }
  // After the endpoints closed (which completes every send on them).
  void drop() noexcept {
    for (Send& s : inflight) ucp_request_free(s.request);
    inflight.clear();
  }
};

}  // namespace

// ---- prefill side ----------------------------------------------------------------------------

struct PrefillServer::State {
  struct Request {
    std::uint64_t peer = 0;  // 0: not sent to a peer yet
    bool revoking = false;
    std::unique_ptr<std::byte, decltype(&std::free)> buffer{nullptr, &std::free};
    std::unique_ptr<Registration> registration;  // after buffer: deregistered before it is freed
    std::size_t bytes = 0;
  };

  State(const std::string& ip, std::uint16_t port) : worker(context), listener(worker, ip, port) {
    set_am_handler(worker, kRelease, &on_done, this);
    set_am_handler(worker, kRevokeAck, &on_done, this);
  }
  ~State() {
    peers.clear();  // closes every endpoint: completes their sends
    sends.drop();
    requests.clear();
  }

  // A release or a revoke acknowledged: either way the request is done. Freed after progress
  // returns, not inside UCX's callback.
  static ucs_status_t on_done(void* arg, const void* header, std::size_t header_length, void*, std::size_t,
                              const ucp_am_recv_param_t*) {
    static_cast<State*>(arg)->done.push_back(header_id(header, header_length));
    return UCS_OK;
  }

  void free_request(std::uint64_t id) {
    const auto it = requests.find(id);
    if (it == requests.end()) return;  // already freed (a release and an ack can both arrive)
    live_bytes -= it->second.bytes;
    requests.erase(it);
  }

  void pass() {
    worker.progress();
    for (Endpoint& e : listener.accept()) peers.emplace(next_peer++, std::move(e));
    std::vector<std::uint64_t> ids;
    ids.swap(done);
    for (std::uint64_t id : ids) free_request(id);
    sends.reap();
    // A failed peer (its process exited or was killed) frees everything it held.
    for (auto p = peers.begin(); p != peers.end();) {
      if (p->second.status() == UCS_OK) { ++p; continue; }
      std::erase_if(requests, [&](const auto& r) {
        if (r.second.peer == p->first) live_bytes -= r.second.bytes;
        return r.second.peer == p->first;
      });
      p = peers.erase(p);
    }
  }

  Context context;
  Worker worker;
  Listener listener;
  std::map<std::uint64_t, Request> requests;
  std::map<std::uint64_t, Endpoint> peers;
  Sends sends;
  std::vector<std::uint64_t> done;
  std::uint64_t next_request = 1, next_peer = 1;
  std::size_t live_bytes = 0;
};

PrefillServer::PrefillServer(const std::string& ip, std::uint16_t port) {
  try {
    state_ = std::make_unique<State>(ip, port);
  } catch (const Error& e) {
    fail("PrefillServer: cannot listen on {}:{}: {}", ip, port, e.what());
  }
}
PrefillServer::~PrefillServer() = default;
std::uint16_t PrefillServer::port() const noexcept { return state_->listener.port(); }
std::size_t PrefillServer::live_requests() const noexcept { return state_->requests.size(); }
std::size_t PrefillServer::live_bytes() const noexcept { return state_->live_bytes; }

void PrefillServer::export_request(std::span<const void* const> blocks, std::size_t block_bytes,
                                   AdmissionMessage& message) {
  if (blocks.empty()) fail("export_request: no blocks to export");
  if (block_bytes == 0) fail("export_request: block_bytes must be positive");
  if (block_bytes > std::numeric_limits<std::size_t>::max() / 2 / blocks.size()) {
    fail("export_request: {} blocks of {} bytes overflow", blocks.size(), block_bytes);
  }
  for (std::size_t b = 0; b < blocks.size(); ++b) {
    if (blocks[b] == nullptr) fail("export_request: block {} is null", b);
  }
  const std::size_t bytes = blocks.size() * block_bytes;
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  State::Request r;
  r.buffer.reset(static_cast<std::byte*>(std::aligned_alloc(page, (bytes + page - 1) / page * page)));
  if (!r.buffer) fail("export_request: cannot allocate {} bytes", bytes);
  for (std::size_t b = 0; b < blocks.size(); ++b) std::memcpy(r.buffer.get() + b * block_bytes, blocks[b], block_bytes);
  r.registration = std::make_unique<Registration>(state_->context, r.buffer.get(), bytes);
  r.bytes = bytes;
  std::vector<std::byte> key = r.registration->packed_key();

  const std::uint64_t base = r.registration->base();
  message.request_id = state_->next_request++;
  message.block_addresses.resize(blocks.size());
  for (std::size_t b = 0; b < blocks.size(); ++b) message.block_addresses[b] = base + b * block_bytes;
  message.region_base = base;
  message.region_bytes = bytes;
  message.packed_rkey = std::move(key);
  state_->requests.emplace(message.request_id, std::move(r));
  state_->live_bytes += bytes;
}

std::vector<std::uint64_t> PrefillServer::progress(std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  do state_->pass();
  while (Clock::now() < deadline);
  std::vector<std::uint64_t> out;
  for (const auto& [id, e] : state_->peers) out.push_back(id);  // pass() dropped the failed ones
  return out;
}

void PrefillServer::send_admission(std::uint64_t peer, const AdmissionMessage& message) {
  State& s = *state_;
  const auto p = s.peers.find(peer);
  if (p == s.peers.end() || p->second.status() != UCS_OK) fail("send_admission: peer {} is not connected", peer);
  const auto r = s.requests.find(message.request_id);
  if (r == s.requests.end()) fail("send_admission: request {} is not held by this server", message.request_id);
  if (r->second.peer != 0) fail("send_admission: request {} was already sent to peer {}", message.request_id, r->second.peer);
  if (r->second.revoking) fail("send_admission: request {} is being revoked", message.request_id);
  const std::vector<std::byte> bytes = encode_admission(message);
  // Bound first: the peer may release it before this send's completion is seen.
  r->second.peer = peer;
  try {
    send_admission_bytes(peer, bytes);
  } catch (const Error& e) {
    // Not delivered: the request stays held, unbound (revoke frees it, or send it elsewhere).
    if (const auto again = s.requests.find(message.request_id); again != s.requests.end()) again->second.peer = 0;
    fail("send_admission of request {} to peer {} failed: {}", message.request_id, peer, e.what());
  }
}

void PrefillServer::send_admission_bytes(std::uint64_t peer, std::span<const std::byte> bytes) {
  State& s = *state_;
  const auto p = s.peers.find(peer);
  if (p == s.peers.end() || p->second.status() != UCS_OK) fail("send_admission_bytes: peer {} is not connected", peer);
  ucp_request_param_t params{};
  void* request = ucp_am_send_nbx(p->second.get(), kAdmission, nullptr, 0, bytes.data(), bytes.size(), &params);
  const std::optional<ucs_status_t> done = wait(s.worker, request, Clock::now() + kSendTimeout);
  if (!done) {
    p->second.close();  // completes the send (with an error); the peer is dropped as failed
    ucp_request_free(request);
  }
  const ucs_status_t status = done.value_or(UCS_ERR_TIMED_OUT);
  if (status != UCS_OK) fail("sending {} admission bytes to peer {}: {}", bytes.size(), peer, ucs_status_string(status));
}

void PrefillServer::revoke(std::uint64_t request_id) {
  State& s = *state_;
  if (request_id == 0 || request_id >= s.next_request) fail("revoke: request {} was never exported here", request_id);
  const auto r = s.requests.find(request_id);
  if (r == s.requests.end() || r->second.revoking) return;  // already freed, or on its way
  const auto p = s.peers.find(r->second.peer);
  if (p == s.peers.end() || p->second.status() != UCS_OK || !s.sends.post(p->second.get(), kRevoked, request_id)) {
    s.free_request(request_id);  // no peer can read it
    return;
  }
  r->second.revoking = true;
}

// ---- decode side -----------------------------------------------------------------------------

struct PrefillConnection::State {
  // A rendezvous admission being received. Declared before the worker, so destroyed after it:
  // a receive still in flight at teardown never writes into freed memory.
  struct Receive {
    std::vector<std::byte> bytes;
    void* request = nullptr;
  };
  std::list<Receive> receiving;
  std::vector<std::pair<void*, std::size_t>> rendezvous;  // descriptors to receive, lengths

  State(const std::string& ip_, std::uint16_t port_, std::chrono::milliseconds read_timeout_)
      : peer(fmt::format("{}:{}", ip_, port_)), read_timeout(read_timeout_), worker(context),
        endpoint(Endpoint::connect(worker, ip_, port_)) {
    // AMs are delivered only by progress, which starts after this.
    set_am_handler(worker, kAdmission, &on_admission, this);
    set_am_handler(worker, kRevoked, &on_revoked, this);
  }
  ~State() {
    for (auto [desc, length] : rendezvous) ucp_am_data_release(worker.get(), desc);
    endpoint.close();  // completes every send and receive on it
    sends.drop();
    for (Receive& r : receiving) ucp_request_free(r.request);
  }

  static ucs_status_t on_admission(void* arg, const void*, std::size_t, void* data, std::size_t length,
                                   const ucp_am_recv_param_t* param) {
    auto& s = *static_cast<State*>(arg);
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) {
      s.rendezvous.emplace_back(data, length);  // received after progress returns
      return UCS_INPROGRESS;
    }
    const auto* p = static_cast<const std::byte*>(data);
    s.admissions.emplace_back(p, p + length);
    return UCS_OK;
  }
  static ucs_status_t on_revoked(void* arg, const void* header, std::size_t header_length, void*, std::size_t,
                                 const ucp_am_recv_param_t*) {
    auto& s = *static_cast<State*>(arg);
    const std::uint64_t id = header_id(header, header_length);
    s.revoked.insert(id);
    s.acks.push_back(id);  // acknowledged after progress returns, outside the callback
    return UCS_OK;
  }

  bool alive() const { return endpoint.get() != nullptr && endpoint.status() == UCS_OK; }

  // One progress pass and its follow-ups. Called with the mutex held.
  void pass() {
    worker.progress();
    after_progress();
  }
  void after_progress() {
    for (auto [desc, length] : std::exchange(rendezvous, {})) {
      Receive& r = receiving.emplace_back(Receive{std::vector<std::byte>(length), nullptr});
      ucp_request_param_t p{};
      r.request = ucp_am_recv_data_nbx(worker.get(), desc, r.bytes.data(), length, &p);
      if (r.request == nullptr) {
        admissions.push_back(std::move(r.bytes));
        receiving.pop_back();
      } else if (UCS_PTR_IS_ERR(r.request)) {
        receive_error = UCS_PTR_STATUS(r.request);
        receiving.pop_back();
      }
    }
    for (auto it = receiving.begin(); it != receiving.end();) {
      const ucs_status_t st = ucp_request_check_status(it->request);
      if (st == UCS_INPROGRESS) { ++it; continue; }
      ucp_request_free(it->request);
      if (st == UCS_OK) admissions.push_back(std::move(it->bytes));
      else receive_error = st;
      it = receiving.erase(it);
    }
    for (std::uint64_t id : std::exchange(acks, {})) {
      if (alive()) (void)sends.post(endpoint.get(), kRevokeAck, id);
    }
    sends.reap();
  }

  std::mutex mutex;  // every UCX call on this connection
  std::string peer;  // ip:port, for messages
  std::chrono::milliseconds read_timeout;
  Context context;
  Worker worker;
  Endpoint endpoint;
  Sends sends;
  std::deque<std::vector<std::byte>> admissions;
  std::set<std::uint64_t> revoked;  // until the request's source is destroyed
  std::set<std::uint64_t> sourced;  // requests with a live source: one each (its release frees it)
  std::vector<std::uint64_t> acks;
  ucs_status_t receive_error = UCS_OK;
};

namespace {

class RemoteBlockSourceImpl final : public RemoteBlockSource {
 public:
  RemoteBlockSourceImpl(std::shared_ptr<PrefillConnection> connection, PrefillConnection::State& state,
                        const AdmissionMessage& m)
      : connection_(std::move(connection)), state_(state), id_(m.request_id), base_(m.region_base),
        bytes_(m.region_bytes) {
    key_.emplace(state.endpoint, m.packed_rkey);
  }

  ~RemoteBlockSourceImpl() override {
    try {
      const std::lock_guard lock(state_.mutex);
      key_.reset();  // under the lock: it returns memory to the worker
      state_.sourced.erase(id_);
      if (state_.revoked.erase(id_) == 0 && state_.alive()) {
        (void)state_.sends.post(state_.endpoint.get(), kRelease, id_);
        state_.pass();
      }
    } catch (...) {  // best effort: a failed release is a failed peer, which frees it too
    }
  }

  void read(std::span<const RemoteBlockRead> reads) override {
    std::vector<RemoteRead> converted;
    converted.reserve(reads.size());
    for (const RemoteBlockRead& r : reads) {
      if (r.remote < base_ || r.remote - base_ > bytes_ || bytes_ - (r.remote - base_) < r.bytes) {
        fail("remote read of request {}: [{:#x}, + {}) is outside its region [{:#x}, + {})", id_, r.remote, r.bytes,
             base_, bytes_);
      }
      converted.push_back({r.local, r.remote, r.bytes});
    }
    if (converted.empty()) return;
    const std::lock_guard lock(state_.mutex);
    state_.pass();  // learn of a revoke first
    if (state_.revoked.contains(id_)) fail("remote read of request {}: the prefill side released it", id_);
    if (!state_.alive()) {
      fail("remote read of request {}: the connection to {} failed: {}", id_, state_.peer,
           ucs_status_string(state_.endpoint.status()));
    }
    try {
      ucx::read(state_.endpoint, *key_, converted, state_.read_timeout);
    } catch (const Error& e) {
      state_.after_progress();
      fail("remote read of request {} from {}: {}", id_, state_.peer, e.what());
    }
    state_.after_progress();
  }

 private:
  std::shared_ptr<PrefillConnection> connection_;  // keeps state_ (and its endpoint) alive
  PrefillConnection::State& state_;
  std::optional<RemoteKey> key_;  // destroyed before the endpoint: the connection outlives this source
  std::uint64_t id_;
  std::uint64_t base_, bytes_;
};

}  // namespace

PrefillConnection::PrefillConnection(std::unique_ptr<State> state) : state_(std::move(state)) {}
PrefillConnection::~PrefillConnection() = default;

std::shared_ptr<PrefillConnection> PrefillConnection::connect(const std::string& ip, std::uint16_t port,
                                                              std::chrono::milliseconds timeout,
                                                              std::chrono::milliseconds read_timeout) {
  auto state = std::make_unique<State>(ip, port, read_timeout);
  // A flush completes once the connection is up (or failed): then the endpoint is usable.
  ucp_request_param_t params{};
  void* request = ucp_ep_flush_nbx(state->endpoint.get(), &params);
  const std::optional<ucs_status_t> done = wait(state->worker, request, Clock::now() + timeout);
  if (!done) {
    state->endpoint.close();
    ucp_request_free(request);
  }
  ucs_status_t status = done.value_or(UCS_ERR_TIMED_OUT);
  if (status == UCS_OK && state->endpoint.status() != UCS_OK) status = state->endpoint.status();
  if (status != UCS_OK) {
    fail("cannot connect to the prefill server at {}: {} (timeout {} ms)", state->peer, ucs_status_string(status),
         timeout.count());
  }
  return std::shared_ptr<PrefillConnection>(new PrefillConnection(std::move(state)));
}

std::vector<std::byte> PrefillConnection::receive_admission(std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  State& s = *state_;
  for (;; std::this_thread::yield()) {
    // Locked per pass, so that sources on other threads read while this waits.
    const std::lock_guard lock(s.mutex);
    s.pass();
    if (!s.admissions.empty()) {
      std::vector<std::byte> out = std::move(s.admissions.front());
      s.admissions.pop_front();
      return out;
    }
    if (s.receive_error != UCS_OK) {
      fail("receiving an admission message from {} failed: {}", s.peer,
           ucs_status_string(std::exchange(s.receive_error, UCS_OK)));
    }
    if (!s.alive()) {
      fail("no admission message from {}: the connection failed: {}", s.peer, ucs_status_string(s.endpoint.status()));
    }
    if (Clock::now() > deadline) fail("no admission message from {} within {} ms", s.peer, timeout.count());
  }
}

std::shared_ptr<RemoteBlockSource> PrefillConnection::source(const AdmissionMessage& message) {
  const std::lock_guard lock(state_->mutex);
  State& s = *state_;
  if (!s.alive()) fail("source of request {}: the connection to {} failed", message.request_id, s.peer);
  if (s.sourced.contains(message.request_id)) fail("source of request {}: it already has a source", message.request_id);
  auto out = std::make_shared<RemoteBlockSourceImpl>(shared_from_this(), s, message);
  s.sourced.insert(message.request_id);
  return out;
}

void PrefillConnection::progress() {
  const std::lock_guard lock(state_->mutex);
  state_->pass();
}

bool PrefillConnection::alive() const {
  const std::lock_guard lock(state_->mutex);
  return state_->alive();
}

}  // namespace ucx
}  // namespace v0
}  // namespace oasiskv
