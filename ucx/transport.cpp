#include "oasiskv/ucx/transport.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <cstring>
#include <utility>

#include "oasiskv/error.hpp"

namespace oasiskv {
inline namespace v0 {
namespace ucx {
namespace {

void check(ucs_status_t status, const char* what) {
  if (status != UCS_OK) fail("UCX: {} failed: {}", what, ucs_status_string(status));
}

sockaddr_in ipv4(const std::string& ip, std::uint16_t port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  if (inet_pton(AF_INET, ip.c_str(), &a.sin_addr) != 1) fail("UCX: '{}' is not an IPv4 address", ip);
  return a;
}

// Progresses until the request completes; returns its status and frees it.
ucs_status_t wait(ucp_worker_h worker, void* request) {
  if (request == nullptr) return UCS_OK;
  if (UCS_PTR_IS_ERR(request)) return UCS_PTR_STATUS(request);
  ucs_status_t status;
  while ((status = ucp_request_check_status(request)) == UCS_INPROGRESS) ucp_worker_progress(worker);
  ucp_request_free(request);
  return status;
}

}  // namespace

Context::Context() {
  ucp_config_t* config = nullptr;
  check(ucp_config_read(nullptr, nullptr, &config), "ucp_config_read");
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM;
  const ucs_status_t status = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  check(status, "ucp_init");
}

Context::~Context() {
  if (context_ != nullptr) ucp_cleanup(context_);
}

Worker::Worker(Context& context) {
  ucp_worker_params_t params{};
  params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  // Serialized, not single: a PrefillConnection's worker is used from several threads, one at a
  // time under its mutex (remote_tier.cpp).
  params.thread_mode = UCS_THREAD_MODE_SERIALIZED;
  check(ucp_worker_create(context.get(), &params, &worker_), "ucp_worker_create");
}

Worker::~Worker() {
  if (worker_ != nullptr) ucp_worker_destroy(worker_);
}

// ---- endpoints ----

Endpoint Endpoint::create(Worker& worker, ucp_ep_params_t& params, const char* what) {
  auto state = std::make_unique<State>();
  state->worker = &worker;
  params.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;  // a peer that goes away fails this endpoint only
  params.err_handler.cb = [](void* arg, ucp_ep_h, ucs_status_t status) { static_cast<State*>(arg)->status = status; };
  params.err_handler.arg = state.get();
  check(ucp_ep_create(worker.get(), &params, &state->ep), what);
  return Endpoint(std::move(state));
}

Endpoint Endpoint::connect(Worker& worker, const std::string& ip, std::uint16_t port) {
  const sockaddr_in address = ipv4(ip, port);
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR;
  params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&address);
  params.sockaddr.addrlen = sizeof(address);
  return create(worker, params, "ucp_ep_create (connect)");
}

Endpoint::Endpoint(Endpoint&& other) noexcept : state_(std::move(other.state_)) {}

Endpoint& Endpoint::operator=(Endpoint&& other) noexcept {
  if (this != &other) {
    close();
    state_ = std::move(other.state_);
  }
  return *this;
}

Endpoint::~Endpoint() { close(); }

void Endpoint::close() noexcept {
  if (!state_ || state_->ep == nullptr) return;
  ucp_request_param_t params{};
  params.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  params.flags = UCP_EP_CLOSE_FLAG_FORCE;
  (void)wait(state_->worker->get(), ucp_ep_close_nbx(state_->ep, &params));
  state_->ep = nullptr;
  if (state_->status == UCS_OK) state_->status = UCS_ERR_CANCELED;
}

// ---- listener ----

void Listener::on_request(ucp_conn_request_h request, void* self) {
  static_cast<Listener*>(self)->pending_.push_back(request);
}

Listener::Listener(Worker& worker, const std::string& ip, std::uint16_t port) : worker_(worker) {
  const sockaddr_in address = ipv4(ip, port);
  ucp_listener_params_t params{};
  params.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&address);
  params.sockaddr.addrlen = sizeof(address);
  params.conn_handler.cb = &Listener::on_request;
  params.conn_handler.arg = this;
  check(ucp_listener_create(worker.get(), &params, &listener_), "ucp_listener_create");
  ucp_listener_attr_t attr{};
  attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  check(ucp_listener_query(listener_, &attr), "ucp_listener_query");
  port_ = ntohs(reinterpret_cast<const sockaddr_in*>(&attr.sockaddr)->sin_port);
}

Listener::~Listener() {
  for (ucp_conn_request_h r : pending_) (void)ucp_listener_reject(listener_, r);
  if (listener_ != nullptr) ucp_listener_destroy(listener_);
}

std::vector<Endpoint> Listener::accept() {
  std::vector<Endpoint> out;
  std::vector<ucp_conn_request_h> requests;
  requests.swap(pending_);
  for (ucp_conn_request_h r : requests) {
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST;
    params.conn_request = r;
    out.push_back(Endpoint::create(worker_, params, "ucp_ep_create (accept)"));
  }
  return out;
}

// ---- memory ----

Registration::Registration(Context& context, void* base, std::size_t bytes)
    : context_(context), base_(base), bytes_(bytes) {
  if (base == nullptr || bytes == 0) fail("UCX: cannot register an empty region ({} bytes at {})", bytes, base);
  ucp_mem_map_params_t params{};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  params.address = base;
  params.length = bytes;
  check(ucp_mem_map(context.get(), &params, &memory_), "ucp_mem_map");
}

Registration::~Registration() {
  if (memory_ != nullptr) (void)ucp_mem_unmap(context_.get(), memory_);
}

std::vector<std::byte> Registration::packed_key() const {
  void* buffer = nullptr;
  std::size_t size = 0;
  check(ucp_rkey_pack(context_.get(), memory_, &buffer, &size), "ucp_rkey_pack");
  std::vector<std::byte> out(size);
  std::memcpy(out.data(), buffer, size);
  ucp_rkey_buffer_release(buffer);
  return out;
}

RemoteKey::RemoteKey(const Endpoint& endpoint, std::span<const std::byte> packed) {
  if (packed.empty()) fail("UCX: empty remote key");
  check(ucp_ep_rkey_unpack(endpoint.get(), packed.data(), &key_), "ucp_ep_rkey_unpack");
}

RemoteKey::~RemoteKey() {
  if (key_ != nullptr) ucp_rkey_destroy(key_);
}

// ---- active messages, requests ----

void set_am_handler(Worker& worker, unsigned id, ucp_am_recv_callback_t cb, void* arg) {
  ucp_am_handler_param_t p{};
  p.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG |
                 UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
  p.id = id;
  p.cb = cb;
  p.arg = arg;
  p.flags = UCP_AM_FLAG_WHOLE_MSG;
  check(ucp_worker_set_am_recv_handler(worker.get(), &p), "ucp_worker_set_am_recv_handler");
}

std::optional<ucs_status_t> wait(Worker& worker, void* request, std::chrono::steady_clock::time_point deadline) {
  if (request == nullptr) return UCS_OK;
  if (UCS_PTR_IS_ERR(request)) return UCS_PTR_STATUS(request);
  ucs_status_t status;
  while ((status = ucp_request_check_status(request)) == UCS_INPROGRESS) {
    if (std::chrono::steady_clock::now() > deadline) return std::nullopt;
    worker.progress();
  }
  ucp_request_free(request);
  return status;
}

// ---- reads ----

void read(Endpoint& endpoint, const RemoteKey& key, std::span<const RemoteRead> reads,
          std::chrono::milliseconds timeout) {
  if (endpoint.get() == nullptr) fail("UCX: read on a closed endpoint");
  const ucp_worker_h worker = endpoint.worker().get();
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::vector<void*> requests;
  ucs_status_t first_error = UCS_OK;
  for (const RemoteRead& r : reads) {
    ucp_request_param_t params{};
    void* request = ucp_get_nbx(endpoint.get(), r.local, r.bytes, r.remote, key.get(), &params);
    if (UCS_PTR_IS_ERR(request)) {
      first_error = UCS_PTR_STATUS(request);
      break;
    }
    if (request != nullptr) requests.push_back(request);
  }
  bool timed_out = false;
  for (;;) {
    bool busy = false;
    for (void* r : requests) busy = busy || ucp_request_check_status(r) == UCS_INPROGRESS;
    if (!busy) break;
    if (endpoint.get() != nullptr && (endpoint.status() != UCS_OK || std::chrono::steady_clock::now() > deadline)) {
      // Closing in force mode completes every request still outstanding on it (with an error).
      timed_out = endpoint.status() == UCS_OK;
      endpoint.close();
      continue;
    }
    ucp_worker_progress(worker);
  }
  for (void* r : requests) {
    const ucs_status_t s = ucp_request_check_status(r);
    if (s != UCS_OK && first_error == UCS_OK) first_error = s;
    ucp_request_free(r);
  }
  if (timed_out) {
    fail("UCX: reading {} blocks from the peer timed out after {} ms (the peer is slow, gone, or not progressing); "
         "the connection is closed",
         reads.size(), timeout.count());
  }
  if (endpoint.status() != UCS_OK) {
    fail("UCX: the connection failed: {}", ucs_status_string(endpoint.status()));
  }
  if (first_error != UCS_OK) fail("UCX: a remote read failed: {}", ucs_status_string(first_error));
}

}  // namespace ucx
}  // namespace v0
}  // namespace oasiskv
