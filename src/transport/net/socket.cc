#include "src/transport/net/socket.h"

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

namespace membox::transport::net {
namespace {

struct Endpoint {
  std::string host;
  std::string port;
};

Result<Endpoint> Split(const std::string& endpoint) {
  auto colon = endpoint.rfind(':');
  if (colon == std::string::npos || colon + 1 == endpoint.size()) {
    return InvalidArgumentError("endpoint '" + endpoint + "' is not host:port");
  }
  Endpoint e{endpoint.substr(0, colon), endpoint.substr(colon + 1)};
  if (!e.host.empty() && e.host.front() == '[' && e.host.back() == ']') {
    e.host = e.host.substr(1, e.host.size() - 2);
  }
  return e;
}

int RemainingMs(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
      deadline - Clock::now());
  if (left.count() <= 0) return 0;
  return left.count() > 1000000 ? 1000000 : static_cast<int>(left.count());
}

// Waits until `fd` is ready for `events`; false on time-out.
Result<bool> WaitFor(int fd, short events, Clock::time_point deadline) {
  pollfd p{fd, events, 0};
  for (;;) {
    int ms = RemainingMs(deadline);
    int rc = poll(&p, 1, ms);
    if (rc > 0) return true;
    if (rc == 0) return false;
    if (errno != EINTR) return UnavailableError(std::strerror(errno));
  }
}

Status Errno(const char* what) {
  int e = errno;
  if (e == ECONNRESET || e == EPIPE || e == ENOTCONN || e == ECONNREFUSED ||
      e == EHOSTUNREACH || e == ENETUNREACH || e == ETIMEDOUT) {
    return UnavailableError(std::string(what) + ": " + std::strerror(e));
  }
  return InternalError(std::string(what) + ": " + std::strerror(e));
}

}  // namespace

Fd& Fd::operator=(Fd&& o) noexcept {
  if (this != &o) reset(o.release());
  return *this;
}

void Fd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

void TuneStream(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  int idle = 10, intvl = 5, cnt = 3;
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof(intvl));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof(cnt));
  fcntl(fd, F_SETFD, FD_CLOEXEC);
}

Status SetBlocking(int fd, bool blocking) {
  int fl = fcntl(fd, F_GETFL, 0);
  if (fl < 0) return Errno("fcntl");
  fl = blocking ? (fl & ~O_NONBLOCK) : (fl | O_NONBLOCK);
  if (fcntl(fd, F_SETFL, fl) < 0) return Errno("fcntl");
  return Status::Ok();
}

namespace {

// `endpoint`'s first address (a passive one for a listener: an empty host
// is any address) and a non-blocking stream socket of its family.
struct Opened {
  Fd fd;
  sockaddr_storage addr{};
  socklen_t len = 0;
};

Result<Opened> Open(const std::string& endpoint, const Endpoint& e,
                    bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* res = nullptr;
  int rc = getaddrinfo(passive && e.host.empty() ? nullptr : e.host.c_str(),
                       e.port.c_str(), &hints, &res);
  if (rc != 0 || res == nullptr) {
    return InvalidArgumentError("cannot resolve '" + endpoint +
                                "': " + gai_strerror(rc));
  }
  Opened o;
  std::memcpy(&o.addr, res->ai_addr, res->ai_addrlen);
  o.len = res->ai_addrlen;
  o.fd =
      Fd(socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  freeaddrinfo(res);
  if (!o.fd) return Errno("socket");
  return o;
}

}  // namespace

Result<Fd> Listen(const std::string& endpoint, std::string* bound) {
  ASSIGN_OR_RETURN(Endpoint e, Split(endpoint));
  ASSIGN_OR_RETURN(Opened o, Open(endpoint, e, /*passive=*/true));
  Fd fd = std::move(o.fd);
  int one = 1;
  setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  int rc = bind(fd.get(), reinterpret_cast<sockaddr*>(&o.addr), o.len);
  if (rc != 0) {
    int err = errno;
    return UnavailableError("cannot listen on '" + endpoint +
                            "': " + std::strerror(err));
  }
  if (listen(fd.get(), 4096) != 0) return Errno("listen");
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &len);
  uint16_t port = ss.ss_family == AF_INET
                      ? ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port)
                      : ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
  std::string h = e.host;
  if (h.empty() || h == "0.0.0.0" || h == "::") h = "127.0.0.1";
  if (h.find(':') != std::string::npos) h = "[" + h + "]";
  *bound = h + ":" + std::to_string(port);
  return fd;
}

Result<Fd> Connect(const std::string& endpoint, Clock::time_point deadline) {
  ASSIGN_OR_RETURN(Endpoint e, Split(endpoint));
  ASSIGN_OR_RETURN(Opened o, Open(endpoint, e, /*passive=*/false));
  Fd fd = std::move(o.fd);
  int rc = connect(fd.get(), reinterpret_cast<sockaddr*>(&o.addr), o.len);
  if (rc != 0 && errno != EINPROGRESS) return Errno("connect");
  if (rc != 0) {
    ASSIGN_OR_RETURN(bool ready, WaitFor(fd.get(), POLLOUT, deadline));
    if (!ready) return DeadlineExceededError("connect timed out");
    int err = 0;
    socklen_t len = sizeof(err);
    getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) {
      errno = err;
      return Errno("connect");
    }
  }
  TuneStream(fd.get());
  RETURN_IF_ERROR(SetBlocking(fd.get(), true));
  return fd;
}

Status SendAllV(int fd, iovec* iov, int iovcnt, Clock::time_point deadline) {
  while (iovcnt > 0) {
    if (iov->iov_len == 0) {
      ++iov;
      --iovcnt;
      continue;
    }
    msghdr mh{};
    mh.msg_iov = iov;
    mh.msg_iovlen = static_cast<size_t>(iovcnt);
    ssize_t n = sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        ASSIGN_OR_RETURN(bool ready, WaitFor(fd, POLLOUT, deadline));
        if (!ready) return DeadlineExceededError("send timed out");
        continue;
      }
      return Errno("send");
    }
    size_t left = static_cast<size_t>(n);
    while (iovcnt > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      ++iov;
      --iovcnt;
    }
    if (iovcnt > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + left;
      iov->iov_len -= left;
    }
  }
  return Status::Ok();
}

Status SendAll(int fd, const void* data, size_t n, Clock::time_point deadline) {
  iovec v{const_cast<void*>(data), n};
  return SendAllV(fd, &v, 1, deadline);
}

namespace {

// Receives exactly `n` bytes: non-blocking until `deadline` when one is
// given, otherwise letting the kernel fill the buffer (MSG_WAITALL).
Status RecvLoop(int fd, void* data, size_t n,
                const Clock::time_point* deadline) {
  auto* p = static_cast<char*>(data);
  const int flags = deadline ? MSG_DONTWAIT : MSG_WAITALL;
  while (n > 0) {
    ssize_t r = recv(fd, p, n, flags);
    if (r > 0) {
      p += r;
      n -= static_cast<size_t>(r);
      continue;
    }
    if (r == 0) return UnavailableError("connection closed by the peer");
    if (errno == EINTR) continue;
    if (deadline && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      ASSIGN_OR_RETURN(bool ready, WaitFor(fd, POLLIN, *deadline));
      if (!ready) return DeadlineExceededError("receive timed out");
      continue;
    }
    return Errno("recv");
  }
  return Status::Ok();
}

}  // namespace

Status RecvAll(int fd, void* data, size_t n, Clock::time_point deadline) {
  return RecvLoop(fd, data, n, &deadline);
}

Status RecvExact(int fd, void* data, size_t n) {
  return RecvLoop(fd, data, n, nullptr);
}

Status SendFrame(int fd, std::span<const uint8_t> body,
                 Clock::time_point deadline) {
  uint32_t len = static_cast<uint32_t>(body.size());
  iovec v[2] = {{&len, 4}, {const_cast<uint8_t*>(body.data()), body.size()}};
  return SendAllV(fd, v, 2, deadline);
}

Result<std::vector<uint8_t>> RecvFrame(int fd, size_t max,
                                       Clock::time_point deadline) {
  uint32_t len = 0;
  RETURN_IF_ERROR(RecvAll(fd, &len, 4, deadline));
  if (len > max) {
    return InvalidArgumentError("frame of " + std::to_string(len) +
                                " bytes exceeds " + std::to_string(max));
  }
  std::vector<uint8_t> body(len);
  RETURN_IF_ERROR(RecvAll(fd, body.data(), len, deadline));
  return body;
}

void FrameReader::Reset(size_t max) {
  max_ = max;
  len_have_ = 0;
  have_len_ = false;
  body_.clear();
  body_have_ = 0;
}

Result<bool> FrameReader::ReadFrom(int fd) {
  for (;;) {
    void* dst;
    size_t want;
    if (!have_len_) {
      dst = len_buf_ + len_have_;
      want = 4 - len_have_;
    } else {
      if (body_have_ == body_.size()) return true;
      dst = body_.data() + body_have_;
      want = body_.size() - body_have_;
    }
    ssize_t r = recv(fd, dst, want, MSG_DONTWAIT);
    if (r == 0) return UnavailableError("connection closed by the peer");
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return false;
      return Errno("recv");
    }
    if (!have_len_) {
      len_have_ += static_cast<size_t>(r);
      if (len_have_ == 4) {
        uint32_t len = 0;
        std::memcpy(&len, len_buf_, 4);
        if (len > max_) {
          return InvalidArgumentError("handshake frame of " +
                                      std::to_string(len) + " bytes exceeds " +
                                      std::to_string(max_));
        }
        have_len_ = true;
        body_.assign(len, 0);
        body_have_ = 0;
        if (len == 0) return true;
      }
    } else {
      body_have_ += static_cast<size_t>(r);
      if (body_have_ == body_.size()) return true;
    }
  }
}

std::string PeerName(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "?";
  char host[INET6_ADDRSTRLEN] = {0};
  uint16_t port = 0;
  if (ss.ss_family == AF_INET) {
    auto* s = reinterpret_cast<sockaddr_in*>(&ss);
    inet_ntop(AF_INET, &s->sin_addr, host, sizeof(host));
    port = ntohs(s->sin_port);
  } else if (ss.ss_family == AF_INET6) {
    auto* s = reinterpret_cast<sockaddr_in6*>(&ss);
    inet_ntop(AF_INET6, &s->sin6_addr, host, sizeof(host));
    port = ntohs(s->sin6_port);
  }
  return std::string(host) + ":" + std::to_string(port);
}

namespace {

// The address as /proc/net/tcp{,6} prints it: the 32-bit words of the
// address in host byte order, each as 8 hex digits, then ":" and the port.
std::string ProcNetAddress(const sockaddr_storage& a) {
  char buf[64];
  if (a.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&a);
    std::snprintf(buf, sizeof(buf), "%08X:%04X", in->sin_addr.s_addr,
                  ntohs(in->sin_port));
    return buf;
  }
  const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&a);
  uint32_t w[4];
  std::memcpy(w, &in6->sin6_addr, 16);
  std::snprintf(buf, sizeof(buf), "%08X%08X%08X%08X:%04X", w[0], w[1], w[2],
                w[3], ntohs(in6->sin6_port));
  return buf;
}

bool SameHostAddress(const sockaddr_storage& peer,
                     const sockaddr_storage& mine) {
  if (peer.ss_family != mine.ss_family) return false;
  if (peer.ss_family == AF_INET) {
    const auto* p = reinterpret_cast<const sockaddr_in*>(&peer);
    const auto* m = reinterpret_cast<const sockaddr_in*>(&mine);
    if ((ntohl(p->sin_addr.s_addr) >> 24) == 127) return true;
    return p->sin_addr.s_addr == m->sin_addr.s_addr;
  }
  if (peer.ss_family == AF_INET6) {
    const auto* p = reinterpret_cast<const sockaddr_in6*>(&peer);
    const auto* m = reinterpret_cast<const sockaddr_in6*>(&mine);
    if (IN6_IS_ADDR_LOOPBACK(&p->sin6_addr)) return true;
    return std::memcmp(&p->sin6_addr, &m->sin6_addr, 16) == 0;
  }
  return false;
}

}  // namespace

Result<uint32_t> LocalPeerUid(int fd) {
  sockaddr_storage peer{}, mine{};
  socklen_t pl = sizeof(peer), ml = sizeof(mine);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &pl) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&mine), &ml) != 0) {
    return NotFoundError(std::string("no peer address: ") +
                         std::strerror(errno));
  }
  if (!SameHostAddress(peer, mine)) {
    return NotFoundError("the peer is on another host");
  }
  // The peer's socket has local = peer address and remote = ours.
  const std::string want_local = ProcNetAddress(peer);
  const std::string want_remote = ProcNetAddress(mine);
  const char* table =
      peer.ss_family == AF_INET ? "/proc/net/tcp" : "/proc/net/tcp6";
  std::ifstream in(table);
  std::string line;
  std::getline(in, line);  // header
  while (std::getline(in, line)) {
    std::istringstream f(line);
    std::string slot, local, remote, state, queues, timer, retr;
    uint32_t uid = 0;
    if (!(f >> slot >> local >> remote >> state >> queues >> timer >> retr >>
          uid)) {
      continue;
    }
    if (local == want_local && remote == want_remote) return uid;
  }
  return NotFoundError("the peer's socket is not in " + std::string(table));
}

}  // namespace membox::transport::net
