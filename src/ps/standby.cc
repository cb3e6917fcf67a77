// A standby node's watch over a job's proxies (include/membox/ps/standby.h).
#include "membox/ps/standby.h"

#include <algorithm>
#include <memory>
#include <random>
#include <thread>

#include "membox/base/logging.h"
#include "membox/service/client.h"
#include "membox/transport/device.h"

#include "src/ps/protocol.h"

namespace membox::ps {
namespace {

using Clock = std::chrono::steady_clock;

constexpr auto kClaimTimeout = std::chrono::seconds(2);
constexpr auto kSayEvery = std::chrono::seconds(10);

Status CheckOptions(const StandbyOptions& o) {
  if (o.peers.size() < 2 || o.peers.size() > proto::kMaxProxies) {
    return InvalidArgumentError(
        "a standby watches a job of two to " +
        std::to_string(proto::kMaxProxies) +
        " memory nodes (--ps-peers): with one, nothing survives to copy from");
  }
  const size_t colon = o.endpoint.rfind(':');
  const std::string host =
      colon == std::string::npos ? "" : o.endpoint.substr(0, colon);
  const std::string port =
      colon == std::string::npos ? "" : o.endpoint.substr(colon + 1);
  if (host.empty() || port.empty() || port == "0" || host == "0.0.0.0" ||
      host == "[::]" || host == "::" || host == "*") {
    return InvalidArgumentError(
        "a standby needs the address its peers and workers will reach it at "
        "(--ps-listen HOST:PORT, not a wildcard or port 0), got '" +
        o.endpoint + "'");
  }
  if (std::find(o.peers.begin(), o.peers.end(), o.endpoint) != o.peers.end()) {
    return InvalidArgumentError("the standby's address " + o.endpoint +
                                " is one of the job's nodes already");
  }
  if (o.endpoint.size() > proto::kMaxName) {
    return InvalidArgumentError("the standby's address is too long");
  }
  return Status::Ok();
}

class Watch {
 public:
  Watch(const StandbyOptions& o, std::unique_ptr<transport::Device> device)
      : o_(o),
        peers_(o.peers),
        device_(std::move(device)),
        links_(o.peers.size()),
        seen_(o.peers.size(), false) {}

  ~Watch() {
    links_.clear();  // before the device
  }

  Result<uint32_t> Run() {
    MEMBOX_LOG_INFO(
        "standby at {}: watching the {} memory nodes {}; it takes the place "
        "of the first that dies",
        o_.endpoint, peers_.size(), Joined(peers_));
    for (;;) {
      if (o_.stop && o_.stop()) return CancelledError("the standby stopped");
      std::vector<uint32_t> down, up;
      for (uint32_t p = 0; p < peers_.size(); ++p) {
        (Reach(p) ? up : down).push_back(p);
      }
      for (uint32_t r : down) {
        if (up.empty()) break;  // nobody to copy from or to ask
        Result<bool> won = ClaimAt(r, up);
        if (!won.ok()) return won.status();
        if (*won) {
          MEMBOX_LOG_WARN(
              "standby at {}: memory node {} at {} is down; taking its "
              "place (the other nodes agreed)",
              o_.endpoint, r, peers_[r]);
          return r;
        }
      }
      // Jittered: standbys that collided do not collide again in step.
      std::this_thread::sleep_for(o_.poll / 2 +
                                  o_.poll * (rng_() % 1024) / 1024);
    }
  }

 private:
  static std::string Joined(const std::vector<std::string>& v) {
    std::string s;
    for (const auto& e : v) s += (s.empty() ? "" : ",") + e;
    return s;
  }

  // A live link to proxy `p`, made now if there is none.
  bool Reach(uint32_t p) {
    if (links_[p] && links_[p]->health().ok()) return true;
    links_[p].reset();
    service::ClientOptions co;
    co.node_kind = "proxy " + std::to_string(p);
    auto c = service::Client::Connect(*device_, peers_[p], co);
    if (!c.ok()) return false;
    links_[p] = std::move(*c);
    seen_[p] = true;
    return true;
  }

  Status Ask(uint32_t p, uint32_t rank, bool claim) {
    proto::Message m;
    m.type = proto::Type::kClaim;
    m.rank = rank;
    // A node this watch reached and lost: a proxy with no link of its own
    // to it probes it (a node never reached may still be starting).
    m.world = !claim ? 0 : seen_[rank] ? proto::kClaimAfterLoss : 1;
    m.endpoint = o_.endpoint;
    auto body = links_[p]->Call(static_cast<uint16_t>(m.type), proto::Encode(m),
                                kClaimTimeout);
    return body.status();
  }

  // Proxy `r` is up, says proxy `p`: where it is now (a replacement may
  // have taken its place elsewhere), so that the watch follows it.
  void Follow(uint32_t p, uint32_t r) {
    proto::Message m;
    m.type = proto::Type::kWhere;
    m.rank = r;
    auto body = links_[p]->Call(static_cast<uint16_t>(m.type), proto::Encode(m),
                                kClaimTimeout);
    if (!body.ok()) return;
    auto a = proto::Decode(static_cast<uint16_t>(proto::Type::kReply), *body);
    if (!a.ok() || a->text.empty() || a->text == peers_[r]) return;
    MEMBOX_LOG_INFO("standby at {}: memory node {} is at {} now (was {})",
                    o_.endpoint, r, a->text, peers_[r]);
    peers_[r] = a->text;
    links_[r].reset();
    seen_[r] = false;
  }

  // Claims proxy `r`'s place at every proxy in `up`. True: won. False: not
  // now (the claims got are let go). An error: no later poll can win.
  Result<bool> ClaimAt(uint32_t r, const std::vector<uint32_t>& up) {
    std::vector<uint32_t> granted, noted;
    Status refused = Status::Ok();
    uint32_t refuser = 0;
    for (uint32_t p : up) {
      Status st = Ask(p, r, /*claim=*/true);
      if (st.ok()) {
        granted.push_back(p);
      } else if (st.code() == StatusCode::kNotFound) {
        noted.push_back(p);
      } else {
        refused = st;
        refuser = p;
        break;
      }
    }
    if (refused.ok() && !granted.empty()) return true;
    if (refused.code() == StatusCode::kUnavailable) Follow(refuser, r);
    for (uint32_t p : granted) (void)Ask(p, r, false);
    for (uint32_t p : noted) (void)Ask(p, r, false);
    if (refused.code() == StatusCode::kFailedPrecondition ||
        refused.code() == StatusCode::kPermissionDenied ||
        refused.code() == StatusCode::kUnauthenticated) {
      return Status(refused.code(),
                    "standby at " + o_.endpoint + ": memory node " +
                        std::to_string(refuser) + " at " + peers_[refuser] +
                        " refuses it: " + std::string(refused.message()));
    }
    // Not yet: no survivor has noticed, or another standby is first.
    const std::string why =
        refused.ok()
            ? "no node linked to it has noticed yet"
            : "node " + std::to_string(refuser) + ": " + refused.ToString();
    // Said when the reason changes kind, and every 10 s while it holds.
    const auto now = Clock::now();
    if (refused.code() != last_code_ || now - last_said_ > kSayEvery) {
      MEMBOX_LOG_INFO("standby at {}: memory node {} at {} unreachable; {}",
                      o_.endpoint, r, peers_[r], why);
      last_code_ = refused.code();
      last_said_ = now;
    }
    return false;
  }

  const StandbyOptions& o_;
  std::vector<std::string> peers_;  // where each proxy is now
  std::unique_ptr<transport::Device> device_;
  std::vector<std::unique_ptr<service::Client>> links_;
  std::vector<bool> seen_;  // reached at its current address once
  StatusCode last_code_ = StatusCode::kUnknown;
  Clock::time_point last_said_{};
  std::minstd_rand rng_{std::random_device{}()};
};

}  // namespace

Result<uint32_t> AwaitVacancy(const StandbyOptions& o) {
  RETURN_IF_ERROR(CheckOptions(o));
  transport::DeviceOptions d;
  d.secret = o.secret;
  d.transports = o.transports;
  d.name = "membox-standby";
  ASSIGN_OR_RETURN(auto device, transport::Device::Create(d));
  Watch w(o, std::move(device));
  return w.Run();
}

}  // namespace membox::ps
