// Listener: membox's connections before they are channels, and the watch on
// UCX channels' connections after (the listener and loop of the TCP
// backend, as gloo's tcp/ has them; docs/design/transport.md).
//
// One network thread (epoll) does all of it:
//   accept     takes connections from the listening socket (out of
//              descriptors: accepts with a spare one and closes, so the
//              listener does not stay readable forever);
//   handshake  runs the first step of the handshake (handshake.h): reads
//              the ClientHello, answers a ServerChallenge with a fresh
//              nonce, reads the ClientProof, and hands the connection with
//              its nonces and proof to the ProofHandler, which checks the
//              proof, sends the verdict and makes the channel. Each
//              connection has a deadline, and at most max_pending may be in
//              the handshake at once: a new one evicts the oldest, so an
//              idle flood cannot lock out clients that complete it. Nothing
//              reaches the handler before a well-formed proof frame.
//   watch      a connection whose data moves elsewhere (UCX) stays open as
//              its liveness detector: any event on it (close, reset, or
//              bytes after the handshake) calls its `lost` callback once.
//
// Ownership: owns the listening socket, the epoll and wake descriptors and
// the connections in the handshake. A watched descriptor stays its owner's:
// the owner calls Forget before closing it.
// Threading: Start() starts the thread, Stop() (or the destructor) stops and
// joins it.
// The ProofHandler and the `lost` callbacks run on it, without the
// listener's lock: they must not call the listener's destructor. Watch and
// Forget may be called from any thread, the handler included.
#ifndef MEMBOX_SRC_TRANSPORT_NET_LISTENER_H_
#define MEMBOX_SRC_TRANSPORT_NET_LISTENER_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <thread>

#include "membox/base/mutex.h"
#include "membox/base/status.h"

#include "src/transport/net/handshake.h"
#include "src/transport/net/socket.h"

namespace membox::transport::net {

class Listener {
 public:
  struct Options {
    std::string name;            // in log lines
    std::string listen_address;  // "host:port"; empty: watch only
    int max_pending = 256;       // connections in the handshake at once
    std::chrono::milliseconds handshake_timeout{5000};
  };
  // A connection whose ClientProof arrived, taken out of the listener.
  struct Handshake {
    Fd fd;  // non-blocking; closed unless the handler moves it out
    Nonce client_nonce{};
    Nonce server_nonce{};
    ClientProof proof;
  };
  using ProofHandler = std::function<void(Handshake&)>;

  Listener(Options options, ProofHandler on_proof);
  ~Listener();
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;

  // Binds the listening socket (if any) and starts the network thread.
  Status Start();
  // Stops and joins the network thread; connections in the handshake are
  // closed. Watch and Forget stay callable (they change nothing then).
  // Idempotent; the destructor calls it.
  void Stop();
  // "host:port" actually bound; empty without a listen address.
  const std::string& endpoint() const { return endpoint_; }

  // Calls `lost` once on the network thread when `fd` closes, resets or
  // becomes readable. The descriptor must stay open until Forget(fd).
  void Watch(int fd, std::function<void()> lost);
  void Forget(int fd);

  // Connections in the handshake now (network thread's count; tests).
  size_t pending() const { return pending_count_.load(); }

 private:
  struct Pending {
    Fd fd;
    FrameReader reader{kMaxHelloFrame};
    bool challenged = false;  // the ServerChallenge went out
    Nonce client_nonce{};
    Nonce server_nonce{};
    std::chrono::steady_clock::time_point deadline;
    uint64_t seq = 0;  // arrival order, for eviction
  };
  struct Watched {
    int fd;
    std::function<void()> lost;
  };
  void Loop();
  void AcceptConnections();
  void OnPendingReadable(uint64_t token);
  // Handles one complete frame; false drops the connection.
  bool Advance(uint64_t token, Pending& p);
  void DropPending(uint64_t token, const char* why);
  void ExpirePending();
  void OnWatchedEvent(uint64_t token);

  const Options options_;
  const ProofHandler on_proof_;
  std::string endpoint_;
  Fd listen_fd_;
  Fd epoll_fd_;
  Fd wake_fd_;
  Fd spare_fd_;  // released to accept-and-close when out of descriptors
  std::thread thread_;
  std::atomic<bool> stop_{false};
  // Network thread only.
  uint64_t next_token_ = 16;
  uint64_t next_seq_ = 0;
  std::map<uint64_t, Pending> pending_;
  std::atomic<size_t> pending_count_{0};
  // Watched connections. The peek and the forgetting of a watched
  // descriptor happen under mu_, and its owner forgets it (under mu_)
  // before closing it: the descriptor cannot be closed, and its number
  // reused by another connection, in between.
  Mutex mu_;
  uint64_t next_watch_token_ MEMBOX_GUARDED_BY(mu_) = uint64_t{1} << 62;
  std::map<int, uint64_t> watch_tokens_ MEMBOX_GUARDED_BY(mu_);  // fd->token
  std::map<uint64_t, Watched> watched_ MEMBOX_GUARDED_BY(mu_);
};

}  // namespace membox::transport::net

#endif  // MEMBOX_SRC_TRANSPORT_NET_LISTENER_H_
