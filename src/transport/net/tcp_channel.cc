#include "src/transport/net/tcp_channel.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <iterator>

#include <poll.h>
#include <sys/socket.h>

#include "membox/base/logging.h"
#include "membox/base/wire.h"

#include "src/transport/am_messages.h"
#include "src/transport/control_inbox.h"

namespace membox::transport::net {
namespace {

// A peer that accepts no bytes for this long is treated as gone.
constexpr auto kSendStall = std::chrono::seconds(120);
constexpr uint32_t kMaxFrameHeader = 64 * 1024;
// Largest write frame (Memcpy splits larger writes).
constexpr size_t kWriteChunk = 256 * 1024;
// Payloads larger than any region could be are a protocol error.
constexpr uint64_t kMaxPayload = uint64_t{1} << 44;

class TcpRemoteMemRegion final : public RemoteMemRegion {
 public:
  TcpRemoteMemRegion(RegionDescriptor d, const void* channel)
      : RemoteMemRegion(std::move(d), nullptr), channel_(channel) {}
  const void* channel() const { return channel_; }

 private:
  const void* channel_;
};

}  // namespace

TcpChannel::TcpChannel(transport::ChannelHost* host, Fd fd, int lane,
                       std::string peer)
    : host_(host),
      fd_(std::move(fd)),
      lane_(lane),
      peer_(std::move(peer)),
      rma_(host, /*host_memory_only=*/true) {
  // The writer sends blocking; a peer that takes no bytes for this long
  // fails the channel.
  timeval tv{static_cast<time_t>(kSendStall.count()), 0};
  setsockopt(fd_.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

TcpChannel::~TcpChannel() { Stop(); }

void TcpChannel::Stop() {
  Close();
  MutexLock l(&stop_mu_);
  for (std::thread* t : {&reader_, &writer_}) {
    if (!t->joinable()) continue;
    if (t->get_id() == std::this_thread::get_id()) {
      // Only the destructor can get here on the channel's own thread, and
      // the owner rule in the header keeps that from happening (the
      // device's reference is dropped on other threads). Were it to, the
      // thread returns into a loop of a freed channel: detaching at least
      // keeps std::thread's destructor from terminating the process.
      t->detach();
    } else {
      t->join();
    }
  }
}

void TcpChannel::Start() {
  reader_ = std::thread([this] { ReaderLoop(); });
  writer_ = std::thread([this] { WriterLoop(); });
}

Status TcpChannel::health() const {
  if (!failed_.load(std::memory_order_acquire)) return Status::Ok();
  MutexLock l(&mu_);
  return failure_;
}

void TcpChannel::Fail(const Status& s) {
  std::deque<OutFrame> queued;
  Status failure;
  {
    MutexLock l(&mu_);
    if (!failed_.load()) {
      failure_ = Status(s.code(), peer_ + ": " + std::string(s.message()));
      failed_.store(true, std::memory_order_release);
      MEMBOX_LOG_DEBUG("tcp channel to {} failed: {}", peer_, s.ToString());
      // Wakes the reader (recv returns 0) and the writer (send fails).
      if (fd_) shutdown(fd_.get(), SHUT_RDWR);
    }
    failure = failure_;
    queued.swap(sendq_);
    queued_cost_ = 0;
  }
  send_cv_.NotifyAll();
  rma_.Close(failure);
  for (auto& f : queued) {
    if (f.state) f.state->Complete(failure);
  }
  inbox_.Fail(failure);
  host_->events()->Notify();
}

void TcpChannel::Close() {
  Fail(AbortedError("channel closed"));
  // No handler runs after Close returns (the reader thread may be inside
  // one right now): what the handlers captured may go away.
  inbox_.Detach();
}

ExportTable::Fence TcpChannel::FenceFor() {
  return [w = weak_from_this()] {
    if (auto c = w.lock()) {
      c->Fail(AbortedError("a region this peer was accessing was revoked"));
    }
  };
}

Status TcpChannel::Enqueue(uint32_t type, std::vector<uint8_t> header,
                           const void* payload, size_t len,
                           std::vector<uint8_t> owned,
                           std::shared_ptr<OpState> state,
                           ExportTable::Lease lease) {
  OutFrame f;
  f.lease = std::move(lease);
  f.type = type;
  uint32_t hlen = static_cast<uint32_t>(header.size());
  uint64_t plen = len;
  std::memcpy(f.head, &type, 4);
  std::memcpy(f.head + 4, &hlen, 4);
  std::memcpy(f.head + 8, &plen, 8);
  f.header = std::move(header);
  f.owned = std::move(owned);
  f.payload = f.owned.empty() ? payload : f.owned.data();
  f.payload_len = len;
  f.state = std::move(state);
  bool inline_send = false;
  bool over = false;
  {
    MutexLock l(&mu_);
    if (failed_.load()) return failure_;
    if (sending_ || !sendq_.empty()) {
      f.cost = f.header.size() + f.owned.size() + kFrameOverhead;
      if (queued_cost_ + f.cost > kMaxQueuedCost) {
        over = true;
      } else {
        queued_cost_ += f.cost;
      }
    }
    // Nothing queued and nobody sending: try the socket from this thread
    // (no hand-off to the writer thread for a message that fits the socket
    // buffer: a small request costs one system call).
    if (over) {
      // (answered below, outside the lock)
    } else if (!sending_ && sendq_.empty()) {
      sending_ = true;
      inline_send = true;
    } else if (type == kTcpReadReq) {
      // A read request (a few bytes) goes ahead of the bulk writes queued
      // at the tail (not of anything else, and never into a frame already
      // started): a node reading the next pushes from a worker must not
      // wait behind the results it is writing to that worker, or its link
      // is used one direction at a time. Reads are not ordered after
      // earlier writes on any data path (UCX's RMA neither); Flush orders.
      auto pos = sendq_.end();
      while (pos != sendq_.begin() && std::prev(pos)->type == kTcpWrite &&
             std::prev(pos)->sent == 0) {
        --pos;
      }
      sendq_.insert(pos, std::move(f));
    } else {
      sendq_.push_back(std::move(f));
    }
  }
  if (over) {
    Status s = ResourceExhaustedError(
        "the peer does not read: more than " +
        std::to_string(kMaxQueuedCost >> 20) +
        " MiB of frames wait to be sent to it (kMaxQueuedCost)");
    MEMBOX_LOG_WARN("{}: {}", peer_, s.ToString());
    Fail(s);
    return health();
  }
  if (!inline_send) {
    send_cv_.NotifyOne();
    return Status::Ok();
  }
  Result<bool> done = SendSome(f, /*block=*/false);
  bool finished = done.ok() && *done;
  {
    MutexLock l(&mu_);
    sending_ = false;
    // The rest (if any) goes first: frames never interleave on the stream.
    if (done.ok() && !finished && !failed_.load()) {
      f.cost = f.header.size() + f.owned.size() + kFrameOverhead;
      queued_cost_ += f.cost;
      sendq_.push_front(std::move(f));
    }
  }
  send_cv_.NotifyOne();
  if (!done.ok()) {
    Fail(UnavailableError("connection lost: " +
                          std::string(done.status().message())));
    return health();
  }
  if (finished && f.state) f.state->Complete(Status::Ok());
  return Status::Ok();
}

Result<bool> TcpChannel::SendSome(OutFrame& f, bool block) {
  for (;;) {
    iovec v[3];
    int n = 0;
    size_t skip = f.sent;
    auto add = [&](const void* p, size_t len) {
      if (skip >= len) {
        skip -= len;
        return;
      }
      v[n++] = {const_cast<char*>(static_cast<const char*>(p)) + skip,
                len - skip};
      skip = 0;
    };
    add(f.head, sizeof(f.head));
    add(f.header.data(), f.header.size());
    add(f.payload, f.payload_len);
    if (n == 0) return true;
    msghdr mh{};
    mh.msg_iov = v;
    mh.msg_iovlen = static_cast<size_t>(n);
    ssize_t r =
        sendmsg(fd_.get(), &mh, MSG_NOSIGNAL | (block ? 0 : MSG_DONTWAIT));
    if (r > 0) {
      f.sent += static_cast<size_t>(r);
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (!block) return false;
      return DeadlineExceededError("peer accepted no bytes for " +
                                   std::to_string(kSendStall.count()) + " s");
    }
    return UnavailableError(r == 0 ? "send returned 0" : std::strerror(errno));
  }
}

void TcpChannel::WriterLoop() {
  for (;;) {
    OutFrame f;
    {
      MutexLock l(&mu_);
      while (!failed_.load() && (sending_ || sendq_.empty())) {
        send_cv_.Wait(&mu_);
      }
      if (failed_.load()) return;
      f = std::move(sendq_.front());
      sendq_.pop_front();
      queued_cost_ -= std::min(queued_cost_, f.cost);
      sending_ = true;
    }
    // Blocking from where the frame stands (an inline send may have started
    // it).
    Result<bool> done = SendSome(f, /*block=*/true);
    Status s = done.status();
    {
      MutexLock l(&mu_);
      sending_ = false;
    }
    send_cv_.NotifyOne();
    if (!s.ok()) {
      if (f.state)
        f.state->Complete(UnavailableError(std::string(s.message())));
      Fail(UnavailableError("connection lost: " + std::string(s.message())));
      return;
    }
    if (f.state) f.state->Complete(Status::Ok());
  }
}

void TcpChannel::ReaderLoop() {
  for (;;) {
    uint8_t head[16];
    Status s = RecvExact(fd_.get(), head, sizeof(head));
    if (!s.ok()) {
      Fail(UnavailableError("connection lost: " + std::string(s.message())));
      return;
    }
    uint32_t type = 0, hlen = 0;
    uint64_t plen = 0;
    std::memcpy(&type, head, 4);
    std::memcpy(&hlen, head + 4, 4);
    std::memcpy(&plen, head + 8, 8);
    if (hlen > kMaxFrameHeader || plen > kMaxPayload) {
      Fail(DataLossError("malformed frame (header " + std::to_string(hlen) +
                         " B, payload " + std::to_string(plen) + " B)"));
      return;
    }
    std::vector<uint8_t> header(hlen);
    s = RecvExact(fd_.get(), header.data(), hlen);
    if (s.ok()) s = HandleFrame(type, header, plen);
    if (!s.ok()) {
      Fail(s.code() == StatusCode::kUnavailable
               ? s
               : DataLossError("protocol error: " + std::string(s.message())));
      return;
    }
  }
}

Status TcpChannel::Discard(uint64_t n) {
  uint8_t buf[16384];
  while (n > 0) {
    size_t k = n < sizeof(buf) ? static_cast<size_t>(n) : sizeof(buf);
    RETURN_IF_ERROR(RecvExact(fd_.get(), buf, k));
    n -= k;
  }
  return Status::Ok();
}

Status TcpChannel::HandleFrame(uint32_t type, std::vector<uint8_t>& header,
                               uint64_t plen) {
  auto no_payload = [&]() -> Status {
    if (plen != 0) return InvalidArgumentError("unexpected payload");
    return Status::Ok();
  };
  switch (type) {
    case kTcpControl: {
      if (plen > kMaxControlMessage || !header.empty()) {
        return InvalidArgumentError("control message too large");
      }
      std::vector<uint8_t> m(plen);
      RETURN_IF_ERROR(RecvExact(fd_.get(), m.data(), m.size()));
      inbox_.Deliver(std::move(m));
      return Status::Ok();
    }
    case kTcpValidateReq: {
      RETURN_IF_ERROR(no_payload());
      ASSIGN_OR_RETURN(auto answer, rma_.AnswerValidate(header));
      return Enqueue(kTcpValidateResp, std::move(answer), nullptr, 0, {},
                     nullptr);
    }
    case kTcpValidateResp:
      RETURN_IF_ERROR(no_payload());
      return rma_.OnValidateAnswer(header);
    case kTcpFlushResp:
      RETURN_IF_ERROR(no_payload());
      return rma_.OnFlushAnswer(header);
    case kTcpWrite: {
      ASSIGN_OR_RETURN(auto w, rma_.AdmitWrite(header, plen, FenceFor()));
      if (!w.refused.ok()) {
        RETURN_IF_ERROR(Discard(plen));
        return Enqueue(kTcpError, std::move(w.error_header), nullptr, 0, {},
                       nullptr);
      }
      return RecvExact(fd_.get(), w.dst, plen);
    }
    case kTcpReadReq: {
      RETURN_IF_ERROR(no_payload());
      ASSIGN_OR_RETURN(auto a, rma_.AnswerRead(header, FenceFor()));
      // The frame keeps the lease until its last byte is sent, so the range
      // is not freed (or is fenced) while the answer still reads from it.
      return Enqueue(kTcpReadResp, std::move(a.header), a.src, a.len, {},
                     nullptr, std::move(a.lease));
    }
    case kTcpReadResp: {
      ASSIGN_OR_RETURN(auto target, rma_.OnReadAnswer(header, plen));
      if (target.local == nullptr) return Status::Ok();
      Status r = RecvExact(fd_.get(), target.local, target.len);
      target.state->Complete(r);
      return r;
    }
    case kTcpFlushReq: {
      RETURN_IF_ERROR(no_payload());
      // Writes are applied by this thread in arrival order: everything sent
      // before the request is in place, so the answer is always due now.
      ASSIGN_OR_RETURN(auto answer, rma_.OnFlushRequest(header));
      if (!answer) return InternalError("flush deferred on a TCP channel");
      return Enqueue(kTcpFlushResp, std::move(*answer), nullptr, 0, {},
                     nullptr);
    }
    case kTcpError:
      RETURN_IF_ERROR(no_payload());
      return rma_.OnError(header, peer_);
    default:
      return InvalidArgumentError("unknown frame type " + std::to_string(type));
  }
}

Status TcpChannel::SendRequest(uint32_t type,
                               Result<MessageRma::Request> request) {
  RETURN_IF_ERROR(request.status());
  Status s = Enqueue(type, std::move(request->header), nullptr, 0, {}, nullptr);
  if (!s.ok()) rma_.Withdraw(request->id);
  return s;
}

Result<std::shared_ptr<RemoteMemRegion>> TcpChannel::Import(
    const RegionDescriptor& desc, std::chrono::nanoseconds timeout,
    bool verify_with_owner) {
  RETURN_IF_ERROR(health());
  RETURN_IF_ERROR(CheckDescriptorShape(desc));
  if (verify_with_owner) {
    RETURN_IF_ERROR(rma_.CheckWithOwner(
        desc, std::make_shared<OpState>(host_->events()), timeout,
        [this](const MessageRma::Request& r) {
          return Enqueue(kTcpValidateReq, r.header, nullptr, 0, {}, nullptr);
        }));
  }
  return std::shared_ptr<RemoteMemRegion>(
      std::make_shared<TcpRemoteMemRegion>(desc, this));
}

Result<OpHandle> TcpChannel::Memcpy(void* local_addr, const MemRegion& local,
                                    uint64_t remote_addr,
                                    const RemoteMemRegion& remote, size_t size,
                                    Direction direction, Completion cb) {
  RETURN_IF_ERROR(health());
  auto* r = dynamic_cast<const TcpRemoteMemRegion*>(&remote);
  RETURN_IF_ERROR(CheckMemcpyArgs(local_addr, local, remote_addr, remote, size,
                                  r ? r->channel() : nullptr, this));
  if (local.memory_type() != MemoryType::kHost) {
    return FailedPreconditionError(
        std::string("membox's TCP path moves host memory, not ") +
        MemoryTypeName(local.memory_type()) +
        " memory: stage it through a registered host region");
  }
  if (size == 0) {
    if (cb) cb(Status::Ok());
    return OpHandle::Done(Status::Ok());
  }
  auto state = std::make_shared<OpState>(host_->events(), std::move(cb));
  if (direction == Direction::kWrite) {
    // In frames of at most kWriteChunk, so a read request queued behind a
    // large write waits for one chunk at most. Frames of one write go out
    // in order: the last one's completion completes the write.
    const char* src = static_cast<const char*>(local_addr);
    for (size_t off = 0; off < size; off += kWriteChunk) {
      size_t n = std::min(kWriteChunk, size - off);
      bool last = off + n == size;
      Status s = Enqueue(
          kTcpWrite,
          MessageRma::WriteHeader(remote_addr + off, remote.descriptor(), n),
          src + off, n, {}, last ? state : nullptr);
      if (!s.ok()) {
        if (off == 0) return s;  // nothing started
        state->Complete(s);      // a part went out: the write failed
        return OpHandle(std::move(state));
      }
    }
    return OpHandle(std::move(state));
  }
  RETURN_IF_ERROR(SendRequest(
      kTcpReadReq,
      rma_.Read(local_addr, size, remote_addr, remote.descriptor(), state)));
  return OpHandle(std::move(state));
}

Status TcpChannel::Fence() {
  // One stream, applied in order by the peer's reader: always ordered.
  return health();
}

Result<OpHandle> TcpChannel::Flush(Completion cb) {
  RETURN_IF_ERROR(health());
  if (Status e = rma_.TakeAsyncError(); !e.ok()) {
    if (cb) cb(e);
    return OpHandle::Done(e);
  }
  auto state = std::make_shared<OpState>(host_->events(), std::move(cb));
  RETURN_IF_ERROR(SendRequest(kTcpFlushReq, rma_.Flush(state)));
  return OpHandle(std::move(state));
}

Status TcpChannel::SendControl(std::span<const uint8_t> msg) {
  if (msg.size() > kMaxControlMessage) {
    return InvalidArgumentError("control message of " +
                                std::to_string(msg.size()) +
                                " bytes exceeds the limit");
  }
  return Enqueue(kTcpControl, {}, nullptr, msg.size(),
                 std::vector<uint8_t>(msg.begin(), msg.end()), nullptr);
}

Result<std::vector<uint8_t>> TcpChannel::RecvControl(
    std::chrono::nanoseconds timeout) {
  return inbox_.Receive(timeout, peer_);
}

void TcpChannel::SetHandlers(ControlHandler on_message,
                             FailureHandler on_failure) {
  inbox_.SetHandlers(std::move(on_message), std::move(on_failure));
}

}  // namespace membox::transport::net
