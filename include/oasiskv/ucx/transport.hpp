// The remote tier's transport: thin RAII owners of UCX objects (UCP: context, worker, listener,
// endpoint, memory registration, remote key) and the one data operation the decode side needs:
// reading blocks of another process's registered memory with ucp_get_nbx, with a deadline. No
// protocol of our own: connections are UCX's client/server sockaddr setup, data moves by UCX RMA
// (over tcp, UCX emulates get with active messages: the exporting side must progress its worker).
// Errors (a UCX failure, a peer gone, a deadline passed) are oasiskv::Error naming the operation.
//
// Target oasiskv::ucx, built when pkg-config finds `ucx` (Debian: libucx-dev). A worker and
// everything made from it are used by one thread at a time (workers are created
// UCS_THREAD_MODE_SERIALIZED, so that thread may change, under the caller's lock).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <ucp/api/ucp.h>

namespace oasiskv {
inline namespace v0 {
namespace ucx {

// ucp_context with RMA and active messages.
class Context {
 public:
  Context();
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;
  ucp_context_h get() const noexcept { return context_; }

 private:
  ucp_context_h context_ = nullptr;
};

class Worker {
 public:
  explicit Worker(Context& context);
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;
  ucp_worker_h get() const noexcept { return worker_; }
  // Runs UCX's callbacks and pending communication once; true when something happened.
  bool progress() noexcept { return ucp_worker_progress(worker_) != 0; }

 private:
  ucp_worker_h worker_ = nullptr;
};

// One connection. Made by Endpoint::connect (client) or Listener::accept (server).
class Endpoint {
 public:
  // Connects to a listener at ip:port (IPv4); the connection completes as the worker progresses.
  static Endpoint connect(Worker& worker, const std::string& ip, std::uint16_t port);
  Endpoint(Endpoint&&) noexcept;
  Endpoint& operator=(Endpoint&&) noexcept;
  ~Endpoint();
  ucp_ep_h get() const noexcept { return state_->ep; }
  Worker& worker() const noexcept { return *state_->worker; }
  // UCS_OK, or the error UCX reported for this connection (the peer gone, reset).
  ucs_status_t status() const noexcept { return state_->status; }
  // Closes now (force mode); later operations on it fail.
  void close() noexcept;

 private:
  friend class Listener;
  struct State {
    Worker* worker = nullptr;
    ucp_ep_h ep = nullptr;
    ucs_status_t status = UCS_OK;
  };
  explicit Endpoint(std::unique_ptr<State> state) : state_(std::move(state)) {}
  static Endpoint create(Worker& worker, ucp_ep_params_t& params, const char* what);
  std::unique_ptr<State> state_;
};

// Listens on ip:port (port 0: any free port; see port()) and accepts connections.
class Listener {
 public:
  Listener(Worker& worker, const std::string& ip, std::uint16_t port);
  ~Listener();
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;
  std::uint16_t port() const noexcept { return port_; }
  // Connection requests that arrived while the worker progressed, accepted as endpoints.
  std::vector<Endpoint> accept();

 private:
  static void on_request(ucp_conn_request_h request, void* self);
  Worker& worker_;
  ucp_listener_h listener_ = nullptr;
  std::uint16_t port_ = 0;
  std::vector<ucp_conn_request_h> pending_;
};

// A registration of [base, base + bytes) for remote reads; its packed key travels to the reader.
class Registration {
 public:
  Registration(Context& context, void* base, std::size_t bytes);
  ~Registration();
  Registration(const Registration&) = delete;
  Registration& operator=(const Registration&) = delete;
  std::vector<std::byte> packed_key() const;
  std::uint64_t base() const noexcept { return reinterpret_cast<std::uint64_t>(base_); }
  std::size_t bytes() const noexcept { return bytes_; }

 private:
  Context& context_;
  ucp_mem_h memory_ = nullptr;
  void* base_ = nullptr;
  std::size_t bytes_ = 0;
};

// A packed key unpacked for one endpoint.
class RemoteKey {
 public:
  RemoteKey(const Endpoint& endpoint, std::span<const std::byte> packed);
  ~RemoteKey();
  RemoteKey(const RemoteKey&) = delete;
  RemoteKey& operator=(const RemoteKey&) = delete;
  ucp_rkey_h get() const noexcept { return key_; }

 private:
  ucp_rkey_h key_ = nullptr;
};

// Installs the active-message handler `cb` (with `arg`) for `id`, whole messages only.
void set_am_handler(Worker& worker, unsigned id, ucp_am_recv_callback_t cb, void* arg);

// Progresses until `request` (as a UCX non-blocking call returned it) completes: its status, the
// request freed; or until `deadline` passes: nullopt, the request still in flight and the caller's.
std::optional<ucs_status_t> wait(Worker& worker, void* request, std::chrono::steady_clock::time_point deadline);

// One read: `bytes` at remote address `remote` into `local`.
struct RemoteRead {
  void* local = nullptr;
  std::uint64_t remote = 0;
  std::size_t bytes = 0;
};

// Issues every read and progresses the endpoint's worker until all completed. Throws
// oasiskv::Error if UCX refuses one, the connection fails, or `timeout` passes first; then the
// endpoint is closed (force mode), which completes the reads in flight before it throws, so
// `local` is no longer written.
void read(Endpoint& endpoint, const RemoteKey& key, std::span<const RemoteRead> reads,
          std::chrono::milliseconds timeout);

}  // namespace ucx
}  // namespace v0
}  // namespace oasiskv
