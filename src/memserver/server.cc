#include "membox/memserver/server.h"

#include <atomic>
#include <bit>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "membox/base/accumulate.h"
#include "membox/base/config.h"
#include "membox/base/hmac.h"
#include "membox/base/logging.h"
#include "membox/base/mutex.h"
#include "membox/memserver/segment_key.h"
#include "membox/service/server.h"
#include "membox/transport/device.h"

#include "src/memserver/buddy_allocator.h"
#include "src/memserver/protocol.h"

namespace membox::memserver {
namespace {

using Clock = std::chrono::steady_clock;
using proto::Op;
using proto::Request;
using proto::Response;
using transport::Channel;

// Where a segment lives in the table: keys are per principal, so two
// principals' equal keys name different segments and neither can learn that
// the other's exists.
struct SegmentName {
  std::string owner;  // the creating principal's name
  SegmentKey key;
  friend auto operator<=>(const SegmentName&, const SegmentName&) = default;
};

struct Segment {
  SegmentKey key;
  uint64_t offset = 0;
  uint64_t size = 0;
  uint64_t master = 0;  // 0 while orphaned
  std::string master_name;
  // The principal that created it (base/credential.h): its quota pays for
  // the segment until the memory is freed, and only it may attach or adopt
  // it (the cluster principal may do everything).
  Principal owner;
  bool orphaned = false;
  Clock::time_point orphaned_since;
  std::set<uint64_t> attached;
  bool deleted = false;
  bool ready = false;  // zeroed; others may attach
  int busy = 0;        // accumulates running on it
  transport::RegionDescriptor desc;
  std::vector<uint8_t> desc_bytes;
  Mutex accumulate_mu;  // serialises accumulates into this segment
};

using Segments = std::map<SegmentName, std::shared_ptr<Segment>>;

struct ClientState {
  uint64_t id = 0;      // the service layer's connection id
  Principal principal;  // who the connection proved to be
  std::string name;
  uint32_t pid = 0;
  bool registered = false;
  std::set<SegmentName> attached;
  uint64_t created_bytes = 0;
  uint64_t bytes_read = 0;  // as last reported by the client
  uint64_t bytes_written = 0;
  std::vector<uint8_t> challenge;  // for admin proofs (kRegister reply)
};

bool IsPowerOfTwo(uint64_t v) { return v != 0 && (v & (v - 1)) == 0; }

// Runs on a service::Server with a pool of handler threads (requests of
// different clients, and accumulates, run in parallel; the tables below are
// under mu_). The service layer drops clients that do not register within
// 10 s or, once registered, miss heartbeats for heartbeat_timeout (timed on
// arrival, so a backlog of requests never makes a live client look silent).
class ServerImpl final : public Server, public service::Service {
 public:
  explicit ServerImpl(ServerOptions o) : opt_(std::move(o)) {}
  ~ServerImpl() override { Stop(); }

  Status Init() {
    if (opt_.secret.size() < 8) {
      return InvalidArgumentError("the server secret must be at least 8 bytes");
    }
    if (!IsPowerOfTwo(opt_.min_block) || !IsPowerOfTwo(opt_.max_block)) {
      return InvalidArgumentError("min/max block sizes must be powers of two");
    }
    int min_order = std::countr_zero(opt_.min_block);
    int max_order = std::countr_zero(opt_.max_block);
    if (opt_.pool_bytes % opt_.min_block != 0) {
      return InvalidArgumentError(
          "pool size must be a multiple of the smallest block");
    }
    ASSIGN_OR_RETURN(auto buddy, BuddyAllocator::Create(opt_.pool_bytes,
                                                        min_order, max_order));
    {
      MutexLock l(&mu_);  // before any handler runs; for the analysis
      buddy_ = std::make_unique<BuddyAllocator>(std::move(buddy));
    }
    sync_ = std::make_unique<SyncCores>(opt_.sync_cores);
    service::ServerOptions so;
    so.device.listen_address = opt_.listen;
    so.device.transports = opt_.transports;
    so.device.secret = opt_.secret;
    so.device.admit = opt_.admit;
    so.device.name = "membox-serve";
    so.device.progress_threads = 1;
    so.service = "memory node";
    so.handler_threads = std::max(1, opt_.handler_threads);
    so.hello_timeout = std::chrono::seconds(10);
    so.idle_timeout = opt_.heartbeat_timeout;
    ASSIGN_OR_RETURN(server_, service::Server::Create(so, this));
    RETURN_IF_ERROR(server_->Serve());
    endpoint_ = server_->endpoint();
    server_->Every(std::chrono::milliseconds(100),
                   [this] { ReclaimOrphans(Clock::now()); });
    MEMBOX_LOG_INFO(
        "memory node listening on {}: pool {}, blocks {}..{}, {} sync cores",
        endpoint_, FormatByteSize(opt_.pool_bytes),
        FormatByteSize(opt_.min_block), FormatByteSize(opt_.max_block),
        sync_->threads());
    return Status::Ok();
  }

  std::string endpoint() const override { return endpoint_; }

  void Stop() override {
    if (!server_ || stopped_.exchange(true)) return;
    // Ends the handlers and closes every connection.
    server_->Stop();
    std::vector<uint64_t> ids;
    {
      MutexLock l(&mu_);
      for (auto& [id, c] : clients_) ids.push_back(id);
    }
    for (uint64_t id : ids)
      ReleaseClient(id, AbortedError("server shutting down"));
    {
      MutexLock l(&mu_);
      segments_.clear();
    }
    sync_.reset();
    pool_.reset();  // registered memory goes before its device
    server_.reset();
    MEMBOX_LOG_INFO("memory node stopped");
  }

  void Metrics(MetricsWriter& w) const override {
    const ServerStats s = Stats();
    w.Gauge("membox_pool_bytes", "Size of the memory pool.", s.pool_bytes);
    w.Gauge("membox_pool_allocated_bytes", "Pool bytes in segments.",
            s.allocated_bytes);
    w.Gauge("membox_pool_largest_free_block_bytes",
            "Largest segment the pool can still give.", s.largest_free_block);
    w.Gauge("membox_segments", "Segments allocated.", s.segments);
    w.Gauge("membox_memory_clients",
            "Clients registered with the memory "
            "server.",
            s.clients);
    w.Counter("membox_accumulates_total", "Accumulate requests served.",
              s.accumulates);
    w.Counter("membox_accumulated_bytes_total", "Bytes summed by accumulates.",
              s.bytes_accumulated);
    w.Counter("membox_one_sided_read_bytes_total",
              "Bytes clients read from segments (their heartbeats' count).",
              s.bytes_read);
    w.Counter("membox_one_sided_written_bytes_total",
              "Bytes clients wrote into segments (their heartbeats' count).",
              s.bytes_written);
    if (server_) service::WriteServerMetrics(*server_, "memory", w);
  }

  ServerStats Stats() const override {
    MutexLock l(&mu_);
    ServerStats s;
    BuddyStats b = buddy_->Stats();
    s.pool_bytes = b.pool_bytes;
    s.allocated_bytes = b.allocated_bytes;
    s.free_bytes = b.free_bytes;
    s.largest_free_block = b.largest_free_block;
    s.external_fragmentation = b.external_fragmentation;
    s.internal_fragmentation = b.internal_fragmentation;
    s.segments = segments_.size();
    s.clients = clients_.size();
    s.bytes_accumulated = bytes_accumulated_.load();
    s.accumulates = accumulates_.load();
    s.requests = requests_.load();
    s.rejected_requests = rejected_.load();
    s.clients_released = released_.load();
    s.bytes_read = departed_read_;
    s.bytes_written = departed_written_;
    for (auto& [id, c] : clients_) {
      s.bytes_read += c.bytes_read;
      s.bytes_written += c.bytes_written;
    }
    return s;
  }

  std::string StatusText() const override { return StatusTextFor(0, true); }

  void SetServices(
      std::vector<std::pair<std::string, std::string>> services) override {
    MutexLock l(&mu_);
    services_ = std::move(services);
    services_set_ = true;
  }

  // `viewer` sees the pool totals and its own client and segments (created
  // or attached); `full` shows everything.
  std::string StatusTextFor(uint64_t viewer, bool full) const {
    ServerStats s = Stats();
    std::ostringstream o;
    o << "endpoint " << endpoint() << "\n"
      << "pool_bytes " << s.pool_bytes << "\n"
      << "allocated_bytes " << s.allocated_bytes << "\n"
      << "free_bytes " << s.free_bytes << "\n"
      << "largest_free_block " << s.largest_free_block << "\n"
      << "external_fragmentation " << s.external_fragmentation << "\n"
      << "internal_fragmentation " << s.internal_fragmentation << "\n"
      << "segments " << s.segments << "\n"
      << "clients " << s.clients << "\n"
      << "clients_released " << s.clients_released << "\n"
      << "requests " << s.requests << "\n"
      << "rejected_requests " << s.rejected_requests << "\n"
      << "accumulates " << s.accumulates << "\n"
      << "bytes_accumulated " << s.bytes_accumulated << "\n"
      << "bytes_read " << s.bytes_read << "\n"
      << "bytes_written " << s.bytes_written << "\n";
    MutexLock l(&mu_);
    if (services_set_) o << "services " << services_.size() << "\n";
    for (const auto& [name, at] : services_) {
      o << "service " << name << " " << at << "\n";
    }
    auto vit = clients_.find(viewer);
    if (vit != clients_.end() && !vit->second.principal.cluster) {
      const Principal& p = vit->second.principal;
      if (p.may(kRightAdmin)) full = true;
      auto held = held_by_.find(p.name);
      o << "principal " << p.name << " serial " << p.serial << " held_bytes "
        << (held == held_by_.end() ? 0 : held->second) << " quota_bytes "
        << p.QuotaOf(opt_.pool_bytes, QuotaBytes()) << "\n";
    }
    for (auto& [key, seg] : segments_) {
      if (!full && seg->master != viewer && !seg->attached.count(viewer)) {
        continue;
      }
      o << "segment " << key.key.ToString() << " owner " << key.owner
        << " size " << seg->size << " master " << seg->master << " attached "
        << seg->attached.size() << (seg->deleted ? " deleting" : "")
        << (seg->orphaned ? " orphaned" : "") << "\n";
    }
    for (auto& [id, c] : clients_) {
      if (!full && id != viewer) continue;
      o << "client " << id << " name " << (c.name.empty() ? "-" : c.name)
        << " pid " << c.pid << " attached " << c.attached.size()
        << " created_bytes " << c.created_bytes
        << (c.registered ? "" : " unregistered") << "\n";
    }
    return o.str();
  }

 private:
  // ------------------------------------------------------------ service

  Status OnStart(transport::Device& device) override {
    // The pool is registered once; segments are ranges of it.
    ASSIGN_OR_RETURN(pool_, device.AllocateMemRegion(opt_.pool_bytes));
    return Status::Ok();
  }

  void OnConnect(service::ConnectionId id, const std::string& peer) override {
    auto ch = server_->channel(id);
    MutexLock l(&mu_);
    clients_[id].id = id;
    if (ch) clients_[id].principal = ch->principal();
    MEMBOX_LOG_DEBUG("client {} connected from {}", id, peer);
  }

  void OnDisconnect(service::ConnectionId id, const Status& why) override {
    ReleaseClient(id, why);
  }

  // Deletes orphaned segments whose grace period ended.
  void ReclaimOrphans(Clock::time_point now) {
    if (opt_.orphan_grace.count() <= 0) return;
    MutexLock l(&mu_);
    std::vector<std::shared_ptr<Segment>> late;
    for (auto& [key, seg] : segments_) {
      if (seg->orphaned && !seg->deleted &&
          now - seg->orphaned_since >= opt_.orphan_grace) {
        late.push_back(seg);
      }
    }
    for (auto& seg : late) {
      MEMBOX_LOG_INFO(
          "segment {} of {} reclaimed: its master did not come back within "
          "{} ms ({} attachments remain)",
          seg->key.ToString(), seg->master_name, opt_.orphan_grace.count(),
          seg->attached.size());
      seg->deleted = true;
      MaybeFreeLocked(seg);
    }
  }

  // ------------------------------------------------------------ requests

  void OnRequest(const service::Request& r) override {
    requests_.fetch_add(1);
    const uint64_t client = r.conn;
    bool registered;
    {
      MutexLock l(&mu_);
      auto it = clients_.find(client);
      if (it == clients_.end()) return;  // released meanwhile
      registered = it->second.registered;
    }
    auto req = proto::DecodeRequest(r.method, r.body);
    if (!req.ok()) {
      rejected_.fetch_add(1);
      MEMBOX_LOG_WARN("client {}: {}", client, req.status().ToString());
      server_->Reply(r, req.status());
      return;
    }
    if (req->op != Op::kRegister && !registered) {
      rejected_.fetch_add(1);
      server_->Reply(r, UnauthenticatedError("register first"));
      return;
    }
    Response a;
    Status s;
    switch (req->op) {
      case Op::kRegister:
        s = DoRegister(client, *req, &a);
        break;
      case Op::kCreate:
        s = DoCreate(client, *req, &a);
        if (s.ok()) ZeroAndPublish(client, a.key);
        break;
      case Op::kAttach:
        s = DoAttach(client, *req, &a);
        break;
      case Op::kDetach:
        s = DoDetach(client, req->key, false);
        break;
      case Op::kDelete:
        s = DoDetach(client, req->key, true);
        break;
      case Op::kAccumulate:
        s = DoAccumulate(client, *req);
        break;
      case Op::kStatus: {
        bool full = false;
        if (!req->admin_proof.empty()) {
          std::vector<uint8_t> challenge;
          {
            MutexLock l(&mu_);
            challenge = clients_.at(client).challenge;
          }
          Digest want = AdminProof(opt_.admin_secret, challenge);
          if (opt_.admin_secret.empty() ||
              !ConstantTimeEquals(want, req->admin_proof)) {
            s = PermissionDeniedError(
                opt_.admin_secret.empty()
                    ? "this server has no admin secret (--admin-secret-file)"
                    : "wrong admin secret");
            break;
          }
          full = true;
        }
        a.text = StatusTextFor(client, full);
        break;
      }
      case Op::kHeartbeat: {
        MutexLock l(&mu_);
        ClientState& c = clients_.at(client);
        c.bytes_read = req->bytes_read;
        c.bytes_written = req->bytes_written;
        break;
      }
    }
    if (!s.ok()) {
      rejected_.fetch_add(1);
      MEMBOX_LOG_DEBUG("client {} {}: {}", client, proto::OpName(req->op),
                       s.ToString());
      server_->Reply(r, s);
      if (req->op == Op::kRegister) server_->Close(client, s);
      return;
    }
    server_->Reply(r, Status::Ok(), proto::EncodeResponse(a));
  }

  Status DoRegister(uint64_t client, const Request& q, Response* a) {
    // The channel proved the secret in the transport's handshake.
    MutexLock l(&mu_);
    ClientState& c = clients_.at(client);
    c.registered = true;
    server_->Establish(client);
    c.name = q.name;
    c.pid = q.pid;
    c.challenge = RandomBytes(32);
    a->challenge = c.challenge;
    a->client_id = client;
    a->heartbeat_ms = static_cast<uint32_t>(opt_.heartbeat_timeout.count());
    MEMBOX_LOG_INFO("client {} registered: {} (pid {})", client, q.name, q.pid);
    return Status::Ok();
  }

  uint64_t QuotaBytes() const {
    return opt_.quota_bytes ? opt_.quota_bytes : opt_.pool_bytes / 2;
  }

  Status DoCreate(uint64_t client, const Request& q, Response* a) {
    if (q.size == 0) return InvalidArgumentError("segment size 0");
    if (q.size > opt_.pool_bytes) {
      return InvalidArgumentError("segment of " + std::to_string(q.size) +
                                  " bytes exceeds the pool (" +
                                  FormatByteSize(opt_.pool_bytes) + ")");
    }
    if (q.size > opt_.max_block) {
      return InvalidArgumentError("segment of " + std::to_string(q.size) +
                                  " bytes exceeds the largest block (" +
                                  FormatByteSize(opt_.max_block) + ")");
    }
    MutexLock l(&mu_);
    ClientState& c = clients_.at(client);
    if (c.principal.cluster) {
      // The cluster secret's holders: a quota per connection, as before
      // principals (operators and tests; jobs get credentials).
      if (c.created_bytes + q.size > QuotaBytes()) {
        return ResourceExhaustedError(
            "client quota of " + FormatByteSize(QuotaBytes()) + " exceeded");
      }
    } else {
      // One quota over every connection of the principal, and every byte
      // it still holds (orphans included).
      uint64_t quota = c.principal.QuotaOf(opt_.pool_bytes, QuotaBytes());
      uint64_t held = held_by_[c.principal.name];
      if (held + q.size > quota) {
        return ResourceExhaustedError("quota of principal " + c.principal.name +
                                      " (" + FormatByteSize(quota) +
                                      ") exceeded: it holds " +
                                      FormatByteSize(held) + " on this node");
      }
    }
    if (c.attached.size() >= opt_.quota_segments) {
      return ResourceExhaustedError("client segment quota exceeded");
    }
    // Keys are per principal: a key in use by another principal is free
    // here, so the answer tells nothing about anyone else's segments.
    SegmentName name{c.principal.name, q.key};
    if (name.key.empty()) {
      // 128 bits from the CSPRNG: no key predicts another (a seeded
      // generator let a client compute the next tenant's key from its own).
      do {
        name.key = SegmentKey::Random();
      } while (segments_.count(name));
    } else if (segments_.count(name)) {
      return AlreadyExistsError("segment key " + name.key.ToString() +
                                " is in use");
    }
    ASSIGN_OR_RETURN(uint64_t off, buddy_->Allocate(q.size));
    auto desc = pool_->ExportRange(off, q.size);
    if (!desc.ok()) {
      (void)buddy_->Free(off);
      return desc.status();
    }
    auto seg = std::make_shared<Segment>();
    seg->key = name.key;
    seg->offset = off;
    seg->size = q.size;
    seg->master = client;
    seg->master_name = c.name;
    seg->owner = c.principal;
    held_by_[c.principal.name] += q.size;
    seg->attached.insert(client);
    seg->desc = *desc;
    seg->desc_bytes = desc->Serialize();
    segments_[name] = seg;
    c.attached.insert(name);
    c.created_bytes += q.size;
    a->key = name.key;
    a->size = q.size;
    a->descriptor = seg->desc_bytes;
    return Status::Ok();
  }

  // Zeroes a new segment outside the table lock (so other requests go on),
  // then lets others attach it: nobody ever sees another tenant's old bytes.
  void ZeroAndPublish(uint64_t client, const SegmentKey& key) {
    std::shared_ptr<Segment> seg;
    {
      MutexLock l(&mu_);
      auto c = clients_.find(client);
      if (c == clients_.end()) return;
      auto it = segments_.find(SegmentName{c->second.principal.name, key});
      if (it == segments_.end()) return;
      seg = it->second;
    }
    std::memset(static_cast<char*>(pool_->data()) + seg->offset, 0, seg->size);
    MutexLock l(&mu_);
    seg->ready = true;
  }

  // The segment `key` names for `c`: one of its own principal's; for the
  // cluster principal, which may reach every segment, otherwise the one
  // segment of another principal with that key (none when several have it).
  Segments::iterator FindLocked(const ClientState& c, const SegmentKey& key)
      MEMBOX_REQUIRES(mu_) {
    auto own = segments_.find(SegmentName{c.principal.name, key});
    if (own != segments_.end() || !c.principal.cluster) return own;
    auto found = segments_.end();
    for (auto it = segments_.begin(); it != segments_.end(); ++it) {
      if (it->first.key != key) continue;
      if (found != segments_.end()) return segments_.end();  // ambiguous
      found = it;
    }
    return found;
  }

  Status DoAttach(uint64_t client, const Request& q, Response* a) {
    MutexLock l(&mu_);
    ClientState& c = clients_.at(client);
    auto it = FindLocked(c, q.key);
    // An unknown key, a wrong size and another principal's segment give one
    // answer: a caller learns nothing about a segment it cannot open (not
    // even that it exists, or its size).
    if (it == segments_.end() || it->second->deleted ||
        it->second->size != q.size) {
      return NotFoundError("no segment with key " + q.key.ToString() + " and " +
                           std::to_string(q.size) + " bytes");
    }
    const SegmentName name = it->first;
    Segment& seg = *it->second;
    if (!seg.ready) {
      return UnavailableError("segment " + q.key.ToString() +
                              " is being created; retry");
    }
    if (!c.attached.count(name) && c.attached.size() >= opt_.quota_segments) {
      return ResourceExhaustedError("client segment quota exceeded");
    }
    if (seg.orphaned && !c.name.empty() && c.name == seg.master_name &&
        c.principal.name == seg.owner.name) {
      // The master came back within the grace period: it owns it again.
      seg.orphaned = false;
      seg.master = client;
      c.created_bytes += seg.size;
      MEMBOX_LOG_INFO("segment {} adopted again by {} (client {})",
                      seg.key.ToString(), c.name, client);
    }
    seg.attached.insert(client);
    c.attached.insert(name);
    a->key = seg.key;
    a->size = seg.size;
    a->descriptor = seg.desc_bytes;
    return Status::Ok();
  }

  // Detaches `client` from `key`; with `destroy`, the master also deletes the
  // segment, whose memory returns to the pool once the last user detached.
  Status DoDetach(uint64_t client, const SegmentKey& key, bool destroy) {
    MutexLock l(&mu_);
    auto cit = clients_.find(client);
    if (cit == clients_.end()) return NotFoundError("client released");
    // A segment this client attached (the cluster principal's may be
    // another principal's), else the one its key names (a master may delete
    // after detaching).
    auto it = FindAttachedLocked(cit->second, key);
    if (it == segments_.end()) it = FindLocked(cit->second, key);
    if (it == segments_.end()) {
      return NotFoundError("segment " + key.ToString() +
                           " is not attached by this client");
    }
    return DetachLocked(client, it->first, destroy);
  }

  // The segment with `key` among those `c` attached (its own principal's
  // first).
  Segments::iterator FindAttachedLocked(const ClientState& c,
                                        const SegmentKey& key)
      MEMBOX_REQUIRES(mu_) {
    SegmentName own{c.principal.name, key};
    if (c.attached.count(own)) return segments_.find(own);
    for (const SegmentName& n : c.attached) {
      if (n.key == key) return segments_.find(n);
    }
    return segments_.end();
  }

  Status DetachLocked(uint64_t client, const SegmentName& key, bool destroy)
      MEMBOX_REQUIRES(mu_) {
    auto it = segments_.find(key);
    auto cit = clients_.find(client);
    // The master may delete its segment even after dropping its own
    // attachment (attach + detach of one's own segment, then free).
    const bool master_delete = destroy && it != segments_.end() &&
                               it->second->master == client &&
                               !it->second->deleted;
    if (it == segments_.end() || cit == clients_.end() ||
        (!cit->second.attached.count(key) && !master_delete)) {
      return NotFoundError("segment " + key.key.ToString() +
                           " is not attached by this client");
    }
    std::shared_ptr<Segment> seg = it->second;
    if (destroy && seg->master != client) {
      return PermissionDeniedError("only the master may delete segment " +
                                   key.key.ToString());
    }
    if (destroy) seg->deleted = true;
    seg->attached.erase(client);
    cit->second.attached.erase(key);
    if (seg->master == client && destroy)
      cit->second.created_bytes -= seg->size;
    MaybeFreeLocked(seg);
    return Status::Ok();
  }

  void MaybeFreeLocked(const std::shared_ptr<Segment>& seg)
      MEMBOX_REQUIRES(mu_) {
    if (!seg->deleted || !seg->attached.empty() || seg->busy > 0) return;
    pool_->RevokeRange(seg->desc.region_id);
    auto held = held_by_.find(seg->owner.name);
    if (held != held_by_.end()) {
      held->second -= std::min(held->second, seg->size);
      if (held->second == 0) held_by_.erase(held);
    }
    Status s = buddy_->Free(seg->offset);
    if (!s.ok())
      MEMBOX_LOG_ERROR("freeing segment {}: {}", seg->key.ToString(),
                       s.ToString());
    segments_.erase(SegmentName{seg->owner.name, seg->key});
  }

  Status DoAccumulate(uint64_t client, const Request& q) {
    auto dtype = static_cast<DType>(q.dtype);
    if (!AccumulateSupports(dtype)) {
      return InvalidArgumentError("accumulate: unsupported dtype " +
                                  std::to_string(q.dtype));
    }
    const uint64_t esize = DTypeSize(dtype);
    std::shared_ptr<Segment> dst, src;
    uint64_t length = q.length;
    {
      MutexLock l(&mu_);
      const ClientState& c = clients_.at(client);
      auto d = FindAttachedLocked(c, q.key);
      auto s = FindAttachedLocked(c, q.src_key);
      if (d == segments_.end() || s == segments_.end() || d->second->deleted ||
          s->second->deleted) {
        return NotFoundError(
            "accumulate: both segments must exist and be attached");
      }
      dst = d->second;
      src = s->second;
      if (length == 0) {
        if (dst->size != src->size) {
          return InvalidArgumentError("accumulate: segments differ in size (" +
                                      std::to_string(dst->size) + " vs " +
                                      std::to_string(src->size) + ")");
        }
        if (q.offset > dst->size)
          return OutOfRangeError("accumulate: offset past the end");
        length = dst->size - q.offset;
      }
      if (q.offset > dst->size || length > dst->size - q.offset ||
          q.offset > src->size || length > src->size - q.offset) {
        return OutOfRangeError("accumulate: range outside a segment");
      }
      if (q.offset % esize != 0 || length % esize != 0) {
        return InvalidArgumentError(
            "accumulate: offset and length must be multiples of " +
            std::to_string(esize) + " bytes");
      }
      ++dst->busy;
      ++src->busy;
    }
    {
      MutexLock lock(&dst->accumulate_mu);
      char* base = static_cast<char*>(pool_->data());
      sync_->Run(dtype, base + dst->offset + q.offset,
                 base + src->offset + q.offset, length / esize, q.scale);
    }
    bytes_accumulated_.fetch_add(length);
    accumulates_.fetch_add(1);
    MutexLock l(&mu_);
    --dst->busy;
    --src->busy;
    MaybeFreeLocked(dst);
    if (src != dst) MaybeFreeLocked(src);
    return Status::Ok();
  }

  void ReleaseClient(uint64_t client, const Status& why) {
    {
      MutexLock l(&mu_);
      auto it = clients_.find(client);
      if (it == clients_.end()) return;
      std::vector<SegmentName> keys(it->second.attached.begin(),
                                    it->second.attached.end());
      for (const SegmentName& key : keys) {
        auto s = segments_.find(key);
        bool destroy = opt_.release_master_segments && s != segments_.end() &&
                       s->second->master == client;
        (void)DetachLocked(client, key, destroy);
      }
      // Segments it created and did not delete become orphans (they may be
      // attached by nobody now, including segments it had detached from).
      std::vector<std::shared_ptr<Segment>> mine;
      for (auto& [key, seg] : segments_) {
        if (seg->master == client && !seg->deleted) mine.push_back(seg);
      }
      for (auto& seg : mine) {
        if (opt_.release_master_segments) {
          seg->deleted = true;
          MaybeFreeLocked(seg);
          continue;
        }
        seg->master = 0;
        seg->orphaned = true;
        seg->orphaned_since = Clock::now();
      }
      MEMBOX_LOG_INFO("client {} ({}) released: {} ({} attachments)", client,
                      it->second.name.empty() ? "-" : it->second.name,
                      why.ToString(), keys.size());
      departed_read_ += it->second.bytes_read;
      departed_written_ += it->second.bytes_written;
      clients_.erase(it);
      released_.fetch_add(1);
    }
  }

  ServerOptions opt_;
  std::unique_ptr<service::Server> server_;
  std::string endpoint_;
  std::atomic<bool> stopped_{false};
  std::unique_ptr<transport::MemRegion> pool_;
  std::unique_ptr<SyncCores> sync_;

  mutable Mutex mu_;
  std::unique_ptr<BuddyAllocator> buddy_ MEMBOX_GUARDED_BY(mu_);
  Segments segments_ MEMBOX_GUARDED_BY(mu_);
  std::map<uint64_t, ClientState> clients_ MEMBOX_GUARDED_BY(mu_);
  // The node's other services (SetServices): name, endpoint.
  std::vector<std::pair<std::string, std::string>> services_
      MEMBOX_GUARDED_BY(mu_);
  bool services_set_ MEMBOX_GUARDED_BY(mu_) = false;
  // Bytes of segments each principal created and the node still holds.
  std::map<std::string, uint64_t> held_by_ MEMBOX_GUARDED_BY(mu_);
  uint64_t departed_read_ MEMBOX_GUARDED_BY(mu_) = 0;
  uint64_t departed_written_ MEMBOX_GUARDED_BY(mu_) = 0;

  std::atomic<uint64_t> bytes_accumulated_{0}, accumulates_{0}, requests_{0},
      rejected_{0}, released_{0};
};

}  // namespace

Result<std::unique_ptr<Server>> Server::Start(const ServerOptions& options) {
  return MakeInitialized<Server, ServerImpl>(options);
}

}  // namespace membox::memserver
