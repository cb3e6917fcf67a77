#include "src/transport/ucx/ucx_channel.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <thread>

#include <sys/socket.h>

#include "membox/base/copy.h"
#include "membox/base/logging.h"
#include "membox/base/wire.h"
#include "membox/transport/huge_pages.h"

#include "src/transport/am_messages.h"
#include "src/transport/control_inbox.h"

namespace membox::transport::ucx {
namespace {

// Control messages up to this many bytes are sent eagerly (SendAm).
constexpr size_t kEagerControlBytes = 256 << 10;

// Heap context of one UCX send/put/get/flush; freed by its completion.
struct SendCtx {
  UcxChannel* channel = nullptr;  // set when the op is tracked as in flight
  std::vector<uint8_t> hdr;
  std::vector<uint8_t> payload;  // owned copy for fire-and-forget messages
  std::shared_ptr<OpState> state;
  std::atomic<int64_t>* in_flight = nullptr;
  EventCount* events = nullptr;
  // The channel's count of UCX requests not yet completed (shared: the
  // completion may come after the channel is gone).
  std::shared_ptr<std::atomic<int64_t>> requests;
};

void FinishSend(SendCtx* c, ucs_status_t st) {
  // Complete before untracking: Track() skips states that are already done,
  // so a state is never left in the in-flight set.
  if (c->state) {
    c->state->Complete(st == UCS_OK ? Status::Ok()
                                    : UcsError(st, "transfer failed"));
  }
  if (c->channel && c->state) c->channel->Untrack(c->state);
  if (c->in_flight) {
    c->in_flight->fetch_sub(1, std::memory_order_acq_rel);
    if (c->events) c->events->Notify();
  }
  if (c->requests) c->requests->fetch_sub(1, std::memory_order_acq_rel);
  delete c;
}

void SendCb(void* request, ucs_status_t st, void* user_data) {
  FinishSend(static_cast<SendCtx*>(user_data), st);
  ucp_request_free(request);
}

}  // namespace

UcxChannel::UcxChannel(UcxDevice* dev, UcxWorker* worker, int lane,
                       std::string peer, bool accepted)
    : dev_(dev),
      worker_(worker),
      lane_(lane),
      peer_(std::move(peer)),
      accepted_(accepted),
      rma_(dev, /*host_memory_only=*/false) {
  dev_->ChannelOpened();
}

// One UCX call on the data endpoint: ep() is null once the channel closes.
class UcxChannel::EndpointUse {
 public:
  explicit EndpointUse(UcxChannel* c) : c_(c) {
    c_->ep_users_.fetch_add(1);  // seq_cst: before reading ep_
    ep_ = c_->ep_.load();
  }
  ~EndpointUse() { c_->ep_users_.fetch_sub(1); }
  ucp_ep_h ep() const { return ep_; }

 private:
  UcxChannel* c_;
  ucp_ep_h ep_;
};

UcxChannel::~UcxChannel() { Close(); }

std::string UcxChannel::peer() const {
  MutexLock l(&mu_);
  if (accepted_) return peer_name_;
  return peer_;
}

Status UcxChannel::health() const {
  if (!failed_.load(std::memory_order_acquire)) return Status::Ok();
  MutexLock l(&mu_);
  return failure_;
}

Status UcxChannel::CheckUsable() const {
  if (failed_.load(std::memory_order_acquire)) return health();
  if (!data_ready_.load(std::memory_order_acquire) || ep_ == nullptr) {
    return FailedPreconditionError("channel is not connected");
  }
  return Status::Ok();
}

void UcxChannel::Fail(const Status& s) {
  std::set<std::shared_ptr<OpState>> inflight;
  Status failure;
  {
    MutexLock l(&mu_);
    if (!failed_.load()) {
      std::string who = accepted_ ? ("peer " + peer_name_) : peer_;
      failure_ = Status(s.code(), who + ": " + std::string(s.message()));
      failed_.store(true, std::memory_order_release);
      MEMBOX_LOG_DEBUG("channel to {} failed: {}", who, s.ToString());
    }
    failure = failure_;
    inflight.swap(inflight_);
  }
  // Operations UCX may never complete on a dead peer (shared-memory lanes
  // have no peer-failure detection) end here; UCX's own completion, if it
  // comes later, is ignored by OpState.
  rma_.Close(failure);
  for (auto& st : inflight) st->Complete(failure);
  inbox_.Fail(failure);
  dev_->events()->Notify();
}

void UcxChannel::Close() {
  // Mark the channel failed first, so concurrent callers stop before the
  // endpoint goes away.
  const bool healthy = !failed_.load(std::memory_order_acquire);
  Fail(AbortedError("channel closed"));
  if (open_.exchange(false)) dev_->ChannelGone();
  // No handler runs after Close returns (the progress thread may be inside
  // one right now): what the handlers captured may go away.
  inbox_.Detach();
  // Takes the endpoint away from later callers, then waits for the ones
  // inside a (non-blocking) UCX call on it.
  if (healthy && dev_->thread_index() != worker_->index()) {
    // Requests still in flight finish first, for a bounded time: a forced
    // close strands a rendezvous send that waits for the peer's answer
    // (UCX never completes it, and its context and payload copy leak).
    // Not on the worker's own thread: it may be inside a UCX callback.
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (requests_->load(std::memory_order_acquire) > 0 &&
           std::chrono::steady_clock::now() < deadline) {
      ucp_worker_progress(worker_->worker());
    }
  }
  ucp_ep_h ep = ep_.exchange(nullptr);
  while (ep_users_.load() > 0) std::this_thread::yield();
  if (ep) {
    // Force-closing requires peer error handling on both sides; a data
    // endpoint without it (shared memory) is closed with a flush while the
    // peer is alive, for a bounded time.
    const bool graceful = !data_ep_peer_errors_ && healthy;
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = graceful ? 0 : UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t req = ucp_ep_close_nbx(ep, &p);
    if (UCS_PTR_IS_PTR(req)) {
      auto deadline =
          std::chrono::steady_clock::now() + std::chrono::seconds(2);
      while (ucp_request_check_status(req) == UCS_INPROGRESS &&
             std::chrono::steady_clock::now() < deadline) {
        ucp_worker_progress(worker_->worker());
      }
      if (ucp_request_check_status(req) != UCS_INPROGRESS)
        ucp_request_free(req);
    }
  }
  data_ready_.store(false, std::memory_order_release);
  if (!liveness_closed_.exchange(true) && liveness_) {
    dev_->ForgetLiveness(liveness_.get());
    shutdown(liveness_.get(), SHUT_RDWR);
    liveness_.reset();
  }
}

Status UcxChannel::ConnectData(const msg::Hello& peer) {
  {
    MutexLock l(&mu_);
    peer_name_ = peer.name;
    peer_host_ = peer.host;
  }
  remote_id_ = peer.channel_id;
  peer_same_host_ = peer.host == dev_->host_id();
  protocol_ = ChooseProtocol();
  return CreateDataEp(peer.address);
}

void UcxChannel::SetErrorHandling(ucp_ep_params_t* ep, UcxChannel* ch,
                                  ucp_err_handling_mode_t mode) {
  ep->err_mode = mode;
  ep->err_handler.cb = [](void* arg, ucp_ep_h, ucs_status_t st) {
    static_cast<UcxChannel*>(arg)->Fail(UcsError(st, "connection lost"));
  };
  ep->err_handler.arg = ch;
}

ExportTable::Fence UcxChannel::FenceFor() {
  return [w = weak_from_this()] {
    if (auto c = w.lock()) {
      c->Fail(AbortedError("a region this peer was accessing was revoked"));
    }
  };
}

Status UcxChannel::CreateDataEp(const std::vector<uint8_t>& peer_address) {
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                  UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                  UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.address = reinterpret_cast<const ucp_address_t*>(peer_address.data());
  // UCX 1.13 selects only transports with peer-failure detection for
  // endpoints in UCP_ERR_HANDLING_MODE_PEER, which excludes shared memory
  // (posix, sysv, cma). Between processes on one host the data endpoint
  // therefore runs without it; the channel's TCP connection detects a dead
  // peer (the device's network thread) and Fail() completes what is in
  // flight.
  data_ep_peer_errors_ = !peer_same_host_;
  SetErrorHandling(&ep, this,
                   data_ep_peer_errors_ ? UCP_ERR_HANDLING_MODE_PEER
                                        : UCP_ERR_HANDLING_MODE_NONE);
  ucp_ep_h h = nullptr;
  ucs_status_t st = ucp_ep_create(worker_->worker(), &ep, &h);
  if (st != UCS_OK) return UcsError(st, "cannot create the data endpoint");
  ep_ = h;
  data_ready_.store(true, std::memory_order_release);
  if (spdlog::should_log(spdlog::level::debug)) {
    // Which transports UCX chose for this lane (MEMBOX_LOG_LEVEL=debug).
    char* buf = nullptr;
    size_t n = 0;
    if (FILE* f = open_memstream(&buf, &n)) {
      ucp_ep_print_info(h, f);
      std::fclose(f);
      MEMBOX_LOG_DEBUG("data endpoint to {}:\n{}", peer(), std::string(buf, n));
      std::free(buf);
    }
  }
  return Status::Ok();
}

Status UcxChannel::SendAm(AmId id, const std::vector<uint8_t>& hdr,
                          const void* data, size_t len,
                          std::shared_ptr<OpState> state) {
  EndpointUse use(this);
  RETURN_IF_ERROR(CheckUsable());
  ucp_ep_h ep = use.ep();
  if (ep == nullptr) return health();
  auto* c = new SendCtx;
  c->requests = requests_;
  requests_->fetch_add(1, std::memory_order_acq_rel);
  // Every message starts with the receiving side's channel id. A control
  // message then carries its sequence number, taken only now that it will
  // go out (a number that never arrives would stall every later message).
  uint64_t dest = remote_id_;
  std::vector<uint8_t> seq;
  if (id == kAmControl) {
    seq = msg::EncodeId(control_out_.fetch_add(1, std::memory_order_relaxed));
  }
  const std::vector<uint8_t>& extra = id == kAmControl ? seq : hdr;
  c->hdr.resize(sizeof(dest) + extra.size());
  std::memcpy(c->hdr.data(), &dest, sizeof(dest));
  if (!extra.empty())
    std::memcpy(c->hdr.data() + sizeof(dest), extra.data(), extra.size());
  c->state = std::move(state);
  if (!c->state && len > 0) {
    c->payload.assign(static_cast<const uint8_t*>(data),
                      static_cast<const uint8_t*>(data) + len);
    data = c->payload.data();
  }
  if (id == kAmWrite) {
    c->in_flight = &am_writes_in_flight_;
    c->events = dev_->events();
    am_writes_in_flight_.fetch_add(1, std::memory_order_acq_rel);
  }
  std::shared_ptr<OpState> tracked = c->state;
  if (tracked) {
    tracked->set_progress(&UcxWorker::HelpProgress, worker_);
    c->channel = this;
  }
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                   UCP_OP_ATTR_FIELD_FLAGS;
  // A control message of up to kEagerControlBytes goes eagerly: above
  // UCX's rendezvous threshold (some KiB) its receiver would otherwise
  // have to ask the sender for the bytes, a round trip that wakes the
  // sender's progress thread after the send has returned (one host, 64 KiB
  // send/recv of 2 workers: 0.71 ms, eagerly 0.50 ms). Larger ones keep
  // the rendezvous's single copy.
  p.flags = UCP_AM_SEND_FLAG_REPLY;
  if (id == kAmControl && len <= kEagerControlBytes) {
    p.flags |= UCP_AM_SEND_FLAG_EAGER;
  }
  p.cb.send = &SendCb;
  p.user_data = c;
  ucs_status_ptr_t r = ucp_am_send_nbx(ep, id, c->hdr.data(), c->hdr.size(),
                                       const_cast<void*>(data), len, &p);
  if (r == nullptr) {
    FinishSend(c, UCS_OK);
  } else if (UCS_PTR_IS_ERR(r)) {
    ucs_status_t st = UCS_PTR_STATUS(r);
    c->state.reset();  // the caller reports the error; no completion
    FinishSend(c, st);
    Status e = UcsError(st, "send to " + peer());
    // The peer waits for this control message's number forever: the
    // channel cannot go on.
    if (id == kAmControl) Fail(e);
    return e;
  } else {
    Track(tracked);
    if (dev_->thread_index() != worker_->index()) worker_->Signal();
  }
  return Status::Ok();
}

void UcxChannel::SetHandlers(ControlHandler on_message,
                             FailureHandler on_failure) {
  inbox_.SetHandlers(std::move(on_message), std::move(on_failure));
}

void UcxChannel::Progress() {
  // Cheap when the progress thread is awake (nothing happens) and when the
  // worker is idle; it saves a thread wake-up for control messages and
  // active messages, which arrive on the worker even on the mapped protocol.
  worker_->HelpProgress();
}

Status UcxChannel::Submit(
    const std::shared_ptr<OpState>& state, const char* what,
    const std::function<ucs_status_ptr_t(ucp_ep_h, ucp_request_param_t*)>&
        post) {
  auto* c = new SendCtx;
  c->state = state;
  c->channel = this;
  c->requests = requests_;
  requests_->fetch_add(1, std::memory_order_acq_rel);
  state->set_progress(&UcxWorker::HelpProgress, worker_);
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.send = &SendCb;
  p.user_data = c;
  ucs_status_ptr_t req;
  {
    EndpointUse use(this);
    req = use.ep() == nullptr ? UCS_STATUS_PTR(UCS_ERR_CANCELED)
                              : post(use.ep(), &p);
  }
  if (req == nullptr) {
    FinishSend(c, UCS_OK);
  } else if (UCS_PTR_IS_ERR(req)) {
    c->state.reset();  // the caller reports the error; no completion
    FinishSend(c, UCS_PTR_STATUS(req));
    return UcsError(UCS_PTR_STATUS(req), std::string(what) + " to " + peer());
  } else {
    Track(state);
    if (dev_->thread_index() != worker_->index()) worker_->Signal();
  }
  return Status::Ok();
}

void UcxChannel::Track(const std::shared_ptr<OpState>& st) {
  // `st` is our own reference: the request's context may already be freed by
  // its completion on the progress thread.
  if (!st) return;
  Status failure;
  {
    MutexLock l(&mu_);
    if (st->done()) return;
    if (!failed_.load(std::memory_order_acquire)) {
      inflight_.insert(st);
      return;
    }
    failure = failure_;
  }
  // Posted on an endpoint whose channel already failed (the liveness
  // socket saw the peer die, Close() has not yet taken the endpoint): Fail()
  // swapped the in-flight set before this op joined it, and a shared-memory
  // lane never completes an op to a dead peer. Without this the caller
  // waits out its whole timeout (a memory node's executor: 30 s, during
  // which it answers no hello -- the suspected cause of restarted workers'
  // hellos timing out in CI).
  st->Complete(failure);
}

void UcxChannel::Untrack(const std::shared_ptr<OpState>& st) {
  MutexLock l(&mu_);
  inflight_.erase(st);
}

Protocol UcxChannel::ChooseProtocol() const {
  switch (dev_->options().protocol) {
    case ProtocolChoice::kRma:
      return Protocol::kRma;
    case ProtocolChoice::kActiveMessage:
      return Protocol::kActiveMessage;
    case ProtocolChoice::kAuto:
    case ProtocolChoice::kNoMapping:
      break;
  }
  if (peer_same_host_) {
    return dev_->options().protocol == ProtocolChoice::kAuto ? Protocol::kMapped
                                                             : Protocol::kRma;
  }
  return dev_->rdma_present() ? Protocol::kRma : Protocol::kActiveMessage;
}

Result<std::shared_ptr<RemoteMemRegion>> UcxChannel::Import(
    const RegionDescriptor& desc, std::chrono::nanoseconds timeout,
    bool verify_with_owner) {
  RETURN_IF_ERROR(CheckUsable());
  RETURN_IF_ERROR(CheckDescriptorShape(desc));
  if (verify_with_owner) {
    auto state = std::make_shared<OpState>(dev_->events());
    state->set_progress(&UcxWorker::HelpProgress, worker_);
    RETURN_IF_ERROR(rma_.CheckWithOwner(
        desc, std::move(state), timeout, [this](const MessageRma::Request& r) {
          return SendAm(kAmValidateReq, r.header, nullptr, 0, nullptr);
        }));
  }
  ucp_rkey_h rkey = nullptr;
  void* mapped = nullptr;
  if (protocol_ != Protocol::kActiveMessage) {
    // Safe to unpack: the owner has just vouched for these exact key bytes.
    ucs_status_t st = UCS_ERR_CANCELED;
    {
      EndpointUse use(this);
      if (use.ep()) {
        st = ucp_ep_rkey_unpack(use.ep(), desc.packed_rkey.data(), &rkey);
      }
    }
    if (st != UCS_OK) return UcsError(st, "cannot unpack the remote key");
    if (protocol_ == Protocol::kMapped &&
        ucp_rkey_ptr(rkey, desc.address, &mapped) != UCS_OK) {
      mapped =
          nullptr;  // user-registered memory: RMA through the data endpoint
    }
    // The owner's shared memory mapped here: in its 2 MiB pages too where
    // the kernel allows (membox/transport/huge_pages.h).
    if (mapped != nullptr) {
      FreshMapping(mapped, desc.length);
      AdviseHugePages(mapped, desc.length);
    }
  }
  SharedMapping file;
  if (protocol_ == Protocol::kMapped && mapped == nullptr && desc.shared_file) {
    // User memory the owner shares as a file: map it (load/store) rather
    // than reach it by RMA; RMA stays the way where that is refused.
    auto m = MapSharedFile(desc);
    if (m.ok()) {
      file = std::move(*m);
      mapped = file.data();
    } else {
      MEMBOX_LOG_WARN(
          "region {} of {}: shared file not mapped ({}); "
          "reaching it by RMA",
          desc.region_id, peer(), m.status().ToString());
    }
  }
  auto r = std::make_shared<UcxRemoteMemRegion>(desc, mapped, rkey, this,
                                                std::move(file));
  return std::shared_ptr<RemoteMemRegion>(std::move(r));
}

Result<OpHandle> UcxChannel::Memcpy(void* local_addr, const MemRegion& local,
                                    uint64_t remote_addr,
                                    const RemoteMemRegion& remote, size_t size,
                                    Direction direction, Completion cb) {
  RETURN_IF_ERROR(CheckUsable());
  auto* r = dynamic_cast<const UcxRemoteMemRegion*>(&remote);
  RETURN_IF_ERROR(CheckMemcpyArgs(local_addr, local, remote_addr, remote, size,
                                  r ? r->channel() : nullptr, this));
  if (size == 0) {
    if (cb) cb(Status::Ok());
    return OpHandle::Done(Status::Ok());
  }
  void* base = remote.mapped();
  if (base != nullptr && local.memory_type() == MemoryType::kHost) {
    // Load/store path: the peer's memory is mapped here (GPU memory takes
    // the RMA path below: UCX copies it with CUDA).
    char* p = static_cast<char*>(base) + (remote_addr - remote.address());
    if (direction == Direction::kWrite) {
      CopyBytes(p, local_addr, size);
    } else {
      CopyBytes(local_addr, p, size);
    }
    if (cb) cb(Status::Ok());
    return OpHandle::Done(Status::Ok());
  }
  if (protocol_ == Protocol::kActiveMessage) {
    return direction == Direction::kWrite
               ? AmWrite(local_addr, remote_addr, remote, size, std::move(cb))
               : AmRead(local_addr, remote_addr, remote, size, std::move(cb));
  }
  if (direction == Direction::kWrite) {
    rma_since_fence_.store(true, std::memory_order_release);
    rma_since_flush_.store(true, std::memory_order_release);
  }
  auto state = std::make_shared<OpState>(dev_->events(), std::move(cb));
  const ucp_rkey_h rkey = r->rkey();
  RETURN_IF_ERROR(Submit(
      state, "one-sided transfer", [&](ucp_ep_h ep, ucp_request_param_t* p) {
        return direction == Direction::kWrite
                   ? ucp_put_nbx(ep, local_addr, size, remote_addr, rkey, p)
                   : ucp_get_nbx(ep, local_addr, size, remote_addr, rkey, p);
      }));
  return OpHandle(std::move(state));
}

Result<OpHandle> UcxChannel::AmWrite(const void* local, uint64_t raddr,
                                     const RemoteMemRegion& remote, size_t size,
                                     Completion cb) {
  auto state = std::make_shared<OpState>(dev_->events(), std::move(cb));
  RETURN_IF_ERROR(SendAm(
      kAmWrite, MessageRma::WriteHeader(raddr, remote.descriptor(), size),
      local, size, state));
  return OpHandle(std::move(state));
}

Result<OpHandle> UcxChannel::AmRead(void* local, uint64_t raddr,
                                    const RemoteMemRegion& remote, size_t size,
                                    Completion cb) {
  auto state = std::make_shared<OpState>(dev_->events(), std::move(cb));
  state->set_progress(&UcxWorker::HelpProgress, worker_);
  RETURN_IF_ERROR(SendRequest(
      kAmReadReq, rma_.Read(local, size, raddr, remote.descriptor(), state)));
  return OpHandle(std::move(state));
}

Status UcxChannel::Fence() {
  RETURN_IF_ERROR(CheckUsable());
  switch (protocol_) {
    case Protocol::kMapped:
      // Stores before the fence are ordered before stores after it (and the
      // compiler may not move memcpy across it). Regions that could not be
      // mapped (user-registered memory) go through RMA; fence the worker only
      // if such a write was issued since the last fence.
      std::atomic_thread_fence(std::memory_order_release);
      if (!rma_since_fence_.exchange(false, std::memory_order_acq_rel))
        return Status::Ok();
      [[fallthrough]];
    case Protocol::kRma: {
      ucs_status_t st = ucp_worker_fence(worker_->worker());
      if (st != UCS_OK) return UcsError(st, "ucp_worker_fence");
      return Status::Ok();
    }
    case Protocol::kTcp:  // never a UCX channel's protocol
    case Protocol::kActiveMessage: {
      bool ok = SpinThenBlock(
          [this] {
            return am_writes_in_flight_.load(std::memory_order_acquire) == 0 ||
                   failed_.load();
          },
          dev_->events(), std::chrono::seconds(60));
      if (failed_.load()) return health();
      if (!ok)
        return DeadlineExceededError("fence: earlier writes still in flight");
      return Status::Ok();
    }
  }
  return Status::Ok();
}

Result<OpHandle> UcxChannel::Flush(Completion cb) {
  RETURN_IF_ERROR(CheckUsable());
  if (Status e = rma_.TakeAsyncError(); !e.ok()) {
    if (cb) cb(e);
    return OpHandle::Done(e);
  }
  if (protocol_ == Protocol::kMapped &&
      !rma_since_flush_.exchange(false, std::memory_order_acq_rel)) {
    // Only stores through the mapping since the last flush: already visible.
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (cb) cb(Status::Ok());
    return OpHandle::Done(Status::Ok());
  }
  auto state = std::make_shared<OpState>(dev_->events(), std::move(cb));
  if (protocol_ == Protocol::kActiveMessage) {
    state->set_progress(&UcxWorker::HelpProgress, worker_);
    RETURN_IF_ERROR(SendRequest(kAmFlushReq, rma_.Flush(state)));
    return OpHandle(std::move(state));
  }
  RETURN_IF_ERROR(
      Submit(state, "flush", [&](ucp_ep_h ep, ucp_request_param_t* p) {
        return ucp_ep_flush_nbx(ep, p);
      }));
  return OpHandle(std::move(state));
}

Status UcxChannel::SendControl(std::span<const uint8_t> msg) {
  if (msg.size() > kMaxControlMessage) {
    return InvalidArgumentError("control message of " +
                                std::to_string(msg.size()) +
                                " bytes exceeds the limit");
  }
  return SendAm(kAmControl, {}, msg.data(), msg.size(), nullptr);
}

Result<std::vector<uint8_t>> UcxChannel::RecvControl(
    std::chrono::nanoseconds timeout) {
  return inbox_.Receive(timeout, peer(), [this] { Progress(); });
}

void UcxChannel::RecvInto(void* desc, void* dst, size_t len,
                          const ucp_am_recv_param_t*,
                          std::function<void(const Status&)> done) {
  struct Ctx {
    std::function<void(const Status&)> done;
  };
  auto* c = new Ctx{std::move(done)};
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.recv_am = [](void* req, ucs_status_t st, size_t, void* ud) {
    auto* c = static_cast<Ctx*>(ud);
    c->done(st == UCS_OK ? Status::Ok() : UcsError(st, "receive"));
    delete c;
    ucp_request_free(req);
  };
  p.user_data = c;
  ucs_status_ptr_t r =
      ucp_am_recv_data_nbx(worker_->worker(), desc, dst, len, &p);
  if (r == nullptr) {
    c->done(Status::Ok());
    delete c;
  } else if (UCS_PTR_IS_ERR(r)) {
    c->done(UcsError(UCS_PTR_STATUS(r), "receive"));
    delete c;
  }
}

void UcxChannel::SendError(const Status& s) {
  (void)SendAm(kAmError, MessageRma::ErrorHeader(s), nullptr, 0, nullptr);
}

Status UcxChannel::SendRequest(AmId id, Result<MessageRma::Request> request) {
  RETURN_IF_ERROR(request.status());
  Status s = SendAm(id, request->header, nullptr, 0, nullptr);
  if (!s.ok()) rma_.Withdraw(request->id);
  return s;
}

void UcxChannel::DeliverInOrder(uint64_t seq, std::vector<uint8_t> m) {
  Status bad;
  {
    MutexLock l(&control_in_mu_);
    if (seq < control_in_next_ || control_early_.count(seq)) {
      bad = DataLossError("control message " + std::to_string(seq) +
                          " arrived twice");
    } else if (seq - control_in_next_ > kMaxEarlyControl ||
               control_early_bytes_ + m.size() > kMaxEarlyControlBytes) {
      bad = ResourceExhaustedError(
          "control message " + std::to_string(seq) + " arrived while " +
          std::to_string(control_in_next_) + " is still missing (" +
          std::to_string(control_early_.size()) + " held)");
    } else if (seq != control_in_next_) {
      // An earlier one is still on its way (a rendezvous message completes
      // after an eager one sent later): it waits.
      control_early_bytes_ += m.size();
      control_early_.emplace(seq, std::move(m));
      return;
    } else {
      // In order, under the lock: the next message cannot overtake this one
      // on another thread that progresses the worker.
      inbox_.Deliver(std::move(m));
      ++control_in_next_;
      for (auto it = control_early_.begin();
           it != control_early_.end() && it->first == control_in_next_;
           it = control_early_.erase(it)) {
        control_early_bytes_ -= it->second.size();
        inbox_.Deliver(std::move(it->second));
        ++control_in_next_;
      }
      return;
    }
  }
  MEMBOX_LOG_WARN("channel to {}: {}", peer(), bad.ToString());
  Fail(bad);
}

void UcxChannel::WriteReceived() {
  for (auto& answer : rma_.EndWrite())
    (void)SendAm(kAmFlushResp, answer, nullptr, 0, nullptr);
}

ucs_status_t UcxChannel::OnAm(AmId id, const void* header, size_t hlen,
                              void* data, size_t len,
                              const ucp_am_recv_param_t* param) {
  std::span<const uint8_t> hdr(static_cast<const uint8_t*>(header), hlen);
  const bool rndv = param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV;
  auto drop = [&](const Status& why) {
    MEMBOX_LOG_WARN("dropping active message {} from {}: {}",
                    static_cast<int>(id), peer(), why.ToString());
    // Returning UCS_OK without starting the receive makes UCX drop a
    // rendezvous message itself (it acknowledges the sender and frees the
    // descriptor): releasing it here as well freed it twice.
    return UCS_OK;
  };
  switch (id) {
    case kAmControl: {
      // Each one is numbered; a message not delivered would stall every
      // later one, so a bad one fails the channel instead of being dropped.
      auto seq = msg::DecodeId(hdr);
      Status bad;
      if (!seq.ok()) {
        bad = DataLossError("control message without a sequence number");
      } else if (len > kMaxControlMessage) {
        bad = InvalidArgumentError("control message of " + std::to_string(len) +
                                   " bytes is too large");
      }
      if (!bad.ok()) {
        // (a rendezvous message: UCX drops it when we return UCS_OK)
        MEMBOX_LOG_WARN("channel to {}: {}", peer(), bad.ToString());
        Fail(bad);
        return UCS_OK;
      }
      auto buf = std::make_shared<std::vector<uint8_t>>(len);
      auto deliver = [this, buf, n = *seq](const Status& s) {
        if (!s.ok()) return Fail(s.WithContext("control message receive"));
        DeliverInOrder(n, std::move(*buf));
      };
      if (rndv) {
        RecvInto(data, buf->data(), len, param, deliver);
      } else {
        if (len) std::memcpy(buf->data(), data, len);
        deliver(Status::Ok());
      }
      return UCS_OK;
    }
    case kAmValidateReq: {
      auto answer = rma_.AnswerValidate(hdr);
      if (!answer.ok()) return drop(answer.status());
      (void)SendAm(kAmValidateResp, *answer, nullptr, 0, nullptr);
      return UCS_OK;
    }
    case kAmValidateResp:
    case kAmFlushResp: {
      Status s = id == kAmValidateResp ? rma_.OnValidateAnswer(hdr)
                                       : rma_.OnFlushAnswer(hdr);
      if (!s.ok()) return drop(s);
      return UCS_OK;
    }
    case kAmWrite: {
      auto w = rma_.AdmitWrite(hdr, len, FenceFor());
      if (!w.ok()) return drop(w.status());
      if (!w->refused.ok()) {
        // (a rendezvous message: UCX drops it when we return UCS_OK)
        (void)SendAm(kAmError, w->error_header, nullptr, 0, nullptr);
        return UCS_OK;
      }
      if (rndv) {
        rma_.BeginWrite();
        RecvInto(data, w->dst, len, param,
                 [this, l = std::move(w->lease)](const Status& st) mutable {
                   l.reset();
                   if (!st.ok())
                     SendError(st.WithContext("write receive failed"));
                   WriteReceived();
                 });
      } else if (len) {
        std::memcpy(w->dst, data, len);
      }
      return UCS_OK;
    }
    case kAmReadReq: {
      auto a = rma_.AnswerRead(hdr, FenceFor());
      if (!a.ok()) return drop(a.status());
      // The source is the registered region itself: the send's completion
      // keeps the lease, so the range is not freed while UCX reads it.
      auto st = std::make_shared<OpState>(
          nullptr, [held = std::move(a->lease)](const Status&) mutable {
            held.reset();
          });
      (void)SendAm(kAmReadResp, a->header, a->src, a->len, st);
      return UCS_OK;
    }
    case kAmReadResp: {
      // A failed read, or one of the wrong length, is completed there; a
      // rendezvous message is then dropped by UCX when we return UCS_OK.
      auto target = rma_.OnReadAnswer(hdr, len);
      if (!target.ok()) return drop(target.status());
      if (target->local == nullptr) return UCS_OK;
      if (rndv) {
        RecvInto(
            data, target->local, len, param,
            [state = target->state](const Status& st) { state->Complete(st); });
      } else {
        if (len) std::memcpy(target->local, data, len);
        target->state->Complete(Status::Ok());
      }
      return UCS_OK;
    }
    case kAmFlushReq: {
      auto answer = rma_.OnFlushRequest(hdr);
      if (!answer.ok()) return drop(answer.status());
      // Held back while rendezvous writes are still arriving (WriteReceived).
      if (*answer) (void)SendAm(kAmFlushResp, **answer, nullptr, 0, nullptr);
      return UCS_OK;
    }
    case kAmError: {
      Status s = rma_.OnError(hdr, peer());
      if (!s.ok()) return drop(s);
      return UCS_OK;
    }
    case kAmCount:
      break;
  }
  return drop(InvalidArgumentError("unknown message id"));
}

}  // namespace membox::transport::ucx
