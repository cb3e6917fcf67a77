// service::Link: a service client that survives a lost connection -- the
// one reconnect path of membox's worker side (the parameter client's links
// to its proxies, the embedding client's to its nodes).
//
// A Link holds one service::Client at a time. Requests sent with `keep`
// are kept until answered. When the connection is lost (the client fails
// with kUnavailable) and failover is on, the Link -- on its Timer, not a
// thread of its own -- tries again every `retry_every`: it asks where the
// node is now (the `resolve` hook), opens a channel there (`open`), says
// hello and replays what the node must be told again (`greet`, rejoining),
// and then sends the kept requests again, in the order they were first
// sent, before any later one. A node not back within `failover` fails
// every kept request, and every later one, with one error naming it.
// Without failover (failover == 0) a lost connection fails what is pending
// and the Link stays failed.
//
// Requests are encoded when they are sent, and again for each resend (a
// rejoined node may have given the owner new ids to put in them).
//
// Threading: Send / Call / client / health / Close from any thread. Reply
// callbacks run on the device's progress thread, on the Timer's thread
// (a request failed at the deadline), or inline in Send (a failed Link);
// they must be quick and must not wait on this Link. The hooks run on the
// Timer's thread (and `open` / `greet` in Connect's caller) with no lock of
// the Link held; `encode` runs with the Link's send order held: it must
// not call into the Link. Ownership: the options' timer (and whatever the
// hooks reach, e.g. the transport Device) outlive the Link; Close (or the
// destructor) cancels the reconnection, waits for one under way, and fails
// what is kept with kAborted.
#ifndef MEMBOX_SERVICE_LINK_H_
#define MEMBOX_SERVICE_LINK_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "membox/base/mutex.h"
#include "membox/base/status.h"
#include "membox/base/timer.h"
#include "membox/service/client.h"
#include "membox/transport/channel.h"

namespace membox::service {

struct LinkOptions {
  // How logs and errors name the node: "proxy 1", "embedding node h:p".
  std::string name;
  // Who holds the link, in logs: "worker rank 3".
  std::string owner = "client";
  // Where the node listens first.
  std::string endpoint;
  // For each connection; the Link sets on_failure (the user's, if any,
  // runs too).
  ClientOptions client;
  // How long a lost node may take to come back; 0: no reconnection.
  std::chrono::milliseconds failover{0};
  std::chrono::milliseconds retry_every{50};
  // Runs the reconnection attempts; required when failover is set (now or
  // later, set_failover). Outlives the Link.
  Timer* timer = nullptr;

  // Opens a channel to `endpoint` (Device::GetChannel; perhaps wrapped with
  // a link model). Required.
  std::function<Result<std::shared_ptr<transport::Channel>>(
      const std::string& endpoint)>
      open;
  // Says hello on a new connection and, when `rejoin`, replays what the
  // node must be told again; synchronous calls on `c`. An error fails the
  // attempt; kFailedPrecondition gives up at once (the node came back
  // without what it must have). Optional.
  std::function<Status(Client& c, bool rejoin)> greet;
  // Where the node listens now, asked after a failed attempt (a
  // replacement on another host); empty, or `last`: not moved. Optional.
  std::function<std::string(const std::string& last)> resolve;
  // A lost connection is logged as a warning; false: as information, for
  // owners that say themselves what the loss means (a node's link to its
  // backup, which goes away whenever a job ends).
  bool warn_on_loss = true;
};

class Link {
 public:
  using Clock = std::chrono::steady_clock;
  // Encodes a request (a NewMessage buffer with the body appended).
  using Encoder = std::function<std::vector<uint8_t>()>;

  explicit Link(LinkOptions options);
  ~Link();
  Link(const Link&) = delete;
  Link& operator=(const Link&) = delete;

  // The first connection: open, then greet (not rejoining). Retries a lost
  // connection (kUnavailable) on a new one until `retry_until`.
  Status Connect(Clock::time_point retry_until = {});

  // Turns reconnection on (or off, with 0) -- for owners that learn from
  // the hello whether the node can be rejoined. Needs options.timer.
  void set_failover(std::chrono::milliseconds failover);
  bool failover() const;

  // Sends request `method`. With `keep` and failover on, the request is
  // kept until answered and sent again after a reconnection; otherwise a
  // lost connection fails it, and while reconnecting it fails at once
  // (kUnavailable). `on_reply` runs exactly once.
  void Send(uint16_t method, Encoder encode, ReplyFn on_reply,
            bool keep = true);
  // Sends (not kept) and waits: the reply body, or the error.
  Result<std::vector<uint8_t>> Call(
      uint16_t method, std::vector<uint8_t> msg,
      std::chrono::nanoseconds timeout = kDefaultWaitTimeout);

  // The connection now; null while reconnecting or after failing for good.
  std::shared_ptr<Client> client() const;
  // OK; kUnavailable while reconnecting; the error that ended the Link.
  Status health() const;
  bool reconnecting() const;
  // Where the node listens (as resolved).
  std::string endpoint() const;
  const std::string& name() const { return opt_.name; }
  // Requests kept (sent and unanswered, or waiting for a reconnection).
  size_t kept() const;

  // Stops reconnecting, fails what is kept with kAborted (`why`), closes
  // the connection. Idempotent.
  void Close(const std::string& why = "closed");

 private:
  struct Kept {
    uint16_t method = 0;
    Encoder encode;
    ReplyFn on_reply;
  };

  // A new connection to endpoint(), numbered `generation`, greeted.
  Result<std::shared_ptr<Client>> Open(uint64_t generation, bool rejoin);
  void OnFailure(uint64_t generation, const Status& why);
  void OnReply(uint64_t id, uint64_t generation, const Status& s,
               std::span<const uint8_t> body);
  void StartReconnectLocked() MEMBOX_REQUIRES(mu_);
  void Attempt();
  // An attempt is over (Close may go on).
  void Finished();
  // Fails what is kept, for good: the window passed, or the node came back
  // and refused the rejoin (`refused`).
  void GiveUp(const Status& last, bool refused);
  // Sends kept requests `ids`, in order, on the connection now. With
  // order_mu_ held.
  void Transmit(const std::vector<uint64_t>& ids) MEMBOX_REQUIRES(order_mu_);
  std::string Seconds(std::chrono::milliseconds d) const;

  const LinkOptions opt_;
  // Held while requests are numbered and sent (Send, the resend after a
  // reconnection), so the node sees them in order; taken before mu_.
  Mutex order_mu_;
  mutable Mutex mu_;
  CondVar cv_;
  std::string endpoint_ MEMBOX_GUARDED_BY(mu_);
  std::shared_ptr<Client> client_ MEMBOX_GUARDED_BY(mu_);
  // The installed connection's number; every attempt takes a new one, so a
  // failed attempt's connection failing later is not taken for this one.
  uint64_t generation_ MEMBOX_GUARDED_BY(mu_) = 0;
  uint64_t attempts_ MEMBOX_GUARDED_BY(mu_) = 0;
  std::chrono::milliseconds failover_ MEMBOX_GUARDED_BY(mu_);
  bool down_ MEMBOX_GUARDED_BY(mu_) = false;        // reconnecting
  bool attempting_ MEMBOX_GUARDED_BY(mu_) = false;  // Attempt running
  bool closing_ MEMBOX_GUARDED_BY(mu_) = false;
  Status gone_ MEMBOX_GUARDED_BY(mu_);  // failed for good
  Clock::time_point down_since_ MEMBOX_GUARDED_BY(mu_);
  Status last_ MEMBOX_GUARDED_BY(mu_);  // the last attempt's error
  size_t tries_ MEMBOX_GUARDED_BY(mu_) = 0;
  Timer::TaskId task_ MEMBOX_GUARDED_BY(mu_) = 0;
  std::map<uint64_t, std::shared_ptr<Kept>> kept_ MEMBOX_GUARDED_BY(mu_);
  uint64_t next_id_ MEMBOX_GUARDED_BY(mu_) = 1;
};

}  // namespace membox::service

#endif  // MEMBOX_SERVICE_LINK_H_
