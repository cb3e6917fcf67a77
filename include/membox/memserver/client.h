// Client of a memory node (seed 003's SMB library, in C++; the C API with the
// paper's names is include/membox/c/smb.h).
//
// A Client holds one authenticated channel to one memory node. Segments are
// created by a master (Create) and attached by others of the same principal
// with the same 128-bit key (segment_key.h) and size (Attach); each Segment has
// a local cache buffer in registered memory and an imported view of the remote
// segment. ReadSync copies remote -> local cache, WriteSync local cache ->
// remote (visible to the server and other clients when it returns); on the same
// host Map() gives a pointer straight into the server's pool for load/store.
// Accumulate runs on the server's sync cores and returns when the result is
// visible; AccumulateAsync returns at once with an OpHandle that completes
// then.
//
// Errors: every call returns a Status; when the memory node dies or the
// connection breaks, calls fail with kUnavailable naming the server instead
// of hanging. A background thread sends heartbeats.
//
// Ownership: Segments are owned by the Client and stay valid until Detach /
// Delete or the Client's destruction. Thread-safety: all methods may be
// called concurrently; one Segment should be synced by one thread at a time.
#ifndef MEMBOX_MEMSERVER_CLIENT_H_
#define MEMBOX_MEMSERVER_CLIENT_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "membox/base/status.h"
#include "membox/memserver/segment_key.h"
#include "membox/service/call.h"
#include "membox/transport/op_handle.h"
#include "membox/transport/tensor_transfer.h"

namespace membox::memserver {

struct ClientOptions {
  std::string server;  // "host:port"
  std::string secret;  // the server's authentication secret
  std::string name = "client";
  std::string transports = "auto";
  std::chrono::milliseconds timeout{30000};  // per request
};

class Segment {
 public:
  virtual ~Segment() = default;
  const SegmentKey& key() const { return key_; }
  size_t size() const { return size_; }
  bool master() const { return master_; }
  // The local cache buffer (size() bytes, registered memory).
  void* data() const { return data_; }
  // Direct pointer into the memory node's pool when it is on this host and
  // mapped, else nullptr. Loads and stores through it need no sync.
  virtual void* Map() const = 0;

 protected:
  Segment(const SegmentKey& key, size_t size, bool master, void* data)
      : key_(key), size_(size), master_(master), data_(data) {}

 private:
  SegmentKey key_;
  size_t size_;
  bool master_;
  void* data_;
};

class Client {
 public:
  // Connects and registers with the secret; kUnauthenticated when wrong.
  static Result<std::unique_ptr<Client>> Connect(const ClientOptions& options);
  virtual ~Client() = default;

  // Creates a segment as master; an empty key lets the server choose one
  // (from the CSPRNG); kAlreadyExists when this principal already has `key`.
  virtual Result<Segment*> Create(const SegmentKey& key, size_t size) = 0;
  // Attaches an existing segment of this principal; the size must match.
  // An unknown key, a wrong size and another principal's key all give one
  // kNotFound.
  virtual Result<Segment*> Attach(const SegmentKey& key, size_t size) = 0;
  // Detaches (any client) or deletes (master only). The Segment is destroyed.
  virtual Status Detach(Segment* segment) = 0;
  virtual Status Delete(Segment* segment) = 0;

  // Remote -> local cache for [offset, offset + length).
  virtual Status ReadSync(Segment* segment, size_t offset, size_t length) = 0;
  // Local cache -> remote; visible remotely when it returns.
  virtual Status WriteSync(Segment* segment, size_t offset, size_t length) = 0;
  // dst <- dst + scale * src on the server over [offset, offset + length)
  // bytes of both (length 0: whole segments, which must be equal in size).
  virtual Status Accumulate(Segment* dst, Segment* src, DType dtype,
                            double scale = 1.0, size_t offset = 0,
                            size_t length = 0) = 0;
  // The same without blocking: the request is on its way when this returns
  // and the handle completes (with Accumulate's status) when the result is
  // visible, so one thread can write-sync the next range, or read-sync an
  // earlier one, while the server adds. Arguments are checked here (errors
  // come back as a completed handle). Several accumulates in flight may be
  // applied in any order (addition commutes up to rounding); a read-sync of
  // the range must wait for the handle. Handles must be waited on before the
  // Client is destroyed (its destructor fails pending ones with kAborted).
  virtual service::Call AccumulateAsync(Segment* dst, Segment* src, DType dtype,
                                        double scale = 1.0, size_t offset = 0,
                                        size_t length = 0) = 0;
  // The server's status text: pool totals, this client and its segments;
  // with the server's admin secret (proved by challenge-response, never
  // sent) every client and segment. kPermissionDenied for a wrong one.
  virtual Result<std::string> ServerStatus(
      const std::string& admin_secret = "") = 0;
  // The segment whose local cache contains `p`, or nullptr.
  virtual Segment* Find(const void* p) const = 0;
  // OK while the server is reachable.
  virtual Status health() const = 0;
};

}  // namespace membox::memserver

#endif  // MEMBOX_MEMSERVER_CLIENT_H_
