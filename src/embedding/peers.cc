#include "src/embedding/peers.h"

#include "membox/base/logging.h"
#include "membox/service/client.h"

#include "src/embedding/protocol.h"

namespace membox::embedding {

using proto::Message;
using proto::Type;

Result<std::unique_ptr<PeerDirectory>> PeerDirectory::Start(
    PeerDirectoryOptions options) {
  if (options.peers.empty() || options.peers.size() > proto::kMaxPlaces) {
    return InvalidArgumentError(
        "the job's embedding nodes: 1 to " + std::to_string(proto::kMaxPlaces) +
        " endpoints, not " + std::to_string(options.peers.size()));
  }
  if (options.place >= options.peers.size()) {
    return InvalidArgumentError(
        "this embedding node's place " + std::to_string(options.place) +
        " is not among the job's " + std::to_string(options.peers.size()) +
        " nodes");
  }
  for (const std::string& p : options.peers) {
    if (p.empty() || p.size() > proto::kMaxName) {
      return InvalidArgumentError("an empty or overlong embedding endpoint");
    }
  }
  std::unique_ptr<PeerDirectory> d(new PeerDirectory(std::move(options)));
  const PeerDirectoryOptions& o = d->opt_;
  const bool moved = !o.endpoint.empty() && o.endpoint != o.peers[o.place];
  {
    MutexLock l(&d->mu_);
    d->where_ = o.peers;
    if (moved) d->where_[o.place] = o.endpoint;
  }
  if (moved && o.peers.size() > 1) {
    transport::DeviceOptions dev;
    // membox's TCP path: an announcement moves no data, and maps no
    // shared memory.
    dev.transports = "tcp";
    dev.secret = o.secret;
    dev.name = "membox-embedding-peers";
    dev.connect_timeout = o.timeout;
    ASSIGN_OR_RETURN(d->device_, transport::Device::Create(dev));
    MEMBOX_LOG_INFO(
        "embedding node {} listens at {}, not {}: telling its {} peers",
        o.place, o.endpoint, o.peers[o.place], o.peers.size() - 1);
    PeerDirectory* self = d.get();
    d->announcer_ = std::thread([self] { self->Announce(); });
  }
  return d;
}

PeerDirectory::~PeerDirectory() { Stop(); }

void PeerDirectory::Stop() {
  {
    MutexLock l(&mu_);
    stop_ = true;
  }
  cv_.NotifyAll();
  if (announcer_.joinable()) announcer_.join();
  device_.reset();
}

std::string PeerDirectory::Where(uint32_t place) const {
  MutexLock l(&mu_);
  return place < where_.size() ? where_[place] : std::string();
}

Status PeerDirectory::Set(uint32_t place, const std::string& endpoint) {
  if (place >= opt_.peers.size()) {
    return InvalidArgumentError("no embedding node in place " +
                                std::to_string(place) + " (the job has " +
                                std::to_string(opt_.peers.size()) + ")");
  }
  if (place == opt_.place) {
    return FailedPreconditionError(
        "place " + std::to_string(place) +
        " is this node's own: another node announced itself in it");
  }
  if (endpoint.empty() || endpoint.size() > proto::kMaxName) {
    return InvalidArgumentError("an empty or overlong endpoint");
  }
  MutexLock l(&mu_);
  if (where_[place] != endpoint) {
    MEMBOX_LOG_INFO("embedding node {} moved from {} to {} (it says)", place,
                    where_[place], endpoint);
    where_[place] = endpoint;
  }
  return Status::Ok();
}

size_t PeerDirectory::announced() const {
  MutexLock l(&mu_);
  return announced_;
}

void PeerDirectory::Announce() {
  const auto until = std::chrono::steady_clock::now() + opt_.announce_for;
  std::vector<bool> told(opt_.peers.size(), false);
  told[opt_.place] = true;
  for (;;) {
    size_t left = 0;
    for (uint32_t p = 0; p < told.size(); ++p) {
      if (told[p]) continue;
      {
        MutexLock l(&mu_);
        if (stop_) return;
      }
      Status s = AnnounceTo(p);
      if (s.ok()) {
        told[p] = true;
        MutexLock l(&mu_);
        announced_++;
      } else {
        left++;
        MEMBOX_LOG_DEBUG("embedding node {} not told yet: {}", p, s.ToString());
      }
    }
    if (left == 0) {
      MEMBOX_LOG_INFO("every embedding peer knows node {} is at {}", opt_.place,
                      opt_.endpoint);
      return;
    }
    if (std::chrono::steady_clock::now() >= until) {
      MEMBOX_LOG_WARN(
          "{} embedding peers did not take node {}'s new address {} in {} s "
          "(dead too?); their clients find it through the others",
          left, opt_.place, opt_.endpoint, opt_.announce_for.count() / 1000);
      return;
    }
    MutexLock l(&mu_);
    if (stop_) return;
    cv_.WaitFor(&mu_, opt_.retry_every);
    if (stop_) return;
  }
}

Status PeerDirectory::AnnounceTo(uint32_t place) {
  service::ClientOptions co;
  co.node_kind = "embedding node";
  ASSIGN_OR_RETURN(
      auto c, service::Client::Connect(*device_, Where(place), std::move(co)));
  auto decode = [](std::span<const uint8_t> b) {
    return proto::Decode(static_cast<uint16_t>(Type::kReply), b);
  };
  Message h;
  h.type = Type::kHello;
  h.name = "embedding node " + std::to_string(opt_.place) + " (announcing)";
  RETURN_IF_ERROR(c->CallDecoded<Message>(static_cast<uint16_t>(h.type),
                                          proto::Encode(h), decode,
                                          opt_.timeout)
                      .status());
  Message a;
  a.type = Type::kAnnounce;
  a.table_id = opt_.place;
  a.name = opt_.endpoint;
  return c
      ->CallDecoded<Message>(static_cast<uint16_t>(a.type), proto::Encode(a),
                             decode, opt_.timeout)
      .status();
}

}  // namespace membox::embedding
