#include "membox/service/link.h"

#include <utility>

#include "membox/base/logging.h"

namespace membox::service {

Link::Link(LinkOptions options)
    : opt_(std::move(options)),
      endpoint_(opt_.endpoint),
      failover_(opt_.failover) {}

Link::~Link() { Close(); }

std::string Link::Seconds(std::chrono::milliseconds d) const {
  return std::to_string(
      std::chrono::duration_cast<std::chrono::seconds>(d).count());
}

Result<std::shared_ptr<Client>> Link::Open(uint64_t generation, bool rejoin) {
  if (!opt_.open) return FailedPreconditionError(opt_.name + ": no open hook");
  const std::string where = endpoint();
  ASSIGN_OR_RETURN(std::shared_ptr<transport::Channel> ch, opt_.open(where));
  ClientOptions co = opt_.client;
  co.on_failure = [this, generation,
                   user = std::move(co.on_failure)](const Status& why) {
    if (user) user(why);
    OnFailure(generation, why);
  };
  std::shared_ptr<Client> c = Client::Over(std::move(ch), where, co);
  if (opt_.greet) RETURN_IF_ERROR(opt_.greet(*c, rejoin));
  return c;
}

Status Link::Connect(Clock::time_point retry_until) {
  for (;;) {
    uint64_t generation = 0;
    {
      MutexLock l(&mu_);
      if (closing_) return AbortedError(opt_.name + ": the link is closed");
      generation = ++attempts_;
    }
    auto c = Open(generation, /*rejoin=*/false);
    if (c.ok()) {
      std::shared_ptr<Client> old;  // released after mu_ (see Attempt)
      MutexLock l(&mu_);
      old = std::move(client_);
      client_ = std::move(*c);
      generation_ = generation;
      return Status::Ok();
    }
    if (c.status().code() != StatusCode::kUnavailable ||
        Clock::now() >= retry_until) {
      return c.status();
    }
    std::this_thread::sleep_for(opt_.retry_every);
  }
}

void Link::set_failover(std::chrono::milliseconds failover) {
  MutexLock l(&mu_);
  failover_ = failover;
  if (failover_.count() > 0 && client_ &&
      client_->health().code() == StatusCode::kUnavailable) {
    StartReconnectLocked();
  }
}

bool Link::failover() const {
  MutexLock l(&mu_);
  return failover_.count() > 0;
}

void Link::Send(uint16_t method, Encoder encode, ReplyFn on_reply, bool keep) {
  MutexLock order(&order_mu_);
  std::shared_ptr<Client> c;
  Status failed;
  uint64_t id = 0;
  {
    MutexLock l(&mu_);
    if (!gone_.ok()) {
      failed = gone_;
    } else if (keep && failover_.count() > 0) {
      id = next_id_++;
      kept_.emplace(id, std::make_shared<Kept>(Kept{method, std::move(encode),
                                                    std::move(on_reply)}));
      if (down_) return;  // the reconnection sends it
    } else if (down_ || !client_) {
      failed = UnavailableError(opt_.name + " is being reconnected");
    } else {
      c = client_;
    }
  }
  if (!failed.ok()) return on_reply(failed, {});
  if (id != 0) return Transmit({id});
  c->Send(method, encode(), std::move(on_reply));
}

Result<std::vector<uint8_t>> Link::Call(uint16_t method,
                                        std::vector<uint8_t> msg,
                                        std::chrono::nanoseconds timeout) {
  std::shared_ptr<Client> c = client();
  if (!c) return health();
  return c->Call(method, std::move(msg), timeout);
}

std::shared_ptr<Client> Link::client() const {
  MutexLock l(&mu_);
  if (!gone_.ok() || down_) return nullptr;
  return client_;
}

Status Link::health() const {
  MutexLock l(&mu_);
  if (!gone_.ok()) return gone_;
  if (down_) return UnavailableError(opt_.name + " is being reconnected");
  if (!client_) return FailedPreconditionError(opt_.name + ": not connected");
  return client_->health();
}

bool Link::reconnecting() const {
  MutexLock l(&mu_);
  return down_;
}

std::string Link::endpoint() const {
  MutexLock l(&mu_);
  return endpoint_;
}

size_t Link::kept() const {
  MutexLock l(&mu_);
  return kept_.size();
}

void Link::Transmit(const std::vector<uint64_t>& ids) {
  for (uint64_t id : ids) {
    std::shared_ptr<Kept> k;
    std::shared_ptr<Client> c;
    uint64_t generation = 0;
    {
      MutexLock l(&mu_);
      if (down_ || closing_ || !client_) return;
      auto it = kept_.find(id);
      if (it == kept_.end()) continue;
      k = it->second;
      c = client_;
      generation = generation_;
    }
    c->Send(
        k->method, k->encode(),
        [this, id, generation](const Status& s, std::span<const uint8_t> body) {
          OnReply(id, generation, s, body);
        });
  }
}

void Link::OnReply(uint64_t id, uint64_t generation, const Status& s,
                   std::span<const uint8_t> body) {
  std::shared_ptr<Kept> k;
  {
    MutexLock l(&mu_);
    if (generation != generation_) return;  // sent again on a newer link
    auto it = kept_.find(id);
    if (it == kept_.end()) return;
    // The connection is lost, not the request refused: kept. A
    // reconnection under way may already have closed the lost connection
    // (Attempt), whose pending requests fail then: down_ says so.
    const bool lost = down_ || (client_ && client_->health().code() ==
                                               StatusCode::kUnavailable);
    if (!s.ok() && lost && failover_.count() > 0 && !closing_ && gone_.ok()) {
      StartReconnectLocked();
      return;
    }
    k = std::move(it->second);
    kept_.erase(it);
  }
  k->on_reply(s, body);
}

void Link::OnFailure(uint64_t generation, const Status& why) {
  MutexLock l(&mu_);
  if (generation == generation_ && why.code() == StatusCode::kUnavailable) {
    StartReconnectLocked();
  }
}

void Link::StartReconnectLocked() {
  if (down_ || closing_ || !gone_.ok() || failover_.count() == 0 ||
      !opt_.timer) {
    return;
  }
  down_ = true;
  down_since_ = Clock::now();
  tries_ = 0;
  last_ = Status::Ok();
  if (failover_ >= std::chrono::hours(24)) {  // an owner that never gives up
    if (opt_.warn_on_loss) {
      MEMBOX_LOG_WARN("{}: lost {} at {}; reconnecting until it is back",
                      opt_.owner, opt_.name, endpoint_);
    } else {
      MEMBOX_LOG_INFO("{}: lost {} at {}; reconnecting until it is back",
                      opt_.owner, opt_.name, endpoint_);
    }
  } else {
    MEMBOX_LOG_WARN(
        "{}: lost {} at {}; waiting up to {} s for it to come back (its "
        "requests are kept)",
        opt_.owner, opt_.name, endpoint_, Seconds(failover_));
  }
  task_ = opt_.timer->After(std::chrono::nanoseconds(0), [this] { Attempt(); });
}

void Link::Attempt() {
  std::string where;
  uint64_t generation = 0;
  bool expired = false;
  Status last;
  std::shared_ptr<Client> lost;
  {
    MutexLock l(&mu_);
    task_ = 0;
    if (closing_ || !down_) {
      cv_.NotifyAll();
      return;
    }
    attempting_ = true;  // Close waits for this attempt
    expired = Clock::now() - down_since_ >= failover_;
    last = last_;
    generation = ++attempts_;
    where = endpoint_;
    lost = std::move(client_);
  }
  // The lost connection is closed before a new one is opened, outside mu_
  // (closing reports its failure to OnFailure, which takes mu_, and finds
  // the Link down). One its owner failed (Client::Fail) still has its
  // channel open: the device would hand that channel out again.
  lost.reset();
  if (expired) {
    GiveUp(last, /*refused=*/false);
    return Finished();
  }
  auto c = Open(generation, /*rejoin=*/true);
  if (!c.ok()) {
    const std::string moved = opt_.resolve ? opt_.resolve(where) : "";
    const bool give_up = c.status().code() == StatusCode::kFailedPrecondition;
    {
      MutexLock l(&mu_);
      last_ = c.status();
      if (!moved.empty() && moved != endpoint_) {
        MEMBOX_LOG_WARN("{}: {} moved from {} to {} (its peers say)",
                        opt_.owner, opt_.name, endpoint_, moved);
        endpoint_ = moved;
      }
      if (!closing_ && !give_up) {
        task_ = opt_.timer->After(opt_.retry_every, [this] { Attempt(); });
      }
    }
    if (give_up) GiveUp(c.status(), /*refused=*/true);
    return Finished();
  }
  std::shared_ptr<Client> fresh = std::move(*c);
  size_t resent = 0;
  {
    // Installs the connection and sends what was kept, in order, before
    // any later request (order_mu_).
    MutexLock order(&order_mu_);
    std::vector<uint64_t> ids;
    // The connection this one replaces is released outside mu_: one
    // failed by its owner (Client::Fail) still has its channel open, and
    // closing it reports the failure to OnFailure, which takes mu_.
    std::shared_ptr<Client> old;
    {
      MutexLock l(&mu_);
      if (!closing_) {
        old = std::move(client_);
        client_ = std::move(fresh);
        generation_ = generation;
        down_ = false;
        for (const auto& [id, k] : kept_) ids.push_back(id);
      }
    }
    Transmit(ids);
    resent = ids.size();
  }
  // Not installed (the Link is closing): closed now, while Close still
  // waits for this attempt (the transport device may go right after).
  fresh.reset();
  MutexLock l(&mu_);
  attempting_ = false;
  cv_.NotifyAll();
  if (closing_ || !client_) return;
  MEMBOX_LOG_WARN(
      "{}: {} at {} is back after {:.2f} s; {} request(s) sent again",
      opt_.owner, opt_.name, endpoint_,
      std::chrono::duration<double>(Clock::now() - down_since_).count(),
      resent);
  // It failed before it was installed (that failure was not taken for the
  // installed connection's).
  if (client_->health().code() == StatusCode::kUnavailable) {
    StartReconnectLocked();
  }
}

void Link::Finished() {
  MutexLock l(&mu_);
  attempting_ = false;
  cv_.NotifyAll();
}

void Link::GiveUp(const Status& last, bool refused) {
  std::map<uint64_t, std::shared_ptr<Kept>> kept;
  Status gone;
  {
    MutexLock l(&mu_);
    gone = UnavailableError(
        refused
            ? opt_.name + " at " + endpoint_ +
                  " came back but cannot be rejoined: " +
                  std::string(last.message())
            : opt_.name + " at " + endpoint_ + " did not come back within " +
                  Seconds(failover_) + " s (last: " + last.ToString() + ")");
    if (gone_.ok()) gone_ = gone;
    down_ = false;
    kept.swap(kept_);
  }
  MEMBOX_LOG_ERROR("{}: {}", opt_.owner, gone.ToString());
  for (auto& [id, k] : kept) k->on_reply(gone, {});
}

void Link::Close(const std::string& why) {
  std::shared_ptr<Client> c;
  std::map<uint64_t, std::shared_ptr<Kept>> kept;
  Status aborted = AbortedError(opt_.name + ": " + why);
  {
    MutexLock l(&mu_);
    closing_ = true;
    if (task_ != 0 && opt_.timer->Cancel(task_)) task_ = 0;
    // An attempt under way (or taken off the timer, about to start)
    // finishes first; one the timer dropped (stopped) never starts.
    while (attempting_ || (task_ != 0 && opt_.timer->Has(task_))) {
      cv_.WaitFor(&mu_, std::chrono::milliseconds(10));
    }
    c = std::move(client_);
    kept.swap(kept_);
    if (gone_.ok()) gone_ = aborted;
    down_ = false;
  }
  c.reset();  // pending calls fail (kept ones are already taken)
  for (auto& [id, k] : kept) k->on_reply(aborted, {});
}

}  // namespace membox::service
