#include "membox/collective/point_to_point.h"

#include <atomic>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <thread>

#include "membox/base/copy.h"
#include "membox/base/logging.h"
#include "membox/base/mutex.h"
#include "membox/transport/device.h"

#include "src/collective/peer_links.h"
#include "src/collective/ring_message.h"

namespace membox::collective {
namespace {

using transport::MemRegion;

// One peer's two directions. `send_mu` serialises our sends to it (the
// `out` channel, our send buffer, its receive buffer for us); `recv_mu`
// our receives from it (the `in` channel and our buffer for it: whoever
// holds it reads the peer's stream). The acceptor files `in` and `recv`
// under recv_mu. The messages taken ahead of their receive are under
// `kept_mu`, which is never held while waiting: a RecvAny finds there what
// a Recv holding the stream took for it. Order: recv_mu, then kept_mu.
struct Peer {
  Mutex send_mu;
  std::string endpoint MEMBOX_GUARDED_BY(send_mu);
  CondVar endpoint_known;
  std::shared_ptr<transport::Channel> out MEMBOX_GUARDED_BY(send_mu);
  std::shared_ptr<transport::RemoteMemRegion> remote_recv
      MEMBOX_GUARDED_BY(send_mu);
  std::unique_ptr<MemRegion> send MEMBOX_GUARDED_BY(send_mu);
  // The last piece written into the peer's buffer whose ACK is unread.
  std::optional<std::pair<uint64_t, uint32_t>> unacked
      MEMBOX_GUARDED_BY(send_mu);
  Mutex recv_mu;
  CondVar connected;  // `in` was filed
  std::shared_ptr<transport::Channel> in MEMBOX_GUARDED_BY(recv_mu);
  std::unique_ptr<MemRegion> recv MEMBOX_GUARDED_BY(recv_mu);
  Mutex kept_mu;
  // Messages taken ahead of their receive, by tag, in arrival order.
  std::map<uint64_t, std::deque<std::vector<uint8_t>>> kept
      MEMBOX_GUARDED_BY(kept_mu);
};

class PointToPointImpl final : public PointToPoint {
 public:
  explicit PointToPointImpl(PointToPointOptions o) : opt_(std::move(o)) {}
  ~PointToPointImpl() override {
    stop_ = true;
    if (acceptor_.joinable()) acceptor_.join();
    for (auto& [q, p] : peers_) {
      {
        MutexLock l(&p->send_mu);
        if (p->out) p->out->Close();
        p->out.reset();
        p->remote_recv.reset();
        p->send.reset();
      }
      MutexLock l(&p->recv_mu);
      if (p->in) p->in->Close();
      p->in.reset();
      p->recv.reset();
    }
    peers_.clear();
    device_.reset();
  }

  Status Init() {
    ASSIGN_OR_RETURN(device_, OpenDirect(opt_, "p2p", &slot_));
    for (int q = 0; q < opt_.world; ++q) {
      if (q != opt_.rank) peers_[q] = std::make_unique<Peer>();
    }
    acceptor_ = std::thread([this] { AcceptLoop(); });
    return Status::Ok();
  }

  std::string endpoint() const override { return device_->listen_endpoint(); }

  Status AddPeer(int q, const std::string& endpoint) override {
    RETURN_IF_ERROR(CheckPeer(q));
    Peer& p = *peers_.at(q);
    MutexLock l(&p.send_mu);
    p.endpoint = endpoint;
    p.endpoint_known.NotifyAll();
    return Status::Ok();
  }

  Status Send(int dst, std::span<const uint8_t> data, uint64_t tag) override {
    RETURN_IF_ERROR(CheckPeer(dst));
    Peer& p = *peers_.at(dst);
    MutexLock lock(&p.send_mu);
    if (!p.out) RETURN_IF_ERROR(OpenOut(dst, p));
    const size_t total = data.size();
    RingMessage m{RingType::kPiece, tag, 0};
    m.total = total;
    void* mapped = p.remote_recv->mapped();
    if (Inline(total)) {
      // Where the peer's buffer is mapped here (one host), a message
      // above kMappedInlineBytes is copied straight into it -- one copy
      // where the control path makes three -- if the buffer is free now:
      // a send this size never waits for the receiver. (At 64 KiB the ACK
      // it costs outweighed the copies in a ping-pong; from 128 KiB it
      // wins in a ping-pong and in a ring shift.)
      bool put = false;
      if (mapped && total > kMappedInlineBytes && total <= slot_) {
        ASSIGN_OR_RETURN(put, BufferFreeNow(p));
      }
      if (!put) {
        m.payload.assign(data.begin(), data.end());
        return SendRing(*p.out, m);
      }
    }
    const size_t pieces = (total + slot_ - 1) / slot_;
    for (size_t i = 0; i < pieces; ++i) {
      if (p.unacked) {
        auto [call, step] = *p.unacked;
        p.unacked.reset();
        RETURN_IF_ERROR(
            RecvRing(*p.out, RingType::kAck, call, step, opt_.timeout)
                .status());
      }
      const size_t off = i * slot_, n = std::min(slot_, total - off);
      m.step = static_cast<uint32_t>(i);
      if (mapped) {
        // One copy into the peer's buffer; the notice follows the bytes.
        CopyBytes(mapped, data.data() + off, n);
        std::atomic_thread_fence(std::memory_order_release);
        RETURN_IF_ERROR(SendRing(*p.out, m));
        p.unacked = {tag, m.step};
        continue;
      }
      CopyBytes(p.send->data(), data.data() + off, n);
      ASSIGN_OR_RETURN(
          auto h, p.out->Write(p.send->data(), *p.send,
                               p.remote_recv->address(), *p.remote_recv, n));
      RETURN_IF_ERROR(h.Wait(opt_.timeout));
      ASSIGN_OR_RETURN(auto f, p.out->Flush());
      RETURN_IF_ERROR(f.Wait(opt_.timeout));
      RETURN_IF_ERROR(SendRing(*p.out, m));
      p.unacked = {tag, m.step};
    }
    return Status::Ok();
  }

  Status Recv(int src, std::span<uint8_t> data, uint64_t tag) override {
    RETURN_IF_ERROR(CheckPeer(src));
    Peer& p = *peers_.at(src);
    MutexLock lock(&p.recv_mu);
    auto until = std::chrono::steady_clock::now() + opt_.timeout;
    while (!p.in && !HasKept(p, tag)) {
      auto left = until - std::chrono::steady_clock::now();
      if (left <= left.zero() || !p.connected.WaitFor(&p.recv_mu, left)) {
        if (p.in) break;
        return DeadlineExceededError(
            "receive from worker " + std::to_string(src) + ": it did not " +
            "connect within " + std::to_string(opt_.timeout.count()) + " ms");
      }
    }
    while (true) {
      ASSIGN_OR_RETURN(bool taken, TakeNext(src, p, data, tag, opt_.timeout));
      if (taken) return Status::Ok();
    }
  }

  Result<int> RecvAny(std::span<uint8_t> data, uint64_t tag) override {
    const auto until = std::chrono::steady_clock::now() + opt_.timeout;
    auto nap = std::chrono::microseconds(20);
    while (true) {
      // Each peer in turn, from where the last receive from any left off
      // (so no sender is starved): what is kept from it, then, unless a
      // Recv on another thread reads its stream (and keeps what it meets
      // under this tag for us), what has arrived on it.
      for (int k = 0; k < opt_.world; ++k) {
        const int q = (any_next_ + k) % opt_.world;
        if (q == opt_.rank) continue;
        Peer& p = *peers_.at(q);
        Status kept_status;
        if (TakeKept(q, p, data, tag, &kept_status)) {
          if (!kept_status.ok()) return kept_status;
          any_next_ = (q + 1) % opt_.world;
          return q;
        }
        if (!p.recv_mu.TryLock()) continue;  // a Recv reads q's stream
        Result<bool> taken = false;
        while (taken.ok() && !*taken && p.in) {
          taken = TakeNext(q, p, data, tag, std::chrono::milliseconds(0));
          if (!taken.ok() &&
              taken.status().code() == StatusCode::kDeadlineExceeded) {
            taken = false;  // nothing more from q yet
            break;
          }
        }
        p.recv_mu.Unlock();
        if (!taken.ok()) return taken.status();
        if (*taken) {
          any_next_ = (q + 1) % opt_.world;
          return q;
        }
      }
      if (std::chrono::steady_clock::now() >= until) {
        return DeadlineExceededError(
            "receive from any worker (tag " + std::to_string(tag) +
            "): no message within " + std::to_string(opt_.timeout.count()) +
            " ms");
      }
      std::this_thread::sleep_for(nap);
      nap = std::min<std::chrono::microseconds>(2 * nap,
                                                std::chrono::milliseconds(1));
    }
  }

 private:
  bool Inline(size_t n) const { return n <= opt_.inline_bytes; }
  static constexpr size_t kMappedInlineBytes = 64 << 10;

  // Whether the peer's buffer for us is free without waiting: no piece
  // written there unacknowledged, or its ACK here already.
  Result<bool> BufferFreeNow(Peer& p) MEMBOX_REQUIRES(p.send_mu) {
    if (!p.unacked) return true;
    auto [call, step] = *p.unacked;
    auto acked = RecvRing(*p.out, RingType::kAck, call, step,
                          std::chrono::milliseconds(0));
    if (acked.ok()) {
      p.unacked.reset();
      return true;
    }
    if (acked.status().code() == StatusCode::kDeadlineExceeded) return false;
    return acked.status();
  }

  Status CheckPeer(int q) const {
    if (q < 0 || q >= opt_.world || q == opt_.rank) {
      return InvalidArgumentError("no such peer " + std::to_string(q));
    }
    return Status::Ok();
  }

  static Status CheckSize(int src, size_t sent, size_t room) {
    if (sent == room) return Status::Ok();
    return InvalidArgumentError("receive from worker " + std::to_string(src) +
                                ": the send was " + std::to_string(sent) +
                                " bytes, the buffer holds " +
                                std::to_string(room));
  }

  // The next message from `src` under `tag`, into `data`: true once taken
  // (kInvalidArgument, the message consumed, if its size differs), false
  // when the next message in the stream had another tag (then kept, whole,
  // for its own receive). A message kept earlier goes first. Waits up to
  // `timeout` for a message's start (kDeadlineExceeded; zero: only what is
  // here), and for the rest of a message once it has started.
  Result<bool> TakeNext(int src, Peer& p, std::span<uint8_t> data, uint64_t tag,
                        std::chrono::milliseconds timeout)
      MEMBOX_REQUIRES(p.recv_mu) {
    Status kept_status;
    if (TakeKept(src, p, data, tag, &kept_status)) {
      RETURN_IF_ERROR(kept_status);
      return true;
    }
    auto bytes = p.in->RecvControl(timeout);
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
      RETURN_IF_ERROR(Take(src, p, m, data));
      return true;
    }
    // Another tag's message (kept for its receive), or this tag's of the
    // wrong size (taken, then reported): read in whole either way, so the
    // stream stays at a message boundary.
    std::vector<uint8_t> msg(m.total);
    RETURN_IF_ERROR(Take(src, p, m, msg));
    if (m.call == tag) {
      RETURN_IF_ERROR(CheckSize(src, m.total, data.size()));
      return true;
    }
    MutexLock kept(&p.kept_mu);
    p.kept[m.call].push_back(std::move(msg));
    return false;
  }

  // The first message kept from `src` under `tag`, into `data` (*status:
  // its size differs); false when none is kept.
  bool TakeKept(int src, Peer& p, std::span<uint8_t> data, uint64_t tag,
                Status* status) {
    std::vector<uint8_t> msg;
    {
      MutexLock kept(&p.kept_mu);
      auto it = p.kept.find(tag);
      if (it == p.kept.end()) return false;
      msg = std::move(it->second.front());
      it->second.pop_front();
      if (it->second.empty()) p.kept.erase(it);
    }
    *status = CheckSize(src, msg.size(), data.size());
    if (status->ok() && !msg.empty()) {
      CopyBytes(data.data(), msg.data(), msg.size());
    }
    return true;
  }

  bool HasKept(Peer& p, uint64_t tag) {
    MutexLock kept(&p.kept_mu);
    return p.kept.count(tag) > 0;
  }

  // The rest of the message whose first notice is `first`, into `out`
  // (exactly first.total bytes).
  Status Take(int src, Peer& p, const RingMessage& first,
              std::span<uint8_t> out) MEMBOX_REQUIRES(p.recv_mu) {
    const size_t total = first.total;
    // Inline by size, its bytes are in the notice -- or, sent empty, in
    // our buffer (copied there on one host), which then holds all of them.
    if (Inline(total) && total > 0 && first.payload.empty() && total > slot_) {
      return DataLossError(
          "worker " + std::to_string(src) + " sent an empty notice for " +
          std::to_string(total) + " bytes, more than its buffer here holds");
    }
    if (Inline(total) && (total == 0 || !first.payload.empty())) {
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
            RecvRing(*p.in, RingType::kPiece, first.call, step, opt_.timeout));
        if (m.total != total) {
          return DataLossError("worker " + std::to_string(src) +
                               " changed a message's size mid-way");
        }
      }
      const size_t off = i * slot_, n = std::min(slot_, total - off);
      std::atomic_thread_fence(std::memory_order_acquire);
      CopyBytes(out.data() + off, p.recv->data(), n);
      RETURN_IF_ERROR(SendRing(*p.in, {RingType::kAck, first.call, step}));
    }
    return Status::Ok();
  }

  // Our channel to peer q: wait for its endpoint, connect, say who we are
  // (kHello), learn where to write (kDescriptor from its acceptor).
  Status OpenOut(int q, Peer& p) MEMBOX_REQUIRES(p.send_mu) {
    auto until = std::chrono::steady_clock::now() + opt_.timeout;
    while (p.endpoint.empty()) {
      auto left = until - std::chrono::steady_clock::now();
      if (left <= left.zero() || !p.endpoint_known.WaitFor(&p.send_mu, left)) {
        if (!p.endpoint.empty()) break;
        return DeadlineExceededError("worker " + std::to_string(q) +
                                     "'s endpoint is not known");
      }
    }
    std::shared_ptr<transport::Channel> ch;
    Status last;
    while (!ch && std::chrono::steady_clock::now() < until) {
      auto c = device_->GetChannel(p.endpoint);
      if (c.ok()) {
        ch = *c;
      } else {
        last = c.status();
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    }
    if (!ch) {
      return UnavailableError("cannot reach worker " + std::to_string(q) +
                              ": " + last.ToString());
    }
    RingMessage hello{RingType::kHello, 0, static_cast<uint32_t>(opt_.rank)};
    RETURN_IF_ERROR(SendRing(*ch, hello));
    ASSIGN_OR_RETURN(RingMessage d,
                     RecvRing(*ch, RingType::kDescriptor, 0, 0, opt_.timeout));
    ASSIGN_OR_RETURN(auto desc,
                     transport::RegionDescriptor::Deserialize(d.payload));
    ASSIGN_OR_RETURN(auto remote, ch->Import(desc, opt_.timeout));
    if (remote->size() < slot_) {
      return FailedPreconditionError(
          "worker " + std::to_string(q) +
          "'s receive buffer is smaller than ours (workers disagree on "
          "max_bytes)");
    }
    if (!p.send) {
      ASSIGN_OR_RETURN(p.send, device_->AllocateMemRegion(slot_));
    }
    p.remote_recv = std::move(remote);
    p.out = std::move(ch);
    return Status::Ok();
  }

  // Files each peer's channel to us: its hello names it; it gets a receive
  // buffer and is told where. A connection that names no peer, or a second
  // one from the same peer, is closed.
  void AcceptLoop() {
    while (!stop_) {
      auto ch = device_->Accept(std::chrono::milliseconds(200));
      if (!ch.ok()) continue;  // (a timeout: look at stop_ again)
      Status s = FileIn(*ch);
      if (!s.ok()) {
        MEMBOX_LOG_WARN("p2p-{}: refused a connection from {}: {}", opt_.rank,
                        (*ch)->peer(), s.ToString());
        (*ch)->Close();
      }
    }
  }

  Status FileIn(const std::shared_ptr<transport::Channel>& ch) {
    ASSIGN_OR_RETURN(auto bytes, ch->RecvControl(opt_.timeout));
    ASSIGN_OR_RETURN(RingMessage m, DecodeRing(bytes));
    const int q = static_cast<int>(m.step);
    if (m.type != RingType::kHello || !peers_.count(q)) {
      return DataLossError("not a hello from a worker of this job");
    }
    Peer& p = *peers_.at(q);
    MutexLock l(&p.recv_mu);
    if (p.in)
      return AlreadyExistsError("worker " + std::to_string(q) +
                                " is already connected");
    ASSIGN_OR_RETURN(p.recv, device_->AllocateMemRegion(slot_));
    RingMessage d{RingType::kDescriptor, 0, 0};
    d.payload = p.recv->Export().Serialize();
    RETURN_IF_ERROR(SendRing(*ch, d));
    p.in = ch;
    p.connected.NotifyAll();
    return Status::Ok();
  }

  PointToPointOptions opt_;
  size_t slot_ = 0;
  std::unique_ptr<transport::Device> device_;
  std::map<int, std::unique_ptr<Peer>> peers_;  // fixed after Init
  std::atomic<bool> stop_{false};
  std::thread acceptor_;
  // Where RecvAny starts looking next. Its callers are serialised by the
  // backend (one receive-from-any lane); a race here only changes order.
  std::atomic<int> any_next_{0};
};

}  // namespace

Result<std::unique_ptr<PointToPoint>> PointToPoint::Create(
    const PointToPointOptions& options) {
  return MakeInitialized<PointToPoint, PointToPointImpl>(options);
}

}  // namespace membox::collective
