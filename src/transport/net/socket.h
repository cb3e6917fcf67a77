// Plain TCP sockets for the handshake and membox's own TCP data path.
// Every helper takes a deadline, so no peer can block a caller forever.
// Thread-safety: functions are reentrant; an Fd is owned by one object.
#ifndef MEMBOX_SRC_TRANSPORT_NET_SOCKET_H_
#define MEMBOX_SRC_TRANSPORT_NET_SOCKET_H_

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <sys/uio.h>

#include "membox/base/status.h"

namespace membox::transport::net {

using Clock = std::chrono::steady_clock;

// Owns one file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }
  int get() const { return fd_; }
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }
  void reset(int fd = -1);
  explicit operator bool() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

// Listens on `endpoint` ("host:port", port 0 = any free port) with
// SO_REUSEADDR; non-blocking, close-on-exec. `bound` receives "host:port"
// with the real port (a wildcard host is reported as the host asked for, or
// 127.0.0.1).
Result<Fd> Listen(const std::string& endpoint, std::string* bound);
// Connects within `deadline`; the returned socket is blocking, with
// TCP_NODELAY and keepalive set.
Result<Fd> Connect(const std::string& endpoint, Clock::time_point deadline);
// TCP_NODELAY, keepalive (idle 10 s, 3 probes 5 s apart), close-on-exec.
void TuneStream(int fd);
Status SetBlocking(int fd, bool blocking);

// Sends / receives exactly the bytes asked for before `deadline` (blocking
// or non-blocking sockets). kUnavailable when the peer closes or resets,
// kDeadlineExceeded on time-out.
Status SendAll(int fd, const void* data, size_t n, Clock::time_point deadline);
Status SendAllV(int fd, iovec* iov, int iovcnt, Clock::time_point deadline);
Status RecvAll(int fd, void* data, size_t n, Clock::time_point deadline);
// Blocking sockets without a deadline (a channel's reader thread): receives
// exactly `n` bytes, letting the kernel fill large payloads in one call
// (MSG_WAITALL). kUnavailable on EOF or error.
Status RecvExact(int fd, void* data, size_t n);

// Frames: u32 little-endian length + body.
Status SendFrame(int fd, std::span<const uint8_t> body,
                 Clock::time_point deadline);
Result<std::vector<uint8_t>> RecvFrame(int fd, size_t max,
                                       Clock::time_point deadline);

// Incremental frame reader for non-blocking sockets (the acceptor reads
// many half-open handshakes from one thread).
class FrameReader {
 public:
  explicit FrameReader(size_t max) : max_(max) {}
  // Reads what is available. Returns true when a whole frame is in frame();
  // false when more bytes are needed; an error on EOF, reset or a length
  // over the maximum.
  Result<bool> ReadFrom(int fd);
  std::vector<uint8_t>& frame() { return body_; }
  void Reset(size_t max);

 private:
  size_t max_;
  uint8_t len_buf_[4] = {0, 0, 0, 0};
  size_t len_have_ = 0;
  bool have_len_ = false;
  std::vector<uint8_t> body_;
  size_t body_have_ = 0;
};

// "host:port" of the socket's peer, for logs.
std::string PeerName(int fd);

// The uid of the process at the other end of TCP connection `fd` when that
// end is proven to be in this host's network namespace: the peer's address
// is this socket's own local address (loopback included), so no other host
// can have sent it, and the kernel's socket table (/proc/net/tcp{,6}) names
// the peer socket's owner. The TCP counterpart of SO_PEERCRED. kNotFound
// when the peer is not local (or its socket is gone).
Result<uint32_t> LocalPeerUid(int fd);

}  // namespace membox::transport::net

#endif  // MEMBOX_SRC_TRANSPORT_NET_SOCKET_H_
