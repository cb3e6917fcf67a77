// service::Client: one connection from a worker (or a peer node) to one
// service node, and the only place membox matches replies to requests.
//
// Failure policy, the same for every service: when the channel fails, or a
// reply is malformed (bad envelope, unknown request id, or a body the
// service cannot decode -- it then calls Fail), every pending request
// finishes with an error naming the node ("embedding node h:p is
// unreachable: ..."), and later requests fail at once with the same error.
// The channel itself closes with the Client (closing it from the progress
// thread that found the fault would re-enter the transport).
//
// Threading: Send / Call / Fail from any thread. Reply callbacks run on the
// device's progress thread (or inline, in Send, when the client has
// already failed); they must be quick and must not wait on this client.
// Ownership: the Device outlives the Client. The Client owns its channel:
// one Client per (device, endpoint, lane) -- a device has one channel per
// peer and lane.
#ifndef MEMBOX_SERVICE_CLIENT_H_
#define MEMBOX_SERVICE_CLIENT_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "membox/base/mutex.h"
#include "membox/base/status.h"
#include "membox/service/call.h"
#include "membox/service/envelope.h"
#include "membox/transport/device.h"

namespace membox::service {

// A reply: the status (an error names the node) and, when ok, the body.
// The body is valid during the callback only.
using ReplyFn =
    std::function<void(const Status& status, std::span<const uint8_t> body)>;
using NoticeFn =
    std::function<void(uint16_t method, std::span<const uint8_t> body)>;

struct ClientOptions {
  std::string node_kind = "node";  // "memory node", "proxy", ... in errors
  // How errors name the node; empty: node_kind + " " + endpoint.
  std::string name;
  int lane = 0;
  NoticeFn on_notice;  // messages the node sends unasked; may be empty
  // Runs once when the client fails (its error), on the thread that found
  // the failure (often the progress thread: queue, do not block).
  std::function<void(const Status&)> on_failure;
};

class Client {
 public:
  // Connects (the transport's authenticated handshake) to `endpoint`.
  static Result<std::unique_ptr<Client>> Connect(transport::Device& device,
                                                 const std::string& endpoint,
                                                 ClientOptions options);
  // The same over a channel already connected (e.g. one wrapped by the
  // fault / link model of transport/fault_channel.h).
  static std::unique_ptr<Client> Over(std::shared_ptr<transport::Channel> ch,
                                      const std::string& endpoint,
                                      ClientOptions options);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Sends request `method` (msg: a NewMessage buffer with the body
  // appended). `on_reply` runs exactly once.
  void Send(uint16_t method, std::vector<uint8_t> msg, ReplyFn on_reply);
  // Sends and makes `state` finish one part with the reply's status;
  // `on_ok` (optional) consumes an ok reply's body first and may return an
  // error (e.g. DataLoss for a body it cannot decode, which also fails the
  // client).
  void SendPart(
      uint16_t method, std::vector<uint8_t> msg,
      std::shared_ptr<CallState> state,
      std::function<Status(std::span<const uint8_t>)> on_ok = nullptr);
  // Drives this client's channel once (see CallState::set_progress: a
  // waiter that polls picks up a near reply without a wake-up).
  void Progress() { ch_->Progress(); }
  // Sends and waits (spinning briefly first): the reply body, or the error.
  Result<std::vector<uint8_t>> Call(
      uint16_t method, std::vector<uint8_t> msg,
      std::chrono::nanoseconds timeout = kDefaultWaitTimeout);
  // A one-way message (no reply).
  Status Notify(uint16_t method, std::vector<uint8_t> msg);

  // The typed forms: `decode` turns an ok reply's body into a T
  // (Result<T>(std::span<const uint8_t>)). A body it cannot decode fails
  // the client (DataLoss, "sent a bad reply: ...", the failure policy above)
  // and the caller gets that failure. `done` runs exactly once, as
  // on_reply does in Send.
  template <typename T, typename Decode>
  void SendDecoded(uint16_t method, std::vector<uint8_t> msg, Decode decode,
                   std::function<void(Result<T>)> done) {
    Send(method, std::move(msg),
         [this, decode = std::move(decode), done = std::move(done)](
             const Status& s, std::span<const uint8_t> body) {
           if (!s.ok()) return done(s);
           Result<T> r = decode(body);
           done(r.ok() ? std::move(r) : Result<T>(BadReply(r.status())));
         });
  }
  template <typename T, typename Decode>
  Result<T> CallDecoded(
      uint16_t method, std::vector<uint8_t> msg, Decode decode,
      std::chrono::nanoseconds timeout = kDefaultWaitTimeout) {
    ASSIGN_OR_RETURN(std::vector<uint8_t> body,
                     Call(method, std::move(msg), timeout));
    Result<T> r = decode(std::span<const uint8_t>(body));
    if (!r.ok()) return BadReply(r.status());
    return r;
  }
  // Fails the client for a reply body that did not decode (`why`) and
  // returns the resulting failure.
  Status BadReply(const Status& why);

  // Fails the client (see the file comment); `why` is wrapped with the
  // node's name. Idempotent: the first failure stays.
  void Fail(const Status& why);
  // OK, or the failure every request now gets.
  Status health() const;
  // "embedding node h:p"
  const std::string& name() const { return name_; }
  const std::string& endpoint() const { return endpoint_; }
  // For one-sided transfers (Import, Memcpy) next to the requests.
  transport::Channel& channel() { return *ch_; }
  const std::shared_ptr<transport::Channel>& channel_ptr() const { return ch_; }
  size_t pending() const;

 private:
  Client(std::string endpoint, ClientOptions o,
         std::shared_ptr<transport::Channel> ch);
  void OnMessage(const std::vector<uint8_t>& bytes);
  void FailWith(const Status& s);

  const std::string endpoint_;
  const ClientOptions opt_;
  const std::string name_;
  std::shared_ptr<transport::Channel> ch_;
  mutable Mutex mu_;
  uint64_t next_id_ MEMBOX_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, std::pair<uint16_t, ReplyFn>> pending_
      MEMBOX_GUARDED_BY(mu_);
  Status failed_ MEMBOX_GUARDED_BY(mu_);
  std::atomic<bool> closing_{false};
};

}  // namespace membox::service

#endif  // MEMBOX_SERVICE_CLIENT_H_
