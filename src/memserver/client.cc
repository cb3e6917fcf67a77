#include "membox/memserver/client.h"

#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>

#include <unistd.h>

#include "membox/base/hmac.h"
#include "membox/base/logging.h"
#include "membox/base/mutex.h"
#include "membox/base/wait.h"
#include "membox/service/client.h"
#include "membox/transport/device.h"
#include "membox/transport/registered_pool.h"

#include "src/memserver/protocol.h"

namespace membox::memserver {
namespace {

using proto::Op;
using proto::Request;
using proto::Response;
using transport::Channel;

class SegmentImpl final : public Segment {
 public:
  SegmentImpl(const SegmentKey& key, size_t size, bool master,
              transport::RegisteredPool::Block cache,
              std::shared_ptr<transport::RemoteMemRegion> remote)
      : Segment(key, size, master, cache.data()),
        cache_(std::move(cache)),
        remote_(std::move(remote)) {}
  void* Map() const override { return remote_->mapped(); }
  const transport::MemRegion& cache() const { return cache_.region(); }
  const transport::RemoteMemRegion& remote() const { return *remote_; }

 private:
  transport::RegisteredPool::Block cache_;  // in a registered arena
  std::shared_ptr<transport::RemoteMemRegion> remote_;
};

class ClientImpl final : public Client {
 public:
  explicit ClientImpl(ClientOptions o) : opt_(std::move(o)) {}

  ~ClientImpl() override {
    {
      MutexLock l(&hb_mu_);
      stop_ = true;
    }
    hb_cv_.NotifyAll();
    if (heartbeat_.joinable()) heartbeat_.join();
    {
      MutexLock l(&mu_);
      segments_.clear();  // local caches; the server releases our attachments
    }
    {
      MutexLock l(&arena_mu_);
      arenas_.clear();  // registered memory goes before its device
    }
    // Closes the channel; pending calls fail with kAborted.
    node_.reset();
    channel_.reset();
    device_.reset();
  }

  Status Init() {
    if (opt_.server.empty())
      return InvalidArgumentError("no memory-node address given");
    transport::DeviceOptions d;
    d.transports = opt_.transports;
    d.secret = opt_.secret;
    d.name = opt_.name;
    ASSIGN_OR_RETURN(device_, transport::Device::Create(d));
    service::ClientOptions co;
    co.node_kind = "memory node";
    ASSIGN_OR_RETURN(node_,
                     service::Client::Connect(*device_, opt_.server, co));
    channel_ = node_->channel_ptr();
    Request q;
    q.op = Op::kRegister;
    q.name = opt_.name;
    q.pid = static_cast<uint32_t>(getpid());
    ASSIGN_OR_RETURN(Response a, Call(q));
    client_id_ = a.client_id;
    challenge_ = a.challenge;
    auto period =
        std::chrono::milliseconds(std::max<uint32_t>(a.heartbeat_ms / 4, 50));
    heartbeat_ = std::thread([this, period] { HeartbeatLoop(period); });
    return Status::Ok();
  }

  Result<Segment*> Create(const SegmentKey& key, size_t size) override {
    return Open(Op::kCreate, key, size);
  }
  Result<Segment*> Attach(const SegmentKey& key, size_t size) override {
    return Open(Op::kAttach, key, size);
  }

  Status Detach(Segment* s) override { return Close(s, Op::kDetach); }
  Status Delete(Segment* s) override { return Close(s, Op::kDelete); }

  Status ReadSync(Segment* s, size_t offset, size_t length) override {
    return Sync(s, offset, length, transport::Direction::kRead);
  }
  Status WriteSync(Segment* s, size_t offset, size_t length) override {
    return Sync(s, offset, length, transport::Direction::kWrite);
  }

  Status Accumulate(Segment* dst, Segment* src, DType dtype, double scale,
                    size_t offset, size_t length) override {
    ASSIGN_OR_RETURN(Request q,
                     AccumulateRequest(dst, src, dtype, scale, offset, length));
    return Call(q).status();
  }

  service::Call AccumulateAsync(Segment* dst, Segment* src, DType dtype,
                                double scale, size_t offset,
                                size_t length) override {
    auto q = AccumulateRequest(dst, src, dtype, scale, offset, length);
    if (!q.ok()) return service::Call::Done(q.status());
    service::Call call = service::Call::Make(1);
    call.state()->set_progress([ch = channel_] { ch->Progress(); });
    node_->SendPart(static_cast<uint16_t>(Op::kAccumulate),
                    proto::EncodeRequest(*q), call.state());
    return call;
  }

  Result<std::string> ServerStatus(const std::string& admin_secret) override {
    Request q;
    q.op = Op::kStatus;
    if (!admin_secret.empty()) {
      Digest proof = AdminProof(admin_secret, challenge_);
      q.admin_proof.assign(proof.begin(), proof.end());
    }
    ASSIGN_OR_RETURN(Response a, Call(q));
    return a.text;
  }

  Segment* Find(const void* p) const override {
    MutexLock l(&mu_);
    auto addr = reinterpret_cast<uintptr_t>(p);
    auto it = by_addr_.upper_bound(addr);
    if (it == by_addr_.begin()) return nullptr;
    --it;
    Segment* s = it->second;
    if (addr >= it->first + s->size()) return nullptr;
    return s;
  }

  Status health() const override {
    RETURN_IF_ERROR(node_->health());
    Status h = channel_->health();
    if (!h.ok())
      return UnavailableError("memory node " + opt_.server +
                              " is unreachable: " + std::string(h.message()));
    return Status::Ok();
  }

 private:
  Result<Request> AccumulateRequest(Segment* dst, Segment* src, DType dtype,
                                    double scale, size_t offset,
                                    size_t length) const {
    RETURN_IF_ERROR(CheckOwned(dst));
    RETURN_IF_ERROR(CheckOwned(src));
    Request q;
    q.op = Op::kAccumulate;
    q.key = dst->key();
    q.src_key = src->key();
    q.dtype = static_cast<uint8_t>(dtype);
    q.scale = scale;
    q.offset = offset;
    q.length = length;
    return q;
  }

  Status CheckOwned(Segment* s) const {
    MutexLock l(&mu_);
    if (s == nullptr || !segments_.count(s)) {
      return InvalidArgumentError("not a segment of this client");
    }
    return Status::Ok();
  }

  Result<Segment*> Open(Op op, const SegmentKey& key, size_t size) {
    if (size == 0) return InvalidArgumentError("segment size 0");
    Request q;
    q.op = op;
    q.key = key;
    q.size = size;
    ASSIGN_OR_RETURN(Response a, Call(q));
    if (a.size != size)
      return DataLossError("server answered with a different size");
    auto undo = [&] {
      Request d;
      d.op = op == Op::kCreate ? Op::kDelete : Op::kDetach;
      d.key = a.key;
      (void)Call(d);
    };
    auto desc = transport::RegionDescriptor::Deserialize(a.descriptor);
    if (!desc.ok()) {
      undo();
      return desc.status().WithContext("segment descriptor from the server");
    }
    // The server just produced this descriptor in its authenticated reply:
    // no second round trip to verify it.
    auto remote =
        channel_->Import(*desc, opt_.timeout, /*verify_with_owner=*/false);
    auto cache = AllocateCache(size);
    if (!remote.ok() || !cache.ok()) {
      undo();
      return !remote.ok() ? remote.status() : cache.status();
    }
    auto seg = std::make_unique<SegmentImpl>(
        a.key, size, op == Op::kCreate, std::move(*cache), std::move(*remote));
    Segment* raw = seg.get();
    MutexLock l(&mu_);
    by_addr_[reinterpret_cast<uintptr_t>(raw->data())] = raw;
    segments_[raw] = std::move(seg);
    return raw;
  }

  // Local cache buffers come from registered arenas, so attaching a segment
  // registers memory only when no arena has room (a new arena of at least
  // kArenaBytes). Registration stays off the attach path in steady state.
  static constexpr size_t kArenaBytes = 64 << 20;
  Result<transport::RegisteredPool::Block> AllocateCache(size_t size) {
    MutexLock l(&arena_mu_);
    for (auto& arena : arenas_) {
      auto b = arena->Allocate(size);
      if (b.ok()) return b;
    }
    size_t bytes = std::max(kArenaBytes, (size + 4095) & ~size_t{4095});
    ASSIGN_OR_RETURN(auto arena,
                     transport::RegisteredPool::Create(*device_, bytes));
    arenas_.push_back(arena);
    return arena->Allocate(size);
  }

  Status Close(Segment* s, Op op) {
    RETURN_IF_ERROR(CheckOwned(s));
    Request q;
    q.op = op;
    q.key = s->key();
    Status st = Call(q).status();
    if (!st.ok() && st.code() == StatusCode::kPermissionDenied) return st;
    MutexLock l(&mu_);
    by_addr_.erase(reinterpret_cast<uintptr_t>(s->data()));
    segments_.erase(s);
    return st;
  }

  Status Sync(Segment* s, size_t offset, size_t length,
              transport::Direction dir) {
    RETURN_IF_ERROR(CheckOwned(s));
    if (offset > s->size() || length > s->size() - offset) {
      return OutOfRangeError("sync range [" + std::to_string(offset) + ", +" +
                             std::to_string(length) +
                             ") outside a segment of " +
                             std::to_string(s->size()) + " bytes");
    }
    if (length == 0) return Status::Ok();
    auto* seg = static_cast<SegmentImpl*>(s);
    auto op = channel_->Memcpy(static_cast<char*>(seg->data()) + offset,
                               seg->cache(), seg->remote().address() + offset,
                               seg->remote(), length, dir);
    if (!op.ok()) return Annotate(op.status());
    RETURN_IF_ERROR(Annotate(op->Wait(opt_.timeout)));
    if (dir == transport::Direction::kWrite) {
      auto f = channel_->Flush();
      if (!f.ok()) return Annotate(f.status());
      RETURN_IF_ERROR(Annotate(f->Wait(opt_.timeout)));
      bytes_written_.fetch_add(length);
    } else {
      bytes_read_.fetch_add(length);
    }
    return Status::Ok();
  }

  // Transport failures name the memory node, whether the channel already
  // noticed (health) or UCX refused the submission first.
  Status Annotate(const Status& s) const {
    if (s.ok()) return s;
    if (!channel_->health().ok()) return health();
    if (s.code() == StatusCode::kUnavailable ||
        s.code() == StatusCode::kAborted) {
      return UnavailableError("memory node " + opt_.server +
                              " unreachable: " + std::string(s.message()));
    }
    return s;
  }

  // One request and its reply; an ok reply body the client cannot decode
  // fails the node (service::Client's policy).
  Result<Response> Call(const Request& q) {
    auto r = node_->CallDecoded<Response>(
        static_cast<uint16_t>(q.op), proto::EncodeRequest(q),
        [](std::span<const uint8_t> b) { return proto::DecodeResponse(b); },
        opt_.timeout);
    if (!r.ok()) {
      return Status(r.status().code(), std::string(proto::OpName(q.op)) + ": " +
                                           std::string(r.status().message()));
    }
    return r;
  }

  void HeartbeatLoop(std::chrono::milliseconds period) {
    for (;;) {
      {
        MutexLock l(&hb_mu_);
        if (!stop_) hb_cv_.WaitFor(&hb_mu_, period);
        if (stop_) return;
      }
      Request q;
      q.op = Op::kHeartbeat;
      q.bytes_read = bytes_read_.load();
      q.bytes_written = bytes_written_.load();
      (void)node_->Notify(static_cast<uint16_t>(Op::kHeartbeat),
                          proto::EncodeRequest(q));
    }
  }

  ClientOptions opt_;
  std::unique_ptr<transport::Device> device_;
  std::unique_ptr<service::Client> node_;
  std::shared_ptr<Channel> channel_;  // node_'s, for segment transfers
  uint64_t client_id_ = 0;
  std::vector<uint8_t> challenge_;  // from the server, for admin proofs
  std::atomic<uint64_t> bytes_read_{0}, bytes_written_{0};

  Mutex arena_mu_;
  std::vector<std::shared_ptr<transport::RegisteredPool>> arenas_
      MEMBOX_GUARDED_BY(arena_mu_);

  mutable Mutex mu_;
  std::map<Segment*, std::unique_ptr<SegmentImpl>> segments_
      MEMBOX_GUARDED_BY(mu_);
  std::map<uintptr_t, Segment*> by_addr_ MEMBOX_GUARDED_BY(mu_);

  Mutex hb_mu_;
  CondVar hb_cv_;
  bool stop_ MEMBOX_GUARDED_BY(hb_mu_) = false;
  std::thread heartbeat_;
};

}  // namespace

Result<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  return MakeInitialized<Client, ClientImpl>(options);
}

}  // namespace membox::memserver
