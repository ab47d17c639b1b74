// The remote tier over UCX: a prefill process exports a request's KV (one registration per
// request) and sends the decode process its admission message; the decode process reads the
// blocks it needs with UCX RMA. The only framing of our own is UCX active messages on the
// endpoint: 1, the admission message (prefill -> decode; large ones travel by UCX rendezvous);
// 2, "release request N" (decode -> prefill); 3, "revoked request N" (prefill -> decode) when the
// prefill side drops a request first; 4, "revoke of N acknowledged" (decode -> prefill). N is a
// little-endian u64 header. Data moves by ucp_get_nbx (transport.hpp).
//
// Lifetime rules. A request's memory and registration live until the decode side releases it
// (its RemoteBlockSource is destroyed), the decode side's connection fails (it exited or was
// killed), or the prefill side revokes it; after a revoke the decode side's reads of it fail with
// an Error naming the request. A decode-side connection whose prefill process is gone fails every
// read with an Error within the read timeout; other connections are untouched.
//
// Threads: each object is used from one thread at a time, except PrefillConnection, which is
// shared by its sources (called from the backend's copy thread) and the engine's thread: it
// serialises its UCX worker with a mutex.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "oasiskv/admission.hpp"
#include "oasiskv/remote_blocks.hpp"

namespace oasiskv {
inline namespace v0 {
namespace ucx {

// ---- prefill side ----------------------------------------------------------------------------

class PrefillServer {
 public:
  // Listens on ip:port (port 0: any free port, see port()).
  PrefillServer(const std::string& ip, std::uint16_t port);
  ~PrefillServer();
  PrefillServer(const PrefillServer&) = delete;
  PrefillServer& operator=(const PrefillServer&) = delete;
  std::uint16_t port() const noexcept;

  // Copies `blocks` (each `block_bytes`: one host pool block, every layer and kv head, in logical
  // block order) into one buffer of its own, registers it, and fills the message's remote fields:
  // request_id (new, unique in this server), block_addresses, region_base, region_bytes,
  // packed_rkey. The request is held until released (see above).
  void export_request(std::span<const void* const> blocks, std::size_t block_bytes, AdmissionMessage& message);

  // Progresses UCX for up to `timeout` (0: once): accepts connections, answers reads (over tcp the
  // exporter's progress serves them), handles releases and failed peers. Returns the ids of the
  // decode peers connected now.
  std::vector<std::uint64_t> progress(std::chrono::milliseconds timeout = std::chrono::milliseconds(0));
  // Sends the encoded message to a connected peer (waits for the send to complete, progressing;
  // at most 30 s, then the peer is dropped); the request becomes that peer's: its release or
  // failure frees it. Throws oasiskv::Error for an unknown peer or request, a request already
  // sent, or a failed send (the request then stays held, unsent: revoke it or send it again).
  void send_admission(std::uint64_t peer, const AdmissionMessage& message);
  // Sends `bytes` to a connected peer as an admission message, as they are (send_admission's
  // transport; also how a test sends a decode side a malformed message). Binds no request.
  // Throws oasiskv::Error for an unknown peer or a failed send (waits at most 30 s, then the
  // peer is dropped).
  void send_admission_bytes(std::uint64_t peer, std::span<const std::byte> bytes);
  // Drops a request now: tells its peer (its later reads fail) and frees it once the peer
  // acknowledged or failed; a request never sent is freed at once. A request already freed (its
  // release may cross the revoke) is no error; an id this server never issued is.
  void revoke(std::uint64_t request_id);

  // Requests held (exported and not yet freed), and their bytes.
  std::size_t live_requests() const noexcept;
  std::size_t live_bytes() const noexcept;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// ---- decode side -----------------------------------------------------------------------------

class PrefillConnection : public std::enable_shared_from_this<PrefillConnection> {
 public:
  // Connects to a PrefillServer; throws oasiskv::Error if it is not reachable within `timeout`.
  // read_timeout bounds every read of the sources made from this connection.
  static std::shared_ptr<PrefillConnection> connect(const std::string& ip, std::uint16_t port,
                                                    std::chrono::milliseconds timeout,
                                                    std::chrono::milliseconds read_timeout);
  ~PrefillConnection();
  PrefillConnection(const PrefillConnection&) = delete;
  PrefillConnection& operator=(const PrefillConnection&) = delete;

  // The next admission message's bytes (decode_admission parses them); throws oasiskv::Error if
  // none arrives within `timeout` or the connection fails.
  std::vector<std::byte> receive_admission(std::chrono::milliseconds timeout);
  // The block source of an admitted request (its remote key unpacked for this connection), one
  // per request at a time. Destroying it releases the request on the prefill side. Reads outside
  // the message's region are refused before any UCX call.
  std::shared_ptr<RemoteBlockSource> source(const AdmissionMessage& message);
  // Progresses once (releases, revokes); the sources progress while they read.
  void progress();
  // Whether the connection is still up.
  bool alive() const;

  struct State;

 private:
  explicit PrefillConnection(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace ucx
}  // namespace v0
}  // namespace oasiskv
