#include "src/embedding/replicator.h"

#include "membox/base/logging.h"

namespace membox::embedding {

using proto::Message;
using proto::Type;

// Effectively for ever: the backup is waited for as long as this node runs.
constexpr std::chrono::milliseconds kForever = std::chrono::hours(24 * 365);

Result<std::unique_ptr<Replicator>> Replicator::Start(
    ReplicatorOptions options) {
  if (options.backup.empty()) {
    return InvalidArgumentError("a replicator needs the backup's endpoint");
  }
  std::unique_ptr<Replicator> r(new Replicator(std::move(options)));
  transport::DeviceOptions d;
  d.transports = r->opt_.transports;
  d.secret = r->opt_.secret;
  d.name = "membox-embedding-replica-" + r->opt_.origin;
  d.connect_timeout = r->opt_.timeout;
  // Its progress thread shares the node's cores with the event loop that
  // feeds it (as the server's own device does).
  d.sleep_on_worker_lock = true;
  ASSIGN_OR_RETURN(r->device_, transport::Device::Create(d));
  service::LinkOptions lo;
  lo.name = "backup embedding node " + r->opt_.backup;
  lo.owner = "embedding node " + r->opt_.origin;
  lo.endpoint = r->opt_.backup;
  lo.client.node_kind = "embedding node";
  lo.retry_every = r->opt_.retry_every;
  // Every job's end takes the backup away; Send warns when it matters (a
  // push answered without its copy).
  lo.warn_on_loss = false;
  lo.timer = &r->timer_;
  lo.open = [device = r->device_.get()](const std::string& ep) {
    return device->GetChannel(ep);
  };
  lo.resolve = r->opt_.resolve;
  Replicator* self = r.get();
  lo.greet = [self](service::Client& c, bool rejoin) {
    return self->Greet(c, rejoin);
  };
  r->link_ = std::make_unique<service::Link>(std::move(lo));
  r->timer_.After(std::chrono::nanoseconds(0), [self] { self->Attempt(); });
  r->timer_.After(r->opt_.stall_timeout / 4, [self] { self->Watch(); });
  return r;
}

void Replicator::Stop() {
  link_->Close("embedding node stopping");
  timer_.Stop();
}

Replicator::~Replicator() {
  Stop();
  link_.reset();
  device_.reset();
}

void Replicator::Attempt() {
  Status s = link_->Connect();
  if (s.ok()) {
    // From now on the Link reconnects by itself; Greet says when.
    link_->set_failover(kForever);
    return;
  }
  if (s.code() == StatusCode::kAborted) return;  // closing
  MEMBOX_LOG_DEBUG("backup {} not reachable yet: {}", opt_.backup,
                   s.ToString());
  timer_.After(opt_.retry_every, [this] { Attempt(); });
}

Status Replicator::Greet(service::Client& c, bool rejoin) {
  Message h;
  h.type = Type::kHello;
  h.name = "embedding node " + opt_.origin + " (its replica)";
  ASSIGN_OR_RETURN(Message greeted,
                   c.CallDecoded<Message>(
                       static_cast<uint16_t>(h.type), proto::Encode(h),
                       [](std::span<const uint8_t> b) {
                         return proto::Decode(
                             static_cast<uint16_t>(Type::kReply), b);
                       },
                       opt_.timeout));
  incarnation_ = greeted.floor;
  MEMBOX_LOG_INFO("backup {} {}: this node's rows go there", c.endpoint(),
                  rejoin ? "is back" : "connected");
  // Up once the link has taken this connection, after this greeting
  // returns (the next task of the timer that runs it): a copy or a resync
  // sent before that would fail as "being reconnected".
  timer_.After(std::chrono::nanoseconds(0), [this] {
    greetings_++;
    up_ = true;
    if (opt_.on_connected) opt_.on_connected();
  });
  return Status::Ok();
}

int64_t Replicator::Now() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void Replicator::Watch() {
  const auto waited = std::chrono::nanoseconds(Now() - progress_ns_.load());
  if (in_flight_.load() > 0 && waited > opt_.stall_timeout) {
    if (std::shared_ptr<service::Client> c = link_->client()) {
      MEMBOX_LOG_WARN(
          "backup {} answered none of {} copies in {} ms: taken as lost "
          "(pushes are answered without it until it is back and resynced)",
          opt_.backup, in_flight_.load(),
          std::chrono::duration_cast<std::chrono::milliseconds>(waited)
              .count());
      progress_ns_ = Now();
      c->Fail(UnavailableError("no copy answered in " +
                               std::to_string(opt_.stall_timeout.count()) +
                               " ms"));
    }
  }
  timer_.After(opt_.stall_timeout / 4, [this] { Watch(); });
}

void Replicator::Send(Message m,
                      std::function<void(const Status&, const Message&)> done) {
  auto msg = std::make_shared<Message>(std::move(m));
  if (in_flight_.fetch_add(1) == 0) progress_ns_ = Now();
  // The connection it goes on: a copy that fails with an earlier one (its
  // answer comes late) says nothing of the one that replaced it.
  const uint64_t on = greetings_.load();
  link_->Send(
      static_cast<uint16_t>(Type::kReplicate),
      [msg] { return proto::Encode(*msg); },
      [this, msg, on, done = std::move(done)](const Status& s,
                                              std::span<const uint8_t>) {
        progress_ns_ = Now();
        in_flight_--;
        if (s.code() == StatusCode::kUnavailable && greetings_.load() == on) {
          up_ = false;
        }
        done(s, *msg);
      },
      /*keep=*/false);
}

bool Replicator::connected() const { return up_ && link_->health().ok(); }

}  // namespace membox::embedding
