#include "membox/collective/point_to_point.h"

#include <algorithm>
#include <deque>
#include <map>
#include <optional>
#include <set>

#include "membox/base/copy.h"
#include "membox/base/mutex.h"
#include "membox/transport/device.h"

#include "src/collective/peer_links.h"
#include "src/collective/ring_message.h"

namespace membox::collective {
namespace {

using transport::MemRegion;

// One peer's two directions. `send_mu` serialises our sends to it (the
// `out` channel, our send buffer, its receive buffer for us); `recv_mu`
// our receives from it (the `in` channel, our buffer for it, the kept
// messages).
struct Peer {
  Mutex send_mu;
  std::unique_ptr<MemRegion> send MEMBOX_GUARDED_BY(send_mu);
  // The last piece written into the peer's buffer whose ACK is unread.
  std::optional<std::pair<uint64_t, uint32_t>> unacked
      MEMBOX_GUARDED_BY(send_mu);
  Mutex recv_mu;
  // Messages taken ahead of their receive, by tag, in arrival order.
  std::map<uint64_t, std::deque<std::vector<uint8_t>>> kept
      MEMBOX_GUARDED_BY(recv_mu);
};

class PointToPointImpl final : public PointToPoint {
 public:
  explicit PointToPointImpl(PointToPointOptions o) : opt_(std::move(o)) {}
  ~PointToPointImpl() override {
    CloseLinks(links_);
    links_.clear();
    peers_.clear();
    device_.reset();
  }

  Status Init() {
    if (opt_.world < 1 || opt_.rank < 0 || opt_.rank >= opt_.world) {
      return InvalidArgumentError("rank must be in [0, world)");
    }
    if (opt_.inline_bytes + 64 > transport::Channel::kMaxControlMessage) {
      return InvalidArgumentError(
          "inline_bytes exceeds the control path's " +
          std::to_string(transport::Channel::kMaxControlMessage) + " bytes");
    }
    slot_ = std::max<size_t>(64 << 10, opt_.max_bytes / opt_.world);
    transport::DeviceOptions d;
    d.listen_address = opt_.listen;
    d.transports = opt_.transports;
    d.secret = opt_.secret;
    d.name = "p2p-" + std::to_string(opt_.rank);
    ASSIGN_OR_RETURN(device_, transport::Device::Create(d));
    return Status::Ok();
  }

  std::string endpoint() const override { return device_->listen_endpoint(); }

  Status Connect(const std::vector<std::string>& endpoints) override {
    if (endpoints.size() != static_cast<size_t>(opt_.world)) {
      return InvalidArgumentError("one endpoint per worker");
    }
    if (connected_) return FailedPreconditionError("already connected");
    std::set<int> others;
    for (int q = 0; q < opt_.world; ++q) {
      if (q == opt_.rank) continue;
      others.insert(q);
      auto p = std::make_unique<Peer>();
      MutexLock l(&p->send_mu);
      ASSIGN_OR_RETURN(p->send, device_->AllocateMemRegion(slot_));
      peers_[q] = std::move(p);
    }
    ASSIGN_OR_RETURN(links_, ConnectPeers(*device_, opt_.rank, endpoints,
                                          others, slot_, opt_.timeout));
    connected_ = true;
    return Status::Ok();
  }

  Status Send(int dst, std::span<const uint8_t> data, uint64_t tag) override {
    RETURN_IF_ERROR(CheckPeer(dst));
    Peer& p = *peers_.at(dst);
    PeerLink& l = links_.at(dst);
    MutexLock lock(&p.send_mu);
    const size_t total = data.size();
    RingMessage m{RingType::kPiece, tag, 0};
    m.total = total;
    if (Inline(total)) {
      m.payload.assign(data.begin(), data.end());
      return SendRing(*l.out, m);
    }
    const size_t pieces = (total + slot_ - 1) / slot_;
    for (size_t i = 0; i < pieces; ++i) {
      if (p.unacked) {
        auto [call, step] = *p.unacked;
        p.unacked.reset();
        RETURN_IF_ERROR(
            RecvRing(*l.out, RingType::kAck, call, step, opt_.timeout)
                .status());
      }
      const size_t off = i * slot_, n = std::min(slot_, total - off);
      CopyBytes(p.send->data(), data.data() + off, n);
      ASSIGN_OR_RETURN(
          auto h, l.out->Write(p.send->data(), *p.send,
                               l.remote_recv->address(), *l.remote_recv, n));
      RETURN_IF_ERROR(h.Wait(opt_.timeout));
      ASSIGN_OR_RETURN(auto f, l.out->Flush());
      RETURN_IF_ERROR(f.Wait(opt_.timeout));
      m.step = static_cast<uint32_t>(i);
      RETURN_IF_ERROR(SendRing(*l.out, m));
      p.unacked = {tag, m.step};
    }
    return Status::Ok();
  }

  Status Recv(int src, std::span<uint8_t> data, uint64_t tag) override {
    RETURN_IF_ERROR(CheckPeer(src));
    Peer& p = *peers_.at(src);
    PeerLink& l = links_.at(src);
    MutexLock lock(&p.recv_mu);
    auto it = p.kept.find(tag);
    if (it != p.kept.end()) {
      std::vector<uint8_t> msg = std::move(it->second.front());
      it->second.pop_front();
      if (it->second.empty()) p.kept.erase(it);
      RETURN_IF_ERROR(CheckSize(src, msg.size(), data.size()));
      if (!msg.empty()) CopyBytes(data.data(), msg.data(), msg.size());
      return Status::Ok();
    }
    while (true) {
      auto bytes = l.in->RecvControl(opt_.timeout);
      if (!bytes.ok()) {
        return Status(bytes.status().code(),
                      "receive from worker " + std::to_string(src) + ": " +
                          std::string(bytes.status().message()));
      }
      ASSIGN_OR_RETURN(RingMessage m, DecodeRing(*bytes));
      if (m.type != RingType::kPiece || m.step != 0) {
        return DataLossError("worker " + std::to_string(src) +
                             " is out of step (not the start of a message)");
      }
      if (m.call == tag && m.total == data.size()) {
        return Take(src, l, m, data);
      }
      // Another tag's message (kept for its receive), or this tag's of the
      // wrong size (taken, then reported): read in whole either way, so
      // the stream stays at a message boundary.
      std::vector<uint8_t> msg(m.total);
      RETURN_IF_ERROR(Take(src, l, m, msg));
      if (m.call == tag) return CheckSize(src, m.total, data.size());
      p.kept[m.call].push_back(std::move(msg));
    }
  }

 private:
  bool Inline(size_t n) const { return n <= opt_.inline_bytes; }

  Status CheckPeer(int q) const {
    if (q < 0 || q >= opt_.world || q == opt_.rank) {
      return InvalidArgumentError("no such peer " + std::to_string(q));
    }
    if (!connected_) return FailedPreconditionError("not connected");
    return Status::Ok();
  }

  static Status CheckSize(int src, size_t sent, size_t room) {
    if (sent == room) return Status::Ok();
    return InvalidArgumentError("receive from worker " + std::to_string(src) +
                                ": the send was " + std::to_string(sent) +
                                " bytes, the buffer holds " +
                                std::to_string(room));
  }

  // The rest of the message whose first notice is `first`, into `out`
  // (exactly first.total bytes).
  Status Take(int src, PeerLink& l, const RingMessage& first,
              std::span<uint8_t> out) {
    const size_t total = first.total;
    if (Inline(total)) {
      if (first.payload.size() != total) {
        return DataLossError("worker " + std::to_string(src) +
                             " sent a short inline message (the workers "
                             "disagree on inline_bytes?)");
      }
      if (total > 0) CopyBytes(out.data(), first.payload.data(), total);
      return Status::Ok();
    }
    const size_t pieces = (total + slot_ - 1) / slot_;
    for (size_t i = 0; i < pieces; ++i) {
      const uint32_t step = static_cast<uint32_t>(i);
      if (i > 0) {
        ASSIGN_OR_RETURN(
            RingMessage m,
            RecvRing(*l.in, RingType::kPiece, first.call, step, opt_.timeout));
        if (m.total != total) {
          return DataLossError("worker " + std::to_string(src) +
                               " changed a message's size mid-way");
        }
      }
      const size_t off = i * slot_, n = std::min(slot_, total - off);
      CopyBytes(out.data() + off, l.recv->data(), n);
      RETURN_IF_ERROR(SendRing(*l.in, {RingType::kAck, first.call, step}));
    }
    return Status::Ok();
  }

  PointToPointOptions opt_;
  size_t slot_ = 0;
  std::unique_ptr<transport::Device> device_;
  // Set by Connect (one thread, before any Send or Recv), then read only.
  std::map<int, PeerLink> links_;
  std::map<int, std::unique_ptr<Peer>> peers_;
  bool connected_ = false;
};

}  // namespace

Result<std::unique_ptr<PointToPoint>> PointToPoint::Create(
    const PointToPointOptions& options) {
  auto p = std::make_unique<PointToPointImpl>(options);
  RETURN_IF_ERROR(p->Init());
  return std::unique_ptr<PointToPoint>(std::move(p));
}

}  // namespace membox::collective
