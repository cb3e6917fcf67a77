#include "src/transport/net/listener.h"

#include <cerrno>
#include <vector>

#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "membox/base/logging.h"

namespace membox::transport::net {
namespace {
constexpr uint64_t kListenToken = 1;
constexpr uint64_t kWakeToken = 2;
}  // namespace

Listener::Listener(Options options, ProofHandler on_proof)
    : options_(std::move(options)), on_proof_(std::move(on_proof)) {}

Listener::~Listener() { Stop(); }

void Listener::Stop() {
  if (thread_.joinable()) {
    stop_.store(true);
    uint64_t one = 1;
    (void)!write(wake_fd_.get(), &one, sizeof(one));
    thread_.join();
  }
  pending_.clear();
  pending_count_.store(0);
  listen_fd_.reset();
}

Status Listener::Start() {
  if (!options_.listen_address.empty()) {
    ASSIGN_OR_RETURN(listen_fd_, Listen(options_.listen_address, &endpoint_));
    MEMBOX_LOG_DEBUG("{} listening on {}", options_.name, endpoint_);
  }
  epoll_fd_.reset(epoll_create1(EPOLL_CLOEXEC));
  wake_fd_.reset(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  spare_fd_.reset(open("/dev/null", O_RDONLY | O_CLOEXEC));
  if (!epoll_fd_ || !wake_fd_) return InternalError("epoll/eventfd failed");
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = kWakeToken;
  epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, wake_fd_.get(), &ev);
  if (listen_fd_) {
    ev.data.u64 = kListenToken;
    epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, listen_fd_.get(), &ev);
  }
  thread_ = std::thread([this] { Loop(); });
  return Status::Ok();
}

void Listener::Loop() {
  epoll_event evs[64];
  while (!stop_.load()) {
    int timeout_ms = pending_.empty() ? 1000 : 100;
    int n = epoll_wait(epoll_fd_.get(), evs, 64, timeout_ms);
    for (int i = 0; i < n; ++i) {
      uint64_t token = evs[i].data.u64;
      if (token == kWakeToken) {
        uint64_t v;
        (void)!read(wake_fd_.get(), &v, sizeof(v));
      } else if (token == kListenToken) {
        AcceptConnections();
      } else if (pending_.count(token)) {
        OnPendingReadable(token);
      } else {
        OnWatchedEvent(token);
      }
    }
    ExpirePending();
    pending_count_.store(pending_.size());
  }
}

void Listener::OnWatchedEvent(uint64_t token) {
  // Any event means the connection closed, reset, or the peer broke
  // protocol by sending after the handshake.
  std::function<void()> lost;
  {
    MutexLock l(&mu_);
    auto it = watched_.find(token);
    if (it == watched_.end()) return;
    const int fd = it->second.fd;
    char c;
    ssize_t r = recv(fd, &c, 1, MSG_DONTWAIT | MSG_PEEK);
    if (r < 0 && (errno == EAGAIN || errno == EINTR)) return;
    lost = std::move(it->second.lost);
    watched_.erase(it);
    watch_tokens_.erase(fd);
    epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, fd, nullptr);
  }
  if (lost) lost();
}

void Listener::Watch(int fd, std::function<void()> lost) {
  MutexLock l(&mu_);
  uint64_t token = next_watch_token_++;  // never a pending token
  watched_[token] = Watched{fd, std::move(lost)};
  watch_tokens_[fd] = token;
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP;
  ev.data.u64 = token;
  epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, fd, &ev);
}

void Listener::Forget(int fd) {
  if (fd < 0) return;
  MutexLock l(&mu_);
  auto it = watch_tokens_.find(fd);
  if (it == watch_tokens_.end()) return;
  watched_.erase(it->second);
  watch_tokens_.erase(it);
  epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, fd, nullptr);
}

void Listener::AcceptConnections() {
  for (;;) {
    int fd = accept4(listen_fd_.get(), nullptr, nullptr,
                     SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if ((errno == EMFILE || errno == ENFILE) && spare_fd_) {
        // Out of descriptors: take the connection with the spare one and
        // close it, so the listener does not stay readable forever.
        spare_fd_.reset();
        int victim = accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC);
        if (victim >= 0) close(victim);
        spare_fd_.reset(open("/dev/null", O_RDONLY | O_CLOEXEC));
        MEMBOX_LOG_WARN("{}: out of file descriptors, refused a connection",
                        options_.name);
        continue;
      }
      return;  // EAGAIN, or an error that a later wake-up retries
    }
    TuneStream(fd);
    if (pending_.size() >= static_cast<size_t>(options_.max_pending)) {
      // Evict the oldest half-open connection: idle floods cannot lock out
      // the clients that do complete the handshake.
      auto oldest = pending_.begin();
      for (auto it = pending_.begin(); it != pending_.end(); ++it) {
        if (it->second.seq < oldest->second.seq) oldest = it;
      }
      DropPending(oldest->first, "too many connections in handshake");
    }
    uint64_t token = next_token_++;
    Pending p;
    p.fd.reset(fd);
    p.deadline = std::chrono::steady_clock::now() + options_.handshake_timeout;
    p.seq = next_seq_++;
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP;
    ev.data.u64 = token;
    if (epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, fd, &ev) != 0) continue;
    pending_.emplace(token, std::move(p));
  }
}

void Listener::DropPending(uint64_t token, const char* why) {
  auto it = pending_.find(token);
  if (it == pending_.end()) return;
  MEMBOX_LOG_DEBUG("{}: dropping connection from {}: {}", options_.name,
                   PeerName(it->second.fd.get()), why);
  epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, it->second.fd.get(), nullptr);
  pending_.erase(it);
}

void Listener::ExpirePending() {
  auto now = std::chrono::steady_clock::now();
  std::vector<uint64_t> late;
  for (auto& [token, p] : pending_) {
    if (now >= p.deadline) late.push_back(token);
  }
  for (uint64_t t : late) DropPending(t, "handshake timed out");
}

void Listener::OnPendingReadable(uint64_t token) {
  for (;;) {
    auto it = pending_.find(token);
    if (it == pending_.end()) return;  // handed over
    Pending& p = it->second;
    auto got = p.reader.ReadFrom(p.fd.get());
    if (!got.ok()) {
      DropPending(token, "handshake failed");
      return;
    }
    if (!*got) return;  // more bytes needed
    if (!Advance(token, p)) {
      DropPending(token, "handshake rejected");
      return;
    }
  }
}

bool Listener::Advance(uint64_t token, Pending& p) {
  if (!p.challenged) {
    auto hello = DecodeClientHello(p.reader.frame());
    if (!hello.ok()) return false;
    p.client_nonce = hello->nonce;
    p.server_nonce = NewNonce();
    // Only a nonce: nothing computed from the secret goes to a peer that
    // has not proven it knows the secret.
    ServerChallenge sc{p.server_nonce};
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::milliseconds(200);
    if (!SendFrame(p.fd.get(), EncodeServerChallenge(sc), deadline).ok()) {
      return false;
    }
    p.challenged = true;
    p.reader.Reset(kMaxProofFrame);
    return true;
  }
  auto proof = DecodeClientProof(p.reader.frame());
  if (!proof.ok()) return false;
  Handshake h;
  h.fd = std::move(p.fd);
  h.client_nonce = p.client_nonce;
  h.server_nonce = p.server_nonce;
  h.proof = std::move(*proof);
  epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, h.fd.get(), nullptr);
  pending_.erase(token);
  on_proof_(h);
  return true;
}

}  // namespace membox::transport::net
