#include "membox/ps/proxy.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <future>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <thread>
#include <tuple>

#include <fmt/format.h>

#include "membox/base/accumulate.h"
#include "membox/base/copy.h"
#include "membox/base/logging.h"
#include "membox/ps/routing.h"
#include "membox/service/client.h"
#include "membox/service/server.h"
#include "membox/transport/device.h"

#include "src/ps/checkpoint.h"
#include "src/ps/protocol.h"
#include "src/ps/reduce.h"
#include "src/ps/ring.h"
#include "src/ps/scheduler.h"
#include "src/ps/state_copy.h"
#include "src/ps/storage.h"

namespace membox::ps {
namespace {

using proto::Message;
using proto::Type;
using transport::Channel;
using transport::MemRegion;
using transport::RegionDescriptor;
using transport::RemoteMemRegion;
using Clock = std::chrono::steady_clock;

constexpr auto kPeerTimeout = std::chrono::seconds(30);
constexpr auto kIoTimeout = std::chrono::seconds(30);

// One pushed contribution waiting for its round.
struct Contribution {
  uint64_t conn = 0;
  uint64_t id = 0;
  uint32_t rank = 0;
  uint64_t region = 0, offset = 0;
  bool has_output = false;
  uint64_t out_region = 0, out_offset = 0;
  // Prefetched (pushes the proxy cannot map): read into the shard's inbox
  // for this rank as soon as admitted; `fetching` until the read is back.
  bool prefetched = false;
  bool fetching = false;
  Status fetched;
};

struct PendingPull {
  uint64_t conn = 0;
  uint64_t id = 0;
  uint64_t min_version = 0;
  uint64_t out_region = 0, out_offset = 0;
  Clock::time_point since{};
};

// A shard of a key: what storage keeps (StoredShard), the round in
// progress and its ring.
struct Shard : StoredShard {
  // Synchronous round `version`: contributions by rank.
  std::map<uint32_t, Contribution> pushes;
  bool reducing = false;  // local sum done, ring running
  RingProgress ring;
  std::vector<PendingPull> pulls;
  std::vector<uint64_t> applied;  // kAsync: pushes applied per rank
  // Per-rank buffers prefetched pushes are read into (allocated on first
  // use, reused every round: a round's next pushes are admitted only after
  // its sum is done).
  std::map<uint32_t, std::shared_ptr<MemRegion>> inbox;
  // When the round in progress saw its first push (for explanations of a
  // wait); zero when none is waiting. When it was last logged as waiting.
  Clock::time_point first_push{}, reported{};
  // Stored keys: kStores issued and the newest one applied (a store read
  // from a worker over the network completes later; an older one landing
  // after a newer one is dropped).
  uint64_t stores_issued = 0, stores_applied = 0;
};

struct Key {
  uint64_t bytes = 0;
  DType dtype = DType::kFloat32;
  uint64_t shard_bytes = 0;
  bool initialized = false;
  // Declared with initial values by a worker other than rank 0, whose
  // declaration has not arrived: rank 0's values win (as DDP's broadcast),
  // so pulls and pushes of the key wait for it.
  bool awaiting_init = false;
  OptimizerSettings opt;
  // The round the hyperparameters were last changed for, and by whom: two
  // workers asking for different values for one round is an error.
  uint64_t tuned_round = UINT64_MAX;
  std::set<uint32_t> tuned_by;
  // Striped: shard s is summed and stored by proxy (key + s) % proxies
  // alone (every worker sends it there; no ring). Fixed by the first
  // worker's Declare; a key restored from a checkpoint takes it from there.
  bool striped = false;
  bool declared = false;  // by a worker of the current job
  bool restored = false;  // from a checkpoint (never replaced: see Declare)
  // Written by workers' kStore (state kept for them, e.g. a DDP job's
  // weights): no pushes, no rounds, no optimizer. Fixed by the first
  // worker's Declare.
  bool stored = false;
  std::vector<Shard> shards;
};

// A worker's routing table and, per key, the first round it applies to
// (keys absent were declared later: from round 0).
struct RouteEntry {
  uint64_t threshold = 0;
  uint32_t lat = 0, bw = 0;
  std::map<uint64_t, uint64_t> from;
};

struct Conn {
  std::shared_ptr<Channel> channel;
  std::vector<RouteEntry> routes;
  // kObserver: `membox status` (a hello with world 0), kStats only.
  enum class Role { kUnknown, kClient, kPeer, kObserver } role = Role::kUnknown;
  uint32_t rank = 0;
  std::string name;
  std::map<uint64_t, std::shared_ptr<RemoteMemRegion>> regions;
  // A worker rejoining after a failover, its state not fully replayed
  // (kRejoin .. kRejoined): no round that depends on it starts.
  bool replaying = false;
};

// Runs on a service::Server with one serial event loop: workers' and peer
// proxies' messages, transfer completions (posted tasks) and checkpoints are
// applied on that loop, so the storage and ring state need no locks
// (docs/design/ps.md). Peer proxies are reached through service::Clients of
// the same device.
class ProxyImpl final : public Proxy, public service::Service {
 public:
  explicit ProxyImpl(ProxyOptions o)
      : opt_(std::move(o)), sched_(opt_.scheduler) {}
  ~ProxyImpl() override { Stop(); }

  Status Init() {
    if (opt_.secret.size() < 8) {
      return InvalidArgumentError("the proxy secret must be at least 8 bytes");
    }
    nproxies_ = opt_.peers.empty() ? 1 : opt_.peers.size();
    if (nproxies_ > proto::kMaxProxies) {
      return InvalidArgumentError("too many proxies");
    }
    if (opt_.rank >= nproxies_) {
      return InvalidArgumentError("proxy rank " + std::to_string(opt_.rank) +
                                  " outside the peer list");
    }
    if (opt_.join && opt_.restore) {
      return InvalidArgumentError(
          "--join copies the state from the peers; --restore loads a "
          "checkpoint: choose one");
    }
    sync_ = std::make_unique<SyncCores>(opt_.sync_cores);
    storage_ = std::make_unique<ShardStorage>(
        [this](uint64_t n) { return device_->AllocateMemRegion(n); },
        opt_.max_bytes, sync_.get());
    service::ServerOptions so;
    so.device.listen_address = opt_.listen;
    so.device.transports = opt_.transports;
    so.device.secret = opt_.secret;
    so.device.name = "membox-proxy-" + std::to_string(opt_.rank);
    so.service = "proxy " + std::to_string(opt_.rank);
    so.handler_threads = 0;  // one state machine per node
    // The next message is usually microseconds away (the other half of a
    // ring step, the next shard).
    so.poll_before_block = std::chrono::microseconds(300);
    running_ = true;
    auto server = service::Server::Create(so, this);
    if (!server.ok()) {
      running_ = false;
      return server.status();
    }
    server_ = std::move(*server);
    // Before serving: connections wait in the listener meanwhile, and
    // link failures the copy meets are posted to the loop that starts next.
    Status loaded = Status::Ok();
    if (opt_.restore) loaded = Restore();
    if (loaded.ok() && opt_.join) loaded = Join();
    if (loaded.ok()) loaded = server_->Serve();
    if (!loaded.ok()) {
      Stop();
      return loaded;
    }
    endpoint_ = server_->endpoint();
    server_->Every(
        opt_.hang_report.count() > 0
            ? std::clamp(opt_.hang_report / 4, std::chrono::milliseconds(10),
                         std::chrono::milliseconds(1000))
            : std::chrono::milliseconds(1000),
        [this] { ReportWaits(); });
    MEMBOX_LOG_INFO("parameter proxy {}/{} listening on {} ({} scheduler)",
                    opt_.rank, nproxies_, endpoint_,
                    opt_.scheduler == Scheduler::kPerClientQueues
                        ? "per-client queues"
                        : "first-come-first-serve");
    return Status::Ok();
  }

  std::string endpoint() const override { return endpoint_; }

  ProxyStats Stats() const override {
    ProxyStats s;
    s.keys = n_keys_.load();
    s.shards = n_shards_.load();
    s.stored_bytes = storage_ ? storage_->stored_bytes() : 0;
    s.clients = n_clients_.load();
    s.rounds_completed = rounds_.load();
    s.bytes_reduced = bytes_reduced_.load();
    s.ring_steps = ring_steps_.load();
    s.queued_pushes = sched_.queued();
    s.rejected = rejected_.load();
    s.checkpoints = checkpoints_.load();
    return s;
  }

  std::string StatusText() const override {
    ProxyStats s = Stats();
    std::ostringstream o;
    o << "proxy " << opt_.rank << " of " << nproxies_ << " at " << endpoint()
      << "\nkeys " << s.keys << "\nshards " << s.shards << "\nstored_bytes "
      << s.stored_bytes << "\nclients " << s.clients << "\nrounds_completed "
      << s.rounds_completed << "\nbytes_reduced " << s.bytes_reduced
      << "\nring_steps " << s.ring_steps << "\nqueued_pushes "
      << s.queued_pushes << "\nrejected " << s.rejected << "\ncheckpoints "
      << s.checkpoints << "\nreplicate " << (opt_.replicate ? "on" : "off")
      << "\nfailovers " << failovers_.load() << "\n";
    MutexLock l(&waits_mu_);
    o << waits_;
    return o.str();
  }

  void Metrics(MetricsWriter& w) const override {
    const ProxyStats s = Stats();
    w.Counter("membox_ps_rounds_total",
              "Shard rounds completed (rate: rounds/s).", s.rounds_completed);
    w.Counter("membox_ps_pushed_bytes_total", "Bytes of pushes summed.",
              s.bytes_reduced);
    w.Counter("membox_ps_result_bytes_total",
              "Bytes of results and pulls written to workers.",
              result_bytes_.load(std::memory_order_relaxed));
    w.Counter("membox_ps_stored_bytes_total",
              "Bytes workers wrote into stored keys (Store).",
              stored_bytes_in_.load(std::memory_order_relaxed));
    w.Counter("membox_ps_ring_steps_total", "Ring steps with peer proxies.",
              s.ring_steps);
    w.Counter("membox_ps_rejected_total", "Requests refused.", s.rejected);
    w.Counter("membox_ps_checkpoints_total", "Checkpoints written.",
              s.checkpoints);
    w.Counter("membox_ps_failovers_total",
              "Dead peers replaced while workers were connected (rounds "
              "resumed).",
              failovers_.load(std::memory_order_relaxed));
    w.Gauge("membox_ps_peers_down", "Peer proxies down, awaited.",
            peers_down_count_.load(std::memory_order_relaxed));
    w.Gauge("membox_ps_keys", "Keys stored.", s.keys);
    w.Gauge("membox_ps_shards", "Shards stored.", s.shards);
    w.Gauge("membox_ps_stored_bytes", "Bytes of values and optimizer state.",
            s.stored_bytes);
    w.Gauge("membox_ps_workers", "Workers connected.", s.clients);
    w.Gauge("membox_ps_queued_pushes", "Pushes waiting for admission.",
            s.queued_pushes);
    w.Gauge(
        "membox_ps_waiting_rounds",
        "Rounds waiting longer than --hang-report-s (see the log or status).",
        waiting_rounds_.load(std::memory_order_relaxed));
    if (server_) service::WriteServerMetrics(*server_, "proxy", w);
  }

  Status Checkpoint(const std::string& name) override {
    std::promise<Status> p;
    auto f = p.get_future();
    if (!server_->Post([this, name, &p] {
          StartCheckpoint(name, [&p](Status s) { p.set_value(s); });
        })) {
      return UnavailableError("the proxy is stopping");
    }
    return f.get();
  }

  void Stop() override {
    if (!server_ || !running_.exchange(false)) return;
    // Ends the event loop (posted tasks still run) and closes every
    // connection; the device stays until server_ goes, after the memory
    // registered with it.
    server_->Stop();
    {
      MutexLock l(&writers_mu_);
      for (auto& t : writers_) t.join();
      writers_.clear();
    }
    peer_regions_.clear();
    join_snapshots_.clear();
    catch_ups_.clear();
    peer_out_.clear();  // closes the links to peers
    inflight_.clear();  // closed channels complete them
    conns_.clear();
    keys_.clear();
    staging_.reset();
    probe_.reset();
    sync_.reset();
    server_.reset();
    MEMBOX_LOG_INFO("parameter proxy stopped");
  }

 private:
  // ------------------------------------------------------------ plumbing

  // ------------------------------------------------------------ service

  Status OnStart(transport::Device& device) override {
    device_ = &device;
    return Status::Ok();
  }

  void OnConnect(service::ConnectionId conn, const std::string&) override {
    conns_[conn].channel = server_->channel(conn);
  }

  void Post(std::function<void()> task) { server_->Post(std::move(task)); }

  // Answers request (method, id) of `conn`; an ok reply carries the
  // version (and the status text of kStats).
  void Reply(uint64_t conn, Type method, uint64_t id, const Status& s,
             uint64_t version = 0, std::string text = {}) {
    if (!s.ok()) {
      rejected_.fetch_add(1);
      return server_->Reply(conn, static_cast<uint16_t>(method), id, s);
    }
    Message m;
    m.type = Type::kReply;
    m.version = version;
    m.text = std::move(text);
    server_->Reply(conn, static_cast<uint16_t>(method), id, Status::Ok(),
                   proto::Encode(m));
  }

  // A registered staging buffer of at least `bytes` (event thread only).
  Result<MemRegion*> Staging(uint64_t bytes) {
    if (!staging_ || staging_->size() < bytes) {
      staging_.reset();
      ASSIGN_OR_RETURN(staging_, device_->AllocateMemRegion(
                                     std::max<uint64_t>(bytes, 1 << 20)));
    }
    return staging_.get();
  }

  // The worker's registered region `region` if [offset, offset + len) lies
  // inside it; `what` ("input" / "output") names the side in errors.
  static Result<const RemoteMemRegion*> WorkerRange(const Conn& c,
                                                    uint64_t region,
                                                    uint64_t offset,
                                                    uint64_t len,
                                                    const char* what) {
    auto it = c.regions.find(region);
    if (it == c.regions.end()) {
      return NotFoundError(std::string(what) + " region " +
                           std::to_string(region) +
                           " was not registered with this proxy");
    }
    const RemoteMemRegion* rr = it->second.get();
    if (offset > rr->size() || len > rr->size() - offset) {
      return OutOfRangeError(std::string(what) +
                             " range outside the registered region");
    }
    return rr;
  }

  // Resolves a worker's (region, offset, length) to something readable:
  // a mapped pointer, or the bytes read into `into` (registered).
  Result<const uint8_t*> ReadWorker(Conn& c, uint64_t region, uint64_t offset,
                                    uint64_t len, uint8_t* into,
                                    const MemRegion& into_region) {
    ASSIGN_OR_RETURN(const RemoteMemRegion* rr,
                     WorkerRange(c, region, offset, len, "input"));
    if (rr->mapped()) return static_cast<const uint8_t*>(rr->mapped()) + offset;
    ASSIGN_OR_RETURN(auto h, c.channel->Read(into, into_region,
                                             rr->address() + offset, *rr, len));
    RETURN_IF_ERROR(h.Wait(kIoTimeout));
    return into;
  }

  Status WriteWorker(Conn& c, uint64_t region, uint64_t offset,
                     const uint8_t* src, uint64_t len,
                     const MemRegion& src_region) {
    ASSIGN_OR_RETURN(const RemoteMemRegion* rr,
                     WorkerRange(c, region, offset, len, "output"));
    if (rr->mapped()) {
      uint8_t* dst = static_cast<uint8_t*>(rr->mapped()) + offset;
      sync_->ParallelFor(len, 1 << 20, [&](size_t b, size_t e) {
        CopyPiece(dst + b, src + b, e - b, len);
      });
      std::atomic_thread_fence(std::memory_order_release);
      return Status::Ok();
    }
    ASSIGN_OR_RETURN(
        auto h,
        c.channel->Write(src, src_region, rr->address() + offset, *rr, len));
    RETURN_IF_ERROR(h.Wait(kIoTimeout));
    ASSIGN_OR_RETURN(auto f, c.channel->Flush());
    return f.Wait(kIoTimeout);
  }

  // Writes a round's result to a worker and replies once it is visible
  // there, without waiting on the event thread: the write and a flush are
  // issued, and the flush's completion posts the reply. The node's link then
  // carries this shard's results out while the next shard's pushes come in
  // (waiting here made every node use its link one direction at a time).
  // `src` is held until the write completes, so the value it points into is
  // copied on write meanwhile (Apply / LocalSum check use_count()).
  void WriteThenReply(uint64_t conn, Type method, uint64_t id, uint64_t region,
                      uint64_t offset, std::shared_ptr<MemRegion> src,
                      uint64_t len, uint64_t version) {
    Conn& c = conns_[conn];
    auto rr = WorkerRange(c, region, offset, len, "output");
    if (!rr.ok()) return Reply(conn, method, id, rr.status(), version);
    result_bytes_.fetch_add(len, std::memory_order_relaxed);
    if ((*rr)->mapped() || !c.channel) {
      Status s =
          WriteWorker(c, region, offset,
                      static_cast<const uint8_t*>(src->data()), len, *src);
      return Reply(conn, method, id, s, version);
    }
    auto w = c.channel->Write(src->data(), *src, (*rr)->address() + offset,
                              **rr, len, [src](const Status&) {});
    if (!w.ok()) return Reply(conn, method, id, w.status(), version);
    Track(std::move(*w));
    auto f =
        c.channel->Flush([this, conn, method, id, version](const Status& s) {
          Post([this, conn, method, id, s, version] {
            Reply(conn, method, id, s, version);
          });
        });
    if (!f.ok()) return Reply(conn, method, id, f.status(), version);
    Track(std::move(*f));
  }

  // Keeps a transfer's handle until it completes (a pending handle's
  // destructor would wait for it); completed ones are dropped here.
  void Track(transport::OpHandle h) {
    while (!inflight_.empty() && inflight_.front().done()) {
      inflight_.pop_front();
    }
    inflight_.push_back(std::move(h));
  }

  // ------------------------------------------------------------ hangs

  // What shard s of key k waits for, or empty when it waits for nothing.
  std::string ExplainShard(uint64_t k, uint32_t s) const {
    const Key& key = keys_.at(k);
    const Shard& sh = key.shards[s];
    std::string what;
    if (key.awaiting_init) {
      what = "rank 0 has not declared it (its initial value wins)";
    } else if (sh.reducing) {
      what = sh.ring.Waiting(RingFor(k, s));
    } else {
      std::string pushed, missing, reading, rejoining;
      std::set<uint32_t> connected;
      for (const auto& [id, c] : conns_) {
        if (c.role != Conn::Role::kClient) continue;
        connected.insert(c.rank);
        if (c.replaying) rejoining += " " + std::to_string(c.rank);
        auto p = sh.pushes.find(c.rank);
        if (p != sh.pushes.end()) {
          (p->second.fetching ? reading : pushed) +=
              " " + std::to_string(c.rank);
          continue;
        }
        if (key.striped || c.routes.empty() ||
            RoutedHere(c, k, sh.bytes, sh.version)) {
          missing += " " + std::to_string(c.rank) + " (" + c.name + ")";
        }
      }
      std::string absent;
      for (uint32_t r = 0; r < world_; ++r) {
        if (!connected.count(r)) absent += " " + std::to_string(r);
      }
      what = "pushed by ranks" + (pushed.empty() ? " none" : pushed);
      if (!missing.empty()) what += "; waiting for ranks" + missing;
      if (!reading.empty()) what += "; reading the pushes of ranks" + reading;
      if (!absent.empty()) what += "; ranks not connected:" + absent;
      if (!rejoining.empty()) {
        what += "; ranks replaying their state (rejoining):" + rejoining;
      }
      if (missing.empty() && reading.empty() && absent.empty() &&
          !sched_.MayStart({k, s, sh.version})) {
        what += "; behind an older tensor (first-come-first-serve)";
      }
    }
    return "key " + std::to_string(k) + " shard " + std::to_string(s) +
           " round " + std::to_string(sh.version) + ": " + what;
  }

  // Logs every round (and pull) waiting longer than hang_report, once per
  // period each, and keeps the explanation -- with a summary of the job:
  // workers, versions -- for StatusText().
  void ReportWaits() {
    CheckFailoverDeadline();
    const auto now = Clock::now();
    const auto limit = opt_.hang_report;
    std::string text;
    for (uint32_t r : peers_down_) {
      text += fmt::format(
          "down proxy {} at {} for {:.1f} s: rounds wait for its "
          "replacement\n",
          r, opt_.peers[r],
          std::chrono::duration<double>(now - down_since_).count());
    }
    {
      std::string workers;
      for (const auto& [id, c] : conns_) {
        if (c.role != Conn::Role::kClient) continue;
        workers += " " + std::to_string(c.rank) + " (" + c.name + ")";
      }
      uint64_t lo = UINT64_MAX, hi = 0;
      for (const auto& [k, key] : keys_) {
        for (const auto& sh : key.shards) {
          lo = std::min(lo, sh.version);
          hi = std::max(hi, sh.version);
        }
      }
      text += "world " + std::to_string(world_) + "\nworkers" +
              (workers.empty() ? " none" : workers) + "\n";
      if (hi >= lo) {
        text +=
            "versions " + std::to_string(lo) + ".." + std::to_string(hi) + "\n";
      }
    }
    size_t n = 0;
    auto secs = [&](Clock::time_point t) {
      return fmt::format("{:.1f}",
                         std::chrono::duration<double>(now - t).count());
    };
    for (auto& [k, key] : keys_) {
      for (uint32_t s = 0; s < key.shards.size(); ++s) {
        Shard& sh = key.shards[s];
        Clock::time_point since = sh.first_push;
        for (const auto& p : sh.pulls) {
          if (since == Clock::time_point{} || p.since < since) since = p.since;
        }
        if (limit.count() == 0 || since == Clock::time_point{} ||
            now - since < limit) {
          continue;
        }
        std::string line = ExplainShard(k, s);
        if (sh.pushes.empty() && !sh.pulls.empty()) {
          line += "; " + std::to_string(sh.pulls.size()) +
                  " pull(s) waiting for version " +
                  std::to_string(sh.pulls.front().min_version);
        }
        line = "waiting " + secs(since) + " s: " + line;
        if (++n <= 32) text += "wait " + line + "\n";
        if (now - sh.reported >= limit) {
          sh.reported = now;
          MEMBOX_LOG_WARN("proxy {}: {}", opt_.rank, line);
        }
      }
    }
    if (n > 32) text += "wait ... and " + std::to_string(n - 32) + " more\n";
    waiting_rounds_.store(n, std::memory_order_relaxed);
    MutexLock l(&waits_mu_);
    waits_ = std::move(text);
  }

  // ------------------------------------------------------------ messages

  void OnRequest(const service::Request& r) override {
    const uint64_t conn = r.conn;
    auto cit = conns_.find(conn);
    if (cit == conns_.end()) return;
    Conn& c = cit->second;
    auto m = proto::Decode(r.method, r.body);
    if (!m.ok()) {
      MEMBOX_LOG_WARN("connection {}: {}", conn, m.status().ToString());
      rejected_.fetch_add(1);
      return server_->Reply(r, m.status());
    }
    m->id = r.id;
    // Ring notices arrive as notices; everything else is a request.
    const bool ring = m->type == Type::kReady || m->type == Type::kDone ||
                      m->type == Type::kResume || m->type == Type::kCatchUp ||
                      m->type == Type::kCatchUpDone;
    if (r.notice != ring) {
      rejected_.fetch_add(1);
      MEMBOX_LOG_WARN("connection {}: {} sent as a {}", conn,
                      proto::TypeName(m->type),
                      r.notice ? "notice" : "request");
      return server_->Reply(
          r, InvalidArgumentError(std::string(proto::TypeName(m->type)) +
                                  " must be sent as a notice"));
    }
    if (c.role == Conn::Role::kUnknown && m->type != Type::kHello &&
        m->type != Type::kPeerHello && m->type != Type::kRejoin) {
      Reply(conn, m->type, m->id, UnauthenticatedError("say hello first"));
      return;
    }
    switch (m->type) {
      case Type::kHello:
      case Type::kPeerHello:
      case Type::kRejoin:
        return OnHello(conn, c, *m);
      case Type::kRejoined:
        if (c.role != Conn::Role::kClient) break;
        c.replaying = false;
        Reply(conn, m->type, m->id, Status::Ok());
        Schedule();
        return MaybeStartAll();
      case Type::kReady:
      case Type::kDone:
        if (c.role != Conn::Role::kPeer) break;
        // Notices of a peer's aborted rounds (sent before its kResume, or
        // by an incarnation that is gone) are dropped.
        if (!PeerCurrent(c.rank, conn)) return;
        return OnPeerNotice(*m);
      case Type::kResume:
        if (c.role != Conn::Role::kPeer) break;
        return OnResume(c.rank, *m);
      case Type::kCatchUp:
        if (c.role != Conn::Role::kPeer) break;
        if (!PeerCurrent(c.rank, conn)) return;
        return OnCatchUp(c.rank, *m);
      case Type::kCatchUpDone:
        if (c.role != Conn::Role::kPeer) break;
        catch_ups_.erase({c.rank, m->key, m->shard});
        return;
      case Type::kJoin:
      case Type::kJoinDone:
        if (c.role != Conn::Role::kPeer) break;
        return OnJoinRequest(conn, c, *m);
      case Type::kStats:
        if (c.role != Conn::Role::kClient && c.role != Conn::Role::kObserver)
          break;
        ReportWaits();  // fresh lines
        return Reply(conn, m->type, m->id, Status::Ok(), 0, StatusText());
      default:
        if (c.role != Conn::Role::kClient) break;
        return OnClientMessage(conn, c, std::move(*m));
    }
    Reply(conn, m->type, m->id,
          PermissionDeniedError(std::string(proto::TypeName(m->type)) +
                                " not allowed on this connection"));
  }

  void OnHello(uint64_t conn, Conn& c, const Message& m) {
    // The channel proved the secret in the transport's handshake.
    if (c.role != Conn::Role::kUnknown) {
      Reply(conn, m.type, m.id, FailedPreconditionError("already said hello"));
      return;
    }
    if (m.type == Type::kPeerHello) {
      if (m.rank >= nproxies_ || m.rank == opt_.rank) {
        Reply(conn, m.type, m.id, InvalidArgumentError("bad peer proxy rank"));
        return;
      }
      c.role = Conn::Role::kPeer;
      c.rank = m.rank;
      server_->Establish(conn);
      Reply(conn, m.type, m.id, Status::Ok());
      return PeerHello(m.rank, conn, m.world, m.endpoint);
    }
    if (m.world == 0) {  // an observer: not part of the job
      c.role = Conn::Role::kObserver;
      c.name = m.name;
      server_->Establish(conn);
      Reply(conn, m.type, m.id, Status::Ok());
      return;
    }
    if (world_ != 0 && m.world != world_) {
      Reply(conn, m.type, m.id,
            InvalidArgumentError("world size " + std::to_string(m.world) +
                                 " differs from the job's " +
                                 std::to_string(world_)));
      return;
    }
    for (auto& [id, o] : conns_) {
      if (o.role == Conn::Role::kClient && o.rank == m.rank) {
        Reply(conn, m.type, m.id,
              AlreadyExistsError("worker rank " + std::to_string(m.rank) +
                                 " is already connected"));
        return;
      }
    }
    if (!dead_worker_.empty()) {
      Reply(conn, m.type, m.id, AbortedError(dead_worker_));
      return;
    }
    world_ = m.world;
    server_->Establish(conn);
    c.role = Conn::Role::kClient;
    c.rank = m.rank;
    c.replaying = m.type == Type::kRejoin;
    c.name = m.name;
    n_clients_.fetch_add(1);
    MEMBOX_LOG_DEBUG("worker {} ({}) joined, world {}", m.rank, m.name,
                     m.world);
    // A replicating proxy says so: the worker then waits for a dead
    // proxy's replacement instead of failing (ParamClientOptions::failover).
    Reply(conn, m.type, m.id, Status::Ok(), 0,
          opt_.replicate ? "replicate" : "");
    MaybeStartAll();
  }

  void OnDisconnect(service::ConnectionId conn, const Status& why) override {
    join_snapshots_.erase(conn);
    auto it = conns_.find(conn);
    if (it == conns_.end()) return;
    if (it->second.role == Conn::Role::kClient) {
      n_clients_.fetch_sub(1);
      std::string who = "worker rank " + std::to_string(it->second.rank) +
                        " (" + it->second.name +
                        ") disconnected: " + why.ToString();
      MEMBOX_LOG_INFO("{}", who);
      sched_.Remove(conn);
      conns_.erase(it);
      if (mode_ != proto::Mode::kAsync) FailPendingRounds(who);
    } else {
      bool peer = it->second.role == Conn::Role::kPeer;
      uint32_t rank = it->second.rank;
      conns_.erase(it);
      // A replaced incarnation's link closing late is old news.
      auto pc = peer_conn_.find(rank);
      if (peer && pc != peer_conn_.end() && pc->second == conn) {
        PeerDown(rank, why);
      }
    }
    bool any_client = false;
    for (auto& [id, c] : conns_) any_client |= c.role == Conn::Role::kClient;
    if (!any_client) {
      // Everybody left: a new job may start (versions are kept); proxies
      // that went down may come back.
      dead_worker_.clear();
      for (auto p = peer_out_.begin(); p != peer_out_.end();) {
        if (p->second->health().ok()) {
          ++p;
          continue;
        }
        std::erase_if(peer_regions_,
                      [&](const auto& e) { return e.first.first == p->first; });
        p = peer_out_.erase(p);
      }
      world_ = 0;
      // The next job configures its own mode (a job that left the nodes
      // averaging must not make the next one's sums averages).
      configured_ = false;
      mode_ = proto::Mode::kSum;
      staleness_ = 0;
      for (auto& [k, key] : keys_) {
        // A job that failed mid-round may leave a key's shards one round
        // apart (some completed it). The next job counts one round per key:
        // the shards behind skip to the newest version (that round's update
        // of them is lost, and said so).
        uint64_t lo = UINT64_MAX, hi = 0;
        for (const auto& sh : key.shards) {
          lo = std::min(lo, sh.version);
          hi = std::max(hi, sh.version);
        }
        if (!key.shards.empty() && lo != hi && !key.striped) {
          MEMBOX_LOG_WARN(
              "key {}: the job ended with its shards at versions {}..{}; "
              "the shards behind skip to {} (their last round is lost)",
              k, lo, hi, hi);
          for (auto& sh : key.shards) sh.version = hi;
        }
        key.awaiting_init = false;
        key.declared = false;  // the next job's first declaration decides
        for (auto& sh : key.shards) {
          sh.pushes.clear();
          sh.pulls.clear();
          sh.reducing = false;
          sh.ring.Reset();
          sh.first_push = {};
        }
      }
    }
  }

  // Synchronous rounds need every proxy.
  // A peer that leaves while workers are connected is a failure of the job
  // (a warning); with no worker connected it is the end of one (the nodes of
  // a finished job stop one after another), so it is only noted.
  void PeerDown(uint32_t rank, const Status& why) {
    if (!running_) return;  // this proxy is stopping too
    bool any_client = false;
    for (auto& [id, c] : conns_) any_client |= c.role == Conn::Role::kClient;
    std::string who = "proxy " + std::to_string(rank) + " at " +
                      opt_.peers[rank] + " is down (" + why.ToString() + ")";
    if (opt_.replicate && mode_ != proto::Mode::kAsync &&
        dead_worker_.empty()) {
      return PeerLost(rank, who, any_client);
    }
    if (any_client) {
      MEMBOX_LOG_WARN("{}", who);
    } else {
      MEMBOX_LOG_INFO("{}; no workers connected", who);
    }
    if (!dead_worker_.empty() || mode_ == proto::Mode::kAsync) return;
    if (any_client) FailPendingRounds(who);
  }

  // ------------------------------------------------------------ failover
  //
  // With `replicate`, a peer that dies pauses the synchronous rounds (the
  // ring spans every proxy) instead of failing them: the workers' pushes
  // stay admitted here, their data in the workers' memory. The hello of
  // its replacement (--join: it copied the newest state from us) resumes
  // them: every round in flight restarts from its pushes, and each
  // survivor sends the others kResume -- its ring notices from then on
  // belong to the restarted rounds; those it sent before are dropped.
  // Not replaced within failover_timeout: the rounds fail as without
  // replication.

  // A kPeerHello: the first of `rank`, or a new incarnation (its nonce
  // differs) that replaces one that died.
  void PeerHello(uint32_t rank, uint64_t conn, uint32_t nonce,
                 const std::string& endpoint) {
    auto it = peer_nonce_.find(rank);
    const bool replaced = it != peer_nonce_.end() && it->second != nonce;
    if (!endpoint.empty() && endpoint != opt_.peers[rank]) {
      // A replacement on another host (`membox serve --join` there): we
      // reach it, and tell workers who ask (kWhere), at its new address.
      MEMBOX_LOG_WARN("proxy {}: proxy {} is now at {} (was {})", opt_.rank,
                      rank, endpoint, opt_.peers[rank]);
      opt_.peers[rank] = endpoint;
    }
    peer_nonce_[rank] = nonce;
    peer_conn_[rank] = conn;
    if (!replaced && !peers_down_.count(rank)) {
      // A first hello; a link we had to an earlier incarnation we never
      // heard from is of no use.
      if (auto p = peer_out_.find(rank);
          p != peer_out_.end() && !p->second->health().ok()) {
        std::erase_if(peer_regions_,
                      [&](const auto& e) { return e.first.first == rank; });
        peer_out_.erase(p);
      }
      return;
    }
    if (!peers_down_.count(rank)) {
      PeerLost(rank,
               "proxy " + std::to_string(rank) + " at " + opt_.peers[rank] +
                   " was replaced",
               HasClients());
    }
    // The new incarnation gets new links.
    peer_incarnation_[rank]++;
    std::erase_if(catch_ups_,
                  [&](const auto& e) { return std::get<0>(e.first) == rank; });
    std::erase_if(peer_regions_,
                  [&](const auto& e) { return e.first.first == rank; });
    peer_out_.erase(rank);
    peers_down_.erase(rank);
    peers_down_count_.store(peers_down_.size());
    if (!peers_down_.empty()) return;  // another one is still down
    for (uint32_t p = 0; p < nproxies_; ++p) {
      if (p == opt_.rank || p == rank) continue;
      Message r;
      r.type = Type::kResume;
      r.rank = rank;
      r.world = nonce;
      Status st = SendToPeer(p, r);
      if (!st.ok()) {
        MEMBOX_LOG_WARN("proxy {}: cannot tell proxy {} that we resume: {}",
                        opt_.rank, p, st.ToString());
      }
    }
    const double paused =
        std::chrono::duration<double>(Clock::now() - down_since_).count();
    if (HasClients()) {
      MEMBOX_LOG_WARN(
          "proxy {}: proxy {} at {} is back (a replacement); the rounds "
          "resume after {:.2f} s",
          opt_.rank, rank, opt_.peers[rank], paused);
      failovers_.fetch_add(1);
    }
    MaybeStartAll();
  }

  // A peer restarted its rounds after `m.rank` (incarnation m.world) was
  // replaced. If we have not seen that yet, we pause now; its hello is on
  // its way.
  void OnResume(uint32_t from, const Message& m) {
    if (m.rank >= nproxies_ || m.rank == opt_.rank) return;
    auto it = peer_nonce_.find(m.rank);
    const bool seen = it != peer_nonce_.end() && it->second == m.world;
    if (!seen && !peers_down_.count(m.rank)) {
      PeerLost(m.rank,
               "proxy " + std::to_string(from) + " reports proxy " +
                   std::to_string(m.rank) + " replaced",
               HasClients());
    }
    awaiting_resume_.erase(from);
  }

  // Pauses every round until `rank` is back (PeerHello).
  void PeerLost(uint32_t rank, const std::string& who, bool any_client) {
    if (!peers_down_.insert(rank).second) return;
    peers_down_count_.store(peers_down_.size());
    if (peers_down_.size() == 1) down_since_ = Clock::now();
    size_t restarted = 0;
    std::vector<std::pair<uint64_t, uint32_t>> complete;
    for (auto& [k, key] : keys_) {
      for (uint32_t s = 0; s < key.shards.size(); ++s) {
        Shard& sh = key.shards[s];
        if (sh.reducing && sh.ring.ReadsComplete(RingFor(k, s))) {
          // Every chunk is in: the result is complete, and the dead peer
          // may have finished (and answered) the round -- finish it too.
          complete.emplace_back(k, s);
        } else if (sh.reducing) {
          ++restarted;
          sh.reducing = false;  // the pushes stay; the sum is redone
        }
        sh.ring.Reset();  // and every notice kept for later rounds
      }
    }
    for (uint32_t p = 0; p < nproxies_; ++p) {
      if (p != opt_.rank && p != rank && !peers_down_.count(p)) {
        awaiting_resume_.insert(p);
      }
    }
    for (auto [k, s] : complete) FinishRound(k, s);
    if (any_client) {
      MEMBOX_LOG_WARN(
          "{}; {} round(s) in flight restart ({} complete here finish), and "
          "every round waits for its "
          "replacement (membox serve --join; membox launch --max-restarts "
          "starts one) for up to {} s",
          who, restarted, complete.size(),
          std::chrono::duration_cast<std::chrono::seconds>(
              opt_.failover_timeout)
              .count());
    } else {
      MEMBOX_LOG_INFO("{}; no workers connected", who);
    }
  }

  // Whether ring notices from peer `rank` on `conn` count.
  bool PeerCurrent(uint32_t rank, uint64_t conn) const {
    auto pc = peer_conn_.find(rank);
    return pc != peer_conn_.end() && pc->second == conn &&
           !peers_down_.count(rank) && !awaiting_resume_.count(rank);
  }

  bool HasClients() const {
    for (const auto& [id, c] : conns_) {
      if (c.role == Conn::Role::kClient) return true;
    }
    return false;
  }

  // Called by ReportWaits: a peer not replaced in time fails the job.
  void CheckFailoverDeadline() {
    if (peers_down_.empty() || !HasClients() || !dead_worker_.empty()) return;
    if (Clock::now() - down_since_ < opt_.failover_timeout) return;
    std::string who;
    for (uint32_t r : peers_down_) {
      who += (who.empty() ? "proxy " : ", proxy ") + std::to_string(r) +
             " at " + opt_.peers[r];
    }
    FailPendingRounds(
        who + " was not replaced within " +
        std::to_string(std::chrono::duration_cast<std::chrono::seconds>(
                           opt_.failover_timeout)
                           .count()) +
        " s");
  }

  // A synchronous round cannot finish once a worker or a proxy is gone: tell
  // everybody waiting instead of letting them hang.
  void FailPendingRounds(const std::string& who) {
    dead_worker_ = who +
                   "; the synchronous job cannot continue (membox launch "
                   "--max-restarts restarts the workers from this node's "
                   "state; or restart from a checkpoint)";
    Status s = AbortedError(dead_worker_);
    for (auto& [k, key] : keys_) {
      for (auto& sh : key.shards) {
        for (auto& [r, p] : sh.pushes) Reply(p.conn, Type::kPush, p.id, s);
        for (auto& p : sh.pulls) Reply(p.conn, Type::kPull, p.id, s);
        sh.pushes.clear();
        sh.pulls.clear();
        sh.first_push = {};
      }
    }
    for (auto& [id, m] : sched_.TakeAll()) Reply(id, m.type, m.id, s);
  }

  void OnClientMessage(uint64_t conn, Conn& c, Message m) {
    switch (m.type) {
      case Type::kRegion: {
        auto d = RegionDescriptor::Deserialize(m.descriptor);
        if (!d.ok()) return Reply(conn, m.type, m.id, d.status());
        auto rr = c.channel->Import(*d, kIoTimeout);
        if (!rr.ok()) return Reply(conn, m.type, m.id, rr.status());
        c.regions[d->region_id] = *rr;
        return Reply(conn, m.type, m.id, Status::Ok());
      }
      case Type::kConfigure:
        return Reply(conn, m.type, m.id, Configure(m));
      case Type::kTune:
        return Reply(conn, m.type, m.id, Tune(c, m));
      case Type::kDeclare: {
        auto v = Declare(c, m);
        // The reply's text is the key's shard size: the first declaration
        // fixed it, later ones adopt it.
        std::string shard;
        if (v.ok()) {
          const Key& k = keys_[m.key];
          shard = std::to_string(k.shard_bytes) + (k.striped ? " striped" : "");
        }
        Reply(conn, m.type, m.id, v.status(), v.ok() ? *v : 0, shard);
        return MaybeStartAll();
      }
      case Type::kRoute: {
        if (m.lat_proxy >= nproxies_ || m.bw_proxy >= nproxies_) {
          return Reply(conn, m.type, m.id,
                       InvalidArgumentError("no such proxy"));
        }
        RouteEntry e;
        e.threshold = m.threshold;
        e.lat = m.lat_proxy;
        e.bw = m.bw_proxy;
        e.from.insert(m.from_rounds.begin(), m.from_rounds.end());
        c.routes.push_back(std::move(e));
        Reply(conn, m.type, m.id, Status::Ok());
        return MaybeStartAll();
      }
      case Type::kPush: {
        if (RetriedRound(conn, m)) return;
        Status s = CheckShardRequest(m);
        if (!s.ok()) {
          MEMBOX_LOG_DEBUG("push from rank {} refused: {}", c.rank,
                           s.ToString());
          return Reply(conn, m.type, m.id, s);
        }
        if (keys_[m.key].stored) {
          return Reply(conn, m.type, m.id,
                       FailedPreconditionError(
                           "key " + std::to_string(m.key) +
                           " is a stored key: workers write it with Store, "
                           "it takes no pushes"));
        }
        if (!dead_worker_.empty()) {
          return Reply(conn, m.type, m.id, AbortedError(dead_worker_));
        }
        sched_.Enqueue(conn, std::move(m));
        return Schedule();
      }
      case Type::kPull: {
        Status s = CheckShardRequest(m);
        if (!s.ok()) return Reply(conn, m.type, m.id, s);
        Key& key = keys_[m.key];
        Shard& sh = key.shards[m.shard];
        PendingPull p{conn,         m.id,         m.min_version,
                      m.out_region, m.out_offset, Clock::now()};
        if (sh.version >= p.min_version && !key.awaiting_init) {
          return ServePull(m.key, sh, p);
        }
        if (!dead_worker_.empty()) {
          return Reply(conn, m.type, m.id, AbortedError(dead_worker_));
        }
        sh.pulls.push_back(p);
        return;
      }
      case Type::kWhere:
        if (m.rank >= nproxies_) {
          return Reply(conn, m.type, m.id,
                       InvalidArgumentError("no such proxy"));
        }
        return Reply(conn, m.type, m.id, Status::Ok(), 0,
                     nproxies_ > 1 ? opt_.peers[m.rank] : opt_.listen);
      case Type::kStore:
        return Store(conn, c, m);
      case Type::kProbe: {
        // The profiler writes into this buffer over the worker's own link.
        if (m.bytes > (256u << 20)) {
          return Reply(conn, m.type, m.id,
                       InvalidArgumentError("probe too large"));
        }
        if (!probe_ || probe_->size() < m.bytes) {
          probe_.reset();
          auto r = device_->AllocateMemRegion(m.bytes);
          if (!r.ok()) return Reply(conn, m.type, m.id, r.status());
          probe_ = std::move(*r);
        }
        auto d = probe_->Export().Serialize();
        return Reply(conn, m.type, m.id, Status::Ok(), 0,
                     std::string(d.begin(), d.end()));
      }
      case Type::kCheckpoint: {
        // The writer thread answers (service::Server::Reply is
        // thread-safe; a connection gone meanwhile is skipped).
        uint64_t id = m.id;
        StartCheckpoint(m.path.empty() ? opt_.restore_name : m.path,
                        [this, conn, id](Status s) {
                          Reply(conn, Type::kCheckpoint, id, s);
                        });
        return;
      }
      default:
        return Reply(conn, m.type, m.id,
                     InvalidArgumentError("unexpected message"));
    }
  }

  // kStore: the worker's bytes replace the shard's value. They are read
  // into a buffer nobody else holds (the shard's scratch, or a new one) and
  // swapped in once whole, so a worker that dies in the middle leaves the
  // previous value. Over the network the read is not waited for on the
  // event loop (a state store is as large as a gradient push, and the
  // rounds go on meanwhile): its completion posts FinishStore and the
  // reply. Pulls waiting for a newer version are answered.
  void Store(uint64_t conn, Conn& c, const Message& m) {
    auto reply = [&](const Status& s, uint64_t v = 0) {
      Reply(conn, Type::kStore, m.id, s, v);
    };
    if (Status s = CheckShardRequest(m); !s.ok()) return reply(s);
    Key& key = keys_[m.key];
    if (!key.stored) {
      return reply(FailedPreconditionError(
          "key " + std::to_string(m.key) +
          " is not a stored key (declare it stored to write it with Store)"));
    }
    if (key.striped && Owner(m.key, m.shard) != opt_.rank) {
      return reply(FailedPreconditionError(
          "shard " + std::to_string(m.shard) + " of key " +
          std::to_string(m.key) + " lives on proxy " +
          std::to_string(Owner(m.key, m.shard))));
    }
    Shard& sh = key.shards[m.shard];
    auto rr = WorkerRange(c, m.region, m.offset, sh.bytes, "input");
    if (!rr.ok()) return reply(rr.status());
    std::shared_ptr<MemRegion> buf = std::move(sh.scratch);
    if (!buf || buf.use_count() > 1) {
      auto fresh = storage_->Allocate(sh.bytes);
      if (!fresh.ok()) return reply(fresh.status());
      buf = std::move(*fresh);
    }
    const uint64_t seq = ++sh.stores_issued;
    uint8_t* dst = static_cast<uint8_t*>(buf->data());
    if ((*rr)->mapped()) {
      const uint8_t* src =
          static_cast<const uint8_t*>((*rr)->mapped()) + m.offset;
      const uint64_t n = sh.bytes;
      sync_->ParallelFor(n, 1 << 20, [&](size_t b, size_t e) {
        std::memcpy(dst + b, src + b, e - b);
      });
      auto v = FinishStore(m.key, m.shard, seq, std::move(buf));
      return reply(v.status(), v.ok() ? *v : 0);
    }
    if (!c.channel) return reply(UnavailableError("worker link is gone"));
    auto r = c.channel->Read(
        dst, *buf, (*rr)->address() + m.offset, **rr, sh.bytes,
        [this, conn, id = m.id, k = m.key, shard = m.shard, seq,
         buf](const Status& st) {
          Post([this, conn, id, k, shard, seq, buf, st] {
            if (!st.ok()) return Reply(conn, Type::kStore, id, st);
            auto v = FinishStore(k, shard, seq, buf);
            Reply(conn, Type::kStore, id, v.status(), v.ok() ? *v : 0);
          });
        });
    if (!r.ok()) return reply(r.status());
    Track(std::move(*r));
  }

  // A store's bytes are all in `buf`: it becomes the shard's value (unless
  // a newer store already landed), the old value its scratch. Returns the
  // shard's version.
  Result<uint64_t> FinishStore(uint64_t k, uint32_t shard, uint64_t seq,
                               std::shared_ptr<MemRegion> buf) {
    auto it = keys_.find(k);
    if (it == keys_.end() || shard >= it->second.shards.size() ||
        it->second.shards[shard].bytes > buf->size()) {
      return AbortedError("key " + std::to_string(k) +
                          " was replaced while a store was in flight");
    }
    Key& key = it->second;
    Shard& sh = key.shards[shard];
    if (seq > sh.stores_applied) {
      sh.stores_applied = seq;
      std::swap(sh.value, buf);
      ++sh.version;
      key.initialized = true;
      stored_bytes_in_.fetch_add(sh.bytes, std::memory_order_relaxed);
      ServeWaitingPulls(k, sh);
    }
    if (!sh.scratch && buf && buf.use_count() == 1) sh.scratch = std::move(buf);
    return sh.version;
  }

  // The job-wide part of the configuration: the synchronisation mode and the
  // staleness bound. (Optimizers are per key: Declare / Tune.)
  Status Configure(const Message& m) {
    if (m.mode == proto::Mode::kAsync && nproxies_ > 1) {
      return UnimplementedError(
          "asynchronous mode runs on one proxy (replicas would diverge)");
    }
    if (m.mode == proto::Mode::kAverage) {
      // Keys this job declared for rounds: a key kept from a checkpoint or
      // copied from peers is checked when a worker declares it (its dtype
      // must match, and that declaration is checked against the mode).
      for (auto& [k, key] : keys_) {
        if (key.declared && !key.stored && !SupportsAveraging(key.dtype)) {
          return InvalidArgumentError(
              "averaging needs floating-point tensors (key " +
              std::to_string(k) + " is not)");
        }
      }
    }
    if (configured_) {
      if (m.mode != mode_ || m.staleness != staleness_) {
        return FailedPreconditionError(
            "a different synchronisation mode is already in force (mode and "
            "staleness are fixed for the job; optimizer settings are per "
            "tensor)");
      }
      return Status::Ok();
    }
    configured_ = true;
    staleness_ = m.staleness;
    mode_ = m.mode;
    return Status::Ok();
  }

  // The round a worker's next push of `key` belongs to (striped keys: the
  // shards this proxy owns).
  uint64_t CurrentRound(uint64_t id, const Key& k) const {
    if (!k.striped) return k.shards[0].version;
    uint64_t v = 0;
    for (uint32_t s = 0; s < k.shards.size(); ++s) {
      if (Owner(id, s) == opt_.rank) v = std::max(v, k.shards[s].version);
    }
    return v;
  }

  // New hyperparameters for the declared keys in [m.key, m.key_end), from
  // the next round on (workers tune between rounds: after a step's results
  // are back, before the next step's pushes). All or nothing.
  Status Tune(const Conn& c, const Message& m) {
    const OptimizerSettings want = OptimizerSettings::From(m);
    auto first = keys_.lower_bound(m.key);
    auto last = keys_.lower_bound(m.key_end);
    bool any = false;
    for (auto it = first; it != last; ++it) {
      const Key& k = it->second;
      if (!k.declared) continue;
      any = true;
      if (k.opt.kind != want.kind) {
        return FailedPreconditionError(
            "key " + std::to_string(it->first) + " uses optimizer " +
            k.opt.ToString() +
            ": tuning changes hyperparameters, not the optimizer");
      }
      if (k.opt == want) continue;
      const uint64_t round = CurrentRound(it->first, k);
      if (k.tuned_round == round) {
        for (uint32_t r : k.tuned_by) {
          if (r == c.rank) continue;
          return FailedPreconditionError(
              "workers disagree on the optimizer of key " +
              std::to_string(it->first) + " for round " +
              std::to_string(round) + ": rank " + std::to_string(r) + " set " +
              k.opt.ToString() + ", rank " + std::to_string(c.rank) +
              " asks for " + want.ToString());
        }
      }
    }
    if (!any) {
      return NotFoundError("no declared key in [" + std::to_string(m.key) +
                           ", " + std::to_string(m.key_end) + ")");
    }
    for (auto it = first; it != last; ++it) {
      Key& k = it->second;
      if (!k.declared) continue;
      const uint64_t round = CurrentRound(it->first, k);
      if (k.tuned_round != round) k.tuned_by.clear();
      k.tuned_round = round;
      k.tuned_by.insert(c.rank);
      k.opt = want;
    }
    return Status::Ok();
  }

  Result<uint64_t> Declare(Conn& c, const Message& m) {
    auto dt = static_cast<DType>(m.dtype);
    // A stored key is bytes the workers keep: any dtype; no sums.
    if (m.dtype < 1 || m.dtype > static_cast<uint8_t>(DType::kUInt8) ||
        (!m.stored && !AccumulateSupports(dt))) {
      return InvalidArgumentError("unsupported dtype for synchronisation");
    }
    size_t es = DTypeSize(dt);
    if (m.bytes % es != 0 || m.shard_bytes % es != 0) {
      return InvalidArgumentError(
          "sizes must be multiples of the element size");
    }
    if (m.bytes > opt_.max_bytes) {
      return ResourceExhaustedError("tensor larger than the proxy storage");
    }
    if (m.shard_bytes < std::min<uint64_t>(m.bytes, kMinShardBytes)) {
      return InvalidArgumentError("shards must be at least " +
                                  std::to_string(kMinShardBytes) +
                                  " bytes (or the whole tensor)");
    }
    if (mode_ == proto::Mode::kAverage && !m.stored && !SupportsAveraging(dt)) {
      return InvalidArgumentError(
          "averaging needs floating-point tensors (float32, float64, float16 "
          "or bfloat16)");
    }
    if (m.optimizer != proto::Optimizer::kNone && !SupportsArithmetic(dt)) {
      return InvalidArgumentError(
          "optimizers run on float32 or float64 weights (keep float32 master "
          "weights for a float16/bfloat16 model)");
    }
    auto it = keys_.find(m.key);
    if (it != keys_.end() && !it->second.declared && !it->second.restored &&
        (it->second.bytes != m.bytes || it->second.dtype != dt)) {
      // Kept from an earlier job that used the key for another tensor
      // (nodes outlive jobs: torchrun, `membox serve` on memory hosts):
      // this job's tensor replaces it. A checkpoint's key is never replaced
      // -- a different size there is the wrong model, refused below.
      n_shards_.fetch_sub(it->second.shards.size());
      n_keys_.fetch_sub(1);
      keys_.erase(it);
      it = keys_.end();
    }
    if (it != keys_.end()) {
      Key& k = it->second;
      if (k.bytes != m.bytes || k.dtype != dt) {
        return FailedPreconditionError(
            "key " + std::to_string(m.key) +
            " was declared with a different size or dtype");
      }
      if (k.declared && k.stored != m.stored) {
        return FailedPreconditionError(
            "key " + std::to_string(m.key) + " was declared " +
            (k.stored ? "stored" : "for rounds") +
            " by another worker: every worker declares it the same way");
      }
      if (k.declared && k.opt.kind != m.optimizer) {
        return FailedPreconditionError(
            "key " + std::to_string(m.key) + " was declared with optimizer " +
            k.opt.ToString() +
            " by another worker: every worker declares it with the same one");
      }
      // The first worker's declaration (of this job: keys outlive jobs on a
      // node) fixes the striping (like the shard size) and the optimizer;
      // later ones adopt them (hyperparameters change only through Tune).
      // A key may become striped -- every proxy holds its whole current
      // value -- but not the reverse: a striped key's shards are current on
      // their owners only.
      if (!k.declared) {
        if (m.striped && nproxies_ > 1 && !opt_.replicate) k.striped = true;
        OptimizerSettings o = OptimizerSettings::From(m);
        // A restored key's optimizer state is the job's own (its kind was
        // not recorded): keep it.
        if (o.kind != k.opt.kind && !k.restored) {
          for (auto& sh : k.shards) {
            sh.m1.reset();
            sh.m2.reset();
          }
        }
        k.opt = o;
        k.stored = m.stored;
      }
      k.declared = true;
      k.restored = false;  // adopted by this job
    } else {
      Key k;
      k.bytes = m.bytes;
      k.dtype = dt;
      k.shard_bytes = m.shard_bytes;
      k.striped = m.striped && nproxies_ > 1 && !opt_.replicate;
      k.opt = OptimizerSettings::From(m);
      k.stored = m.stored;
      k.initialized = m.stored;  // nothing to wait for
      k.declared = true;
      uint64_t n = (m.bytes + m.shard_bytes - 1) / m.shard_bytes;
      if (n > (1u << 20)) return InvalidArgumentError("too many shards");
      for (uint64_t i = 0; i < n; ++i) {
        Shard sh;
        sh.offset = i * m.shard_bytes;
        sh.bytes = std::min(m.shard_bytes, m.bytes - sh.offset);
        ASSIGN_OR_RETURN(sh.value, storage_->Allocate(sh.bytes));
        k.shards.push_back(std::move(sh));
      }
      n_shards_.fetch_add(n);
      n_keys_.fetch_add(1);
      it = keys_.emplace(m.key, std::move(k)).first;
      std::vector<Message> early;
      std::erase_if(early_notices_, [&](Message& e) {
        if (e.key != m.key) return false;
        early.push_back(std::move(e));
        return true;
      });
      for (auto& e : early) OnPeerNotice(e);
    }
    Key& k = it->second;
    // Initial values: rank 0's win, whatever the order declarations arrive
    // in; until rank 0 has declared, the key's pulls and pushes wait.
    if (!k.initialized && c.rank == 0) {
      if (m.has_input) {
        for (auto& sh : k.shards) {
          uint8_t* dst = static_cast<uint8_t*>(sh.value->data());
          ASSIGN_OR_RETURN(const uint8_t* src,
                           ReadWorker(c, m.region, m.offset + sh.offset,
                                      sh.bytes, dst, *sh.value));
          if (src != dst) std::memcpy(dst, src, sh.bytes);
        }
        k.initialized = true;
      }
      if (k.awaiting_init) {
        k.awaiting_init = false;
        for (auto& sh : k.shards) ServeWaitingPulls(m.key, sh);
        Schedule();
      }
    } else if (!k.initialized && m.has_input) {
      k.awaiting_init = true;
    }
    return CurrentRound(m.key, k);
  }

  // With replication, a worker whose proxy died sends its push again to
  // the replacement, which may hold the round already complete (a survivor
  // finished it, and the replacement copied that): the answer is the
  // current value -- that round's result, since the next one cannot have
  // finished without this worker.
  bool RetriedRound(uint64_t conn, const Message& m) {
    if (!opt_.replicate || mode_ == proto::Mode::kAsync) return false;
    auto it = keys_.find(m.key);
    if (it == keys_.end() || m.shard >= it->second.shards.size()) return false;
    Shard& sh = it->second.shards[m.shard];
    if (m.round + 1 != sh.version || !sh.value) return false;
    MEMBOX_LOG_DEBUG(
        "key {} shard {}: round {} was completed elsewhere; "
        "answering the retried push with version {}",
        m.key, m.shard, m.round, sh.version);
    if (m.has_output) {
      WriteThenReply(conn, Type::kPush, m.id, m.out_region, m.out_offset,
                     sh.value, sh.bytes, sh.version);
    } else {
      Reply(conn, Type::kPush, m.id, Status::Ok(), sh.version);
    }
    return true;
  }

  Status CheckShardRequest(const Message& m) {
    auto it = keys_.find(m.key);
    if (it == keys_.end()) {
      return NotFoundError("key " + std::to_string(m.key) + " not declared");
    }
    if (m.shard >= it->second.shards.size()) {
      return OutOfRangeError("shard index out of range");
    }
    const Shard& sh = it->second.shards[m.shard];
    if (m.type == Type::kPush && mode_ != proto::Mode::kAsync) {
      if (m.round < sh.version) {
        return InvalidArgumentError("round " + std::to_string(m.round) +
                                    " of key " + std::to_string(m.key) +
                                    " is already complete");
      }
      if (m.round > sh.version + (1u << 20)) {
        return InvalidArgumentError("round too far ahead");
      }
    }
    return Status::Ok();
  }

  // ------------------------------------------------------------ scheduling

  // Admits queued pushes the shard's state and the scheduler allow.
  void Schedule() {
    sched_.Drain(
        [this](uint64_t conn, const Message& m) {
          auto it = conns_.find(conn);
          return it != conns_.end() && Admissible(it->second, m);
        },
        [this](const Message&) { return mode_ != proto::Mode::kAsync; },
        [this](uint64_t conn, Message m) {
          auto it = conns_.find(conn);
          if (it != conns_.end()) Admit(conn, it->second, m);
        });
  }

  bool Admissible(const Conn& c, const Message& m) {
    Key& key = keys_[m.key];
    if (key.awaiting_init) return false;
    Shard& sh = key.shards[m.shard];
    if (mode_ == proto::Mode::kAsync) {
      if (staleness_ == 0) return true;
      if (sh.applied.size() < world_) sh.applied.resize(world_, 0);
      // This worker's pushes are applied in order, so its next one is
      // number applied[rank]; it may run `staleness` ahead of the slowest.
      // (Round numbers are not compared: a worker that declared late
      // starts its count at the version it found.)
      uint64_t slowest =
          *std::min_element(sh.applied.begin(), sh.applied.end());
      return sh.applied[c.rank] <= slowest + staleness_;
    }
    return m.round == sh.version && !sh.reducing;
  }

  void Admit(uint64_t conn, Conn& c, const Message& m) {
    Key& key = keys_[m.key];
    Shard& sh = key.shards[m.shard];
    if (mode_ == proto::Mode::kAsync) return ApplyAsync(conn, c, key, sh, m);
    if (sh.pushes.count(c.rank)) {
      Reply(conn, m.type, m.id,
            InvalidArgumentError("duplicate push for a round"));
      return;
    }
    if (key.striped ? Owner(m.key, m.shard) != opt_.rank
                    : !RoutedHere(c, m.key, sh.bytes, m.round)) {
      Reply(conn, m.type, m.id,
            FailedPreconditionError("this push contradicts the routing table "
                                    "the worker announced"));
      return;
    }
    if (sh.pushes.empty()) sh.first_push = Clock::now();
    sh.pushes[c.rank] =
        Contribution{conn,     m.id,         c.rank,       m.region,
                     m.offset, m.has_output, m.out_region, m.out_offset};
    Prefetch(m.key, m.shard, c, sh.pushes[c.rank]);
    MaybeStart(m.key, m.shard);
  }

  // Starts reading a push the proxy cannot map (TCP, RMA) into the shard's
  // inbox right away, instead of when the round starts: a node then reads
  // the next shards' pushes while it writes the last ones' results, and
  // its link carries both directions at once. The read's completion posts
  // a task that marks it and retries the round's start.
  void Prefetch(uint64_t k, uint32_t s, Conn& c, Contribution& p) {
    Shard& sh = keys_[k].shards[s];
    auto it = c.regions.find(p.region);
    if (it == c.regions.end() || it->second->mapped() || !c.channel) return;
    auto rr = WorkerRange(c, p.region, p.offset, sh.bytes, "input");
    if (!rr.ok()) return;  // LocalSum reports it
    auto& buf = sh.inbox[p.rank];
    if (!buf || buf->size() < sh.bytes) {
      auto b = storage_->Allocate(sh.bytes);
      if (!b.ok()) return;  // LocalSum reads it the slow way
      buf = std::move(*b);
    }
    uint64_t round = sh.version;
    uint32_t rank = p.rank;
    auto h =
        c.channel->Read(buf->data(), *buf, (*rr)->address() + p.offset, **rr,
                        sh.bytes, [this, k, s, rank, round](const Status& st) {
                          Post([this, k, s, rank, round, st] {
                            Fetched(k, s, rank, round, st);
                          });
                        });
    if (!h.ok()) return;
    p.prefetched = true;
    p.fetching = true;
    Track(std::move(*h));
  }

  void Fetched(uint64_t k, uint32_t s, uint32_t rank, uint64_t round,
               const Status& st) {
    auto kit = keys_.find(k);
    if (kit == keys_.end() || s >= kit->second.shards.size()) return;
    Shard& sh = kit->second.shards[s];
    auto it = sh.pushes.find(rank);
    if (sh.version != round || it == sh.pushes.end() || !it->second.fetching) {
      return;  // the round failed or ended meanwhile
    }
    it->second.fetching = false;
    it->second.fetched = st.ok() ? Status::Ok() : st;
    MaybeStart(k, s);
  }

  // Whether worker `c`'s table sends (key, round) of a `bytes` shard here.
  // Without a table yet: unknown, treated as "here" (never assume a skip).
  bool RoutedHere(const Conn& c, uint64_t key, uint64_t bytes,
                  uint64_t round) const {
    if (c.routes.empty()) return true;
    // The worker's rule (param_client.cc RouteFor): the latest table that
    // applies from this round; a key it did not list starts at round 0 in
    // its first table and at round 1 in later ones.
    const RouteEntry* e = &c.routes.front();
    for (size_t i = c.routes.size(); i-- > 0;) {
      const RouteEntry& it = c.routes[i];
      auto f = it.from.find(key);
      uint64_t from = f != it.from.end() ? f->second : (i == 0 ? 0 : 1);
      if (from <= round) {
        e = &it;
        break;
      }
    }
    uint32_t target = bytes < e->threshold ? e->lat : e->bw;
    return target == opt_.rank;
  }

  // The proxy that owns shard s of a striped key.
  uint32_t Owner(uint64_t k, uint32_t s) const {
    return static_cast<uint32_t>((k + s) % std::max<uint32_t>(1, nproxies_));
  }

  // Starts round `version` of a shard once every worker has pushed it here
  // or routes it elsewhere (no message needed: the proxies know every
  // worker's table). A proxy nobody pushes to joins the ring with zeros.
  void MaybeStart(uint64_t k, uint32_t s) {
    if (mode_ == proto::Mode::kAsync || world_ == 0) return;
    Key& key = keys_[k];
    Shard& sh = key.shards[s];
    if (sh.reducing || !dead_worker_.empty()) return;
    if (!peers_down_.empty() && !key.striped) return;  // failover: paused
    // A key this job has not declared (kept from an earlier job, or
    // restored) has no round yet: its striping is decided by the
    // declaration, and a proxy must not join a ring for it before.
    if (!key.declared) return;
    if (key.striped && Owner(k, s) != opt_.rank) return;
    for (auto& [r, p] : sh.pushes) {
      if (p.fetching) return;  // Fetched() calls again
    }
    uint32_t present = 0;
    for (auto& [id, c] : conns_) {
      if (c.role != Conn::Role::kClient) continue;
      ++present;
      if (c.replaying) return;
      if (sh.pushes.count(c.rank)) continue;
      if (key.striped) return;
      if (c.routes.empty() || RoutedHere(c, k, sh.bytes, sh.version)) return;
    }
    if (present != world_) return;
    if (sh.pushes.empty() && nproxies_ == 1) return;
    if (!sched_.MayStart({k, s, sh.version})) return;
    StartReduce(k, s);
  }

  void MaybeStartAll() {
    for (auto& [k, key] : keys_) {
      for (uint32_t s = 0; s < key.shards.size(); ++s) MaybeStart(k, s);
    }
  }

  // ------------------------------------------------------------ reduction

  void StartReduce(uint64_t k, uint32_t s) {
    Key& key = keys_[k];
    Shard& sh = key.shards[s];
    Status st = LocalSum(key, sh);
    if (!st.ok()) {
      MEMBOX_LOG_WARN("key {} shard {}: {}", k, s, st.ToString());
      for (auto& [r, p] : sh.pushes) Reply(p.conn, Type::kPush, p.id, st);
      sh.pushes.clear();
      sh.first_push = {};
      return;
    }
    sh.reducing = true;
    if (nproxies_ == 1 || key.striped) return FinishRound(k, s);
    RunRing(k, s, /*start=*/true);
  }

  // scratch <- sum of the pushes in rank order (zeros when every worker sent
  // this shard to another proxy).
  Status LocalSum(Key& key, Shard& sh) {
    if (!sh.scratch || sh.scratch.use_count() > 1) {
      ASSIGN_OR_RETURN(sh.scratch, storage_->Allocate(sh.bytes));
    }
    uint8_t* dst = static_cast<uint8_t*>(sh.scratch->data());
    std::vector<const void*> srcs;
    bool all_mapped = true;
    for (auto& [r, p] : sh.pushes) {
      Conn& c = conns_[p.conn];
      auto it = c.regions.find(p.region);
      if (it == c.regions.end()) {
        return NotFoundError("push from an unregistered region");
      }
      if (p.offset > it->second->size() ||
          sh.bytes > it->second->size() - p.offset) {
        return OutOfRangeError("push range outside the registered region");
      }
      if (p.prefetched) {
        RETURN_IF_ERROR(p.fetched);
        srcs.push_back(sh.inbox[r]->data());
      } else if (it->second->mapped()) {
        srcs.push_back(static_cast<const uint8_t*>(it->second->mapped()) +
                       p.offset);
      } else {
        all_mapped = false;  // read below, one push at a time
      }
    }
    if (sh.pushes.empty()) {
      std::memset(dst, 0, sh.bytes);
    } else if (all_mapped) {  // mapped or prefetched: sum on the sync cores
      SumInto(*sync_, key.dtype, dst, srcs, sh.bytes);
    } else {
      bool first = true;
      for (auto& [r, p] : sh.pushes) {
        Conn& c = conns_[p.conn];
        uint8_t* into = dst;
        const MemRegion* into_region = sh.scratch.get();
        if (!first) {
          ASSIGN_OR_RETURN(auto* st, Staging(sh.bytes));
          into = static_cast<uint8_t*>(st->data());
          into_region = st;
        }
        const uint8_t* src = nullptr;
        if (p.prefetched) {
          src = static_cast<const uint8_t*>(sh.inbox[r]->data());
        } else {
          ASSIGN_OR_RETURN(src, ReadWorker(c, p.region, p.offset, sh.bytes,
                                           into, *into_region));
        }
        if (first) {
          if (src != dst) std::memcpy(dst, src, sh.bytes);
          first = false;
        } else {
          size_t es = DTypeSize(key.dtype);
          sync_->Run(key.dtype, dst, src, sh.bytes / es, 1.0);
        }
      }
    }
    bytes_reduced_.fetch_add(sh.bytes * std::max<size_t>(1, sh.pushes.size()));
    return Status::Ok();
  }

  // ------------------------------------------------------------ ring

  RingGeometry RingFor(uint64_t k, uint32_t s) const {
    return RingGeometry::For(nproxies_, opt_.rank, k, s);
  }

  // The ring's reads and notices for shard s of key k.
  RingProgress::Io RingIo(uint64_t k, uint32_t s) {
    RingProgress::Io io;
    io.read = [this, k, s](uint32_t step, const RegionDescriptor& d) {
      Key& key = keys_[k];
      const RingGeometry ring = RingFor(k, s);
      if (opt_.before_ring_read_for_test) {
        opt_.before_ring_read_for_test(k, s, key.shards[s].version, step,
                                       ring.prev);
      }
      return RingRead(key, key.shards[s], ring, step, d);
    };
    io.send_ready = [this, k, s](uint32_t step) {
      Shard& sh = keys_[k].shards[s];
      Message m;
      m.type = Type::kReady;
      m.key = k;
      m.shard = s;
      m.round = sh.version;
      m.step = step;
      m.descriptor = sh.scratch->Export().Serialize();
      return SendToPeer(RingFor(k, s).next, m);
    };
    io.send_done = [this, k, s](uint32_t step) {
      Message d;
      d.type = Type::kDone;
      d.key = k;
      d.shard = s;
      d.round = keys_[k].shards[s].version;
      d.step = step;
      return SendToPeer(RingFor(k, s).prev, d);
    };
    return io;
  }

  // Starts the shard's ring for its current round, or runs the steps whose
  // notices are in; finishes the round when the sum is complete.
  void RunRing(uint64_t k, uint32_t s, bool start) {
    Shard& sh = keys_[k].shards[s];
    const uint64_t before = sh.ring.steps_done();
    const RingGeometry ring = RingFor(k, s);
    const RingProgress::Io io = RingIo(k, s);
    auto r =
        start ? sh.ring.Start(sh.version, ring, io) : sh.ring.Advance(ring, io);
    ring_steps_.fetch_add(sh.ring.steps_done() - before);
    if (!r.ok() && opt_.replicate) {
      // A link to a neighbour that failed: that peer is down (pause);
      // anything else fails this round.
      for (uint32_t p : {ring.next, ring.prev}) {
        auto it = peer_out_.find(p);
        if (it != peer_out_.end() && !it->second->health().ok()) {
          return PeerDown(p, r.status());
        }
      }
    }
    if (!r.ok()) return AbortRound(k, s, r.status());
    if (*r && sh.reducing) FinishRound(k, s);
  }

  void OnPeerNotice(const Message& m) {
    auto it = keys_.find(m.key);
    if (it == keys_.end()) {
      // The peer saw the key declared before we did; replay on Declare.
      if (early_notices_.size() < 1000000) early_notices_.push_back(m);
      return;
    }
    if (m.shard >= it->second.shards.size()) {
      MEMBOX_LOG_WARN("peer notice for key {}: no shard {}", m.key, m.shard);
      return;
    }
    Shard& sh = it->second.shards[m.shard];
    if (m.type == Type::kReady && m.round < sh.version && opt_.replicate) {
      // Only a laggard announces a round we finished (see kCatchUp).
      return SendCatchUp(RingFor(m.key, m.shard).prev, m.key, m.shard, m.round);
    }
    if (m.type == Type::kReady && m.round == sh.version &&
        sched_.kind() == Scheduler::kFirstComeFirstServe) {
      sched_.PeerReady({m.key, m.shard, m.round});
      MaybeStart(m.key, m.shard);
    }
    if (m.type == Type::kReady) {
      auto d = RegionDescriptor::Deserialize(m.descriptor);
      if (!d.ok()) {
        MEMBOX_LOG_WARN("peer sent a bad descriptor: {}",
                        d.status().ToString());
        return;
      }
      sh.ring.OnReady(m.round, m.step, std::move(*d));
    } else {
      sh.ring.OnDone(m.round, m.step);
    }
    if (sh.reducing && sh.ring.running()) RunRing(m.key, m.shard, false);
  }

  // Step `step`: reduce-scatter (add the previous proxy's chunk) for the
  // first P-1 steps, all-gather (copy it) after.
  Status RingRead(Key& key, Shard& sh, const RingGeometry& ring, uint32_t step,
                  const RegionDescriptor& desc) {
    const size_t es = DTypeSize(key.dtype);
    const bool reduce = ring.Reduces(step);
    auto [off, len] = RingChunk(sh.bytes, es, ring.P, ring.ChunkAt(step));
    if (len == 0) return Status::Ok();
    if (desc.length != sh.bytes) {
      return DataLossError("peer's ring buffer has a different size");
    }
    ASSIGN_OR_RETURN(auto ch, PeerChannel(ring.prev));
    std::shared_ptr<RemoteMemRegion> rr;
    auto key2 = std::make_pair(ring.prev, desc.region_id);
    auto it = peer_regions_.find(key2);
    if (it != peer_regions_.end() &&
        it->second->descriptor().token == desc.token) {
      rr = it->second;
    } else {
      ASSIGN_OR_RETURN(rr, ch->Import(desc, kIoTimeout));
      peer_regions_[key2] = rr;
    }
    uint8_t* dst = static_cast<uint8_t*>(sh.scratch->data()) + off;
    const uint8_t* src;
    if (rr->mapped()) {
      src = static_cast<const uint8_t*>(rr->mapped()) + off;
    } else {
      uint8_t* into = dst;
      const MemRegion* into_region = sh.scratch.get();
      if (reduce) {
        ASSIGN_OR_RETURN(auto* st, Staging(len));
        into = static_cast<uint8_t*>(st->data());
        into_region = st;
      }
      ASSIGN_OR_RETURN(
          auto h, ch->Read(into, *into_region, rr->address() + off, *rr, len));
      RETURN_IF_ERROR(h.Wait(kIoTimeout));
      src = into;
    }
    if (reduce) {
      sync_->Run(key.dtype, dst, src, len / es, 1.0);
    } else if (src != dst) {
      const size_t total = len;  // a structured binding: not capturable
      sync_->ParallelFor(total, 1 << 20, [&](size_t b, size_t e) {
        CopyPiece(dst + b, src + b, e - b, total);
      });
    }
    return Status::Ok();
  }

  void AbortRound(uint64_t k, uint32_t s, const Status& why) {
    Shard& sh = keys_[k].shards[s];
    MEMBOX_LOG_WARN("key {} shard {} round {}: {}", k, s, sh.version,
                    why.ToString());
    Status st = UnavailableError("proxy ring failed: " + why.ToString());
    for (auto& [r, p] : sh.pushes) Reply(p.conn, Type::kPush, p.id, st);
    for (auto& p : sh.pulls) Reply(p.conn, Type::kPull, p.id, st);
    sh.pushes.clear();
    sh.pulls.clear();
    sh.reducing = false;
    sh.ring.Stop();
    sh.first_push = {};
  }

  // The sum is complete in scratch: apply mode / optimizer, publish the new
  // version, answer the pushes and pulls, and admit the next round.
  void FinishRound(uint64_t k, uint32_t s) {
    Key& key = keys_[k];
    Shard& sh = key.shards[s];
    Status st = storage_->Apply(
        key.dtype, key.opt,
        key.opt.kind == proto::Optimizer::kNone ? Update::kReplace
                                                : Update::kOptimizer,
        sh, sh.scratch.get(),
        mode_ == proto::Mode::kAverage ? 1.0 / world_ : 1.0);
    if (st.ok()) sh.version++;
    PublishRound(k, s, st);
  }

  // The round's result is in storage (version bumped) or it failed with
  // `st`: answer its pushes and the pulls it satisfies, admit the next.
  void PublishRound(uint64_t k, uint32_t s, const Status& st) {
    Shard& sh = keys_[k].shards[s];
    sh.reducing = false;
    sh.first_push = {};
    auto pushes = std::move(sh.pushes);
    sh.pushes.clear();
    if (st.ok()) rounds_.fetch_add(1);
    for (auto& [r, p] : pushes) {
      if (st.ok() && p.has_output) {
        WriteThenReply(p.conn, Type::kPush, p.id, p.out_region, p.out_offset,
                       sh.value, sh.bytes, sh.version);
      } else {
        Reply(p.conn, Type::kPush, p.id, st, sh.version);
      }
    }
    ServeWaitingPulls(k, sh);
    if (sched_.kind() == Scheduler::kFirstComeFirstServe) {
      sched_.Completed(k, s, sh.version);
      MaybeStartAll();  // the next tensor in line
    }
    Schedule();
    MaybeStart(k, s);
  }

  void ApplyAsync(uint64_t conn, Conn& c, Key& key, Shard& sh,
                  const Message& m) {
    auto st = Staging(sh.bytes);
    if (!st.ok()) return Reply(conn, m.type, m.id, st.status());
    uint8_t* into = static_cast<uint8_t*>((*st)->data());
    auto src = ReadWorker(c, m.region, m.offset, sh.bytes, into, **st);
    if (!src.ok()) return Reply(conn, m.type, m.id, src.status());
    if (*src != into) std::memcpy(into, *src, sh.bytes);
    Status s = storage_->Apply(key.dtype, key.opt,
                               key.opt.kind == proto::Optimizer::kNone
                                   ? Update::kAdd
                                   : Update::kOptimizer,
                               sh, *st, 1.0);
    if (!s.ok()) return Reply(conn, m.type, m.id, s);
    sh.version++;
    if (sh.applied.size() < world_) sh.applied.resize(world_, 0);
    sh.applied[c.rank]++;
    bytes_reduced_.fetch_add(sh.bytes);
    rounds_.fetch_add(1);
    if (m.has_output) {
      s = WriteWorker(c, m.out_region, m.out_offset,
                      static_cast<const uint8_t*>(sh.value->data()), sh.bytes,
                      *sh.value);
    }
    Reply(conn, m.type, m.id, s, sh.version);
  }

  void ServePull(uint64_t k, Shard& sh, const PendingPull& p) {
    auto it = conns_.find(p.conn);
    if (it == conns_.end()) return;
    Status s = WriteWorker(it->second, p.out_region, p.out_offset,
                           static_cast<const uint8_t*>(sh.value->data()),
                           sh.bytes, *sh.value);
    if (s.ok()) result_bytes_.fetch_add(sh.bytes, std::memory_order_relaxed);
    Reply(p.conn, Type::kPull, p.id, s, sh.version);
  }

  void ServeWaitingPulls(uint64_t k, Shard& sh) {
    if (keys_[k].awaiting_init) return;
    std::vector<PendingPull> keep;
    for (auto& p : sh.pulls) {
      if (sh.version >= p.min_version) {
        ServePull(k, sh, p);
      } else {
        keep.push_back(p);
      }
    }
    sh.pulls = std::move(keep);
  }

  // Keys and shards from checkpoint records (a file, or the peers' state a
  // joining proxy read). `source` names them in errors.
  // The shard `index` of key `k` as a record from a checkpoint or a peer
  // describes it: the key is created from the record's geometry when it is
  // new here, and must agree with it otherwise. Sets the shard's offset
  // and size; the caller fills the rest.
  Result<Shard*> PrepareShard(uint64_t k, uint32_t index, uint8_t dtype,
                              uint64_t key_bytes, uint64_t shard_bytes,
                              const std::string& path) {
    Key& key = keys_[k];
    auto dt = static_cast<DType>(dtype);
    if (key.shards.empty()) {
      // Any dtype (stored keys hold bytes); a key for rounds is declared
      // with a dtype the sums support, and must match this one.
      if (dtype < 1 || dtype > static_cast<uint8_t>(DType::kUInt8) ||
          shard_bytes == 0 || key_bytes % DTypeSize(dt) != 0) {
        return DataLossError(path + ": bad dtype or sizes for key " +
                             std::to_string(k));
      }
      key.bytes = key_bytes;
      key.dtype = dt;
      key.shard_bytes = shard_bytes;
      key.initialized = true;
      key.restored = true;
      uint64_t n = (key.bytes + key.shard_bytes - 1) / key.shard_bytes;
      if (n > (1u << 20)) return DataLossError(path + ": too many shards");
      key.shards.resize(n);
      n_keys_.fetch_add(1);
      n_shards_.fetch_add(n);
    }
    if (index >= key.shards.size() || key.bytes != key_bytes ||
        key.dtype != dt || key.shard_bytes != shard_bytes) {
      return DataLossError(path + ": inconsistent records for key " +
                           std::to_string(k));
    }
    Shard& sh = key.shards[index];
    sh.offset = uint64_t{index} * key.shard_bytes;
    sh.bytes = std::min(key.shard_bytes, key.bytes - sh.offset);
    return &sh;
  }

  // Every shard of every key has a value.
  Status CheckComplete(const std::string& path) {
    for (auto& [k, key] : keys_) {
      for (auto& sh : key.shards) {
        if (!sh.value) {
          return DataLossError(path + ": key " + std::to_string(k) +
                               " is missing shards");
        }
      }
    }
    return Status::Ok();
  }

  Status LoadRecords(const std::vector<CheckpointShard>& shards,
                     const std::string& path) {
    for (const auto& c : shards) {
      ASSIGN_OR_RETURN(Shard * sh,
                       PrepareShard(c.key, c.shard, c.dtype, c.key_bytes,
                                    c.shard_bytes, path));
      RETURN_IF_ERROR(storage_->Load(*sh, c).WithContext(
          path + ": key " + std::to_string(c.key)));
    }
    return CheckComplete(path);
  }

  // Takes shards copied from peers (their buffers become the shards').
  Status InstallCopied(std::vector<CopiedShard>& copied,
                       const std::string& path) {
    for (auto& c : copied) {
      const OfferedShard& o = *c.offer;
      ASSIGN_OR_RETURN(Shard * sh,
                       PrepareShard(o.key, o.shard, o.dtype, o.key_bytes,
                                    o.shard_bytes, path));
      if (sh->bytes != o.bytes) {
        return DataLossError(path + ": shard size mismatch for key " +
                             std::to_string(o.key));
      }
      sh->version = o.version;
      sh->value = std::move(c.value);
      sh->m1 = std::move(c.m1);
      sh->m2 = std::move(c.m2);
    }
    return CheckComplete(path);
  }

  CopyAllocator CopyBuffers() {
    return [this](uint64_t n) { return storage_->AllocateForOverwrite(n); };
  }

  // ------------------------------------------------------------ catch-up

  // A peer died in the last step of a round that this proxy finished (it
  // had read every chunk) while peer `to` had not: `to` restarted the round
  // and announced it (round `round`), but nobody else runs that round any
  // more. Its result is this shard as it is now (the rounds after it wait
  // for `to`), so give it that: the shard in checkpoint format in a region
  // it reads (kCatchUp), kept until its kCatchUpDone.
  void SendCatchUp(uint32_t to, uint64_t k, uint32_t s, uint64_t round) {
    Key& key = keys_[k];
    Shard& sh = key.shards[s];
    if (round + 1 != sh.version || !sh.value) {
      MEMBOX_LOG_WARN(
          "proxy {}: proxy {} announced round {} of key {} shard {}, which "
          "is not the round before ours ({}); ignored",
          opt_.rank, to, round, k, s, sh.version);
      return;
    }
    CatchUp& slot = catch_ups_[{to, k, s}];
    if (slot.offer && slot.version == sh.version) return;  // on its way
    auto offer =
        StateOffer::Make(*device_, opt_.rank,
                         {{k, s, key.dtype, key.bytes, key.shard_bytes, &sh}});
    if (!offer.ok()) {
      MEMBOX_LOG_WARN("proxy {}: cannot give proxy {} key {} shard {}: {}",
                      opt_.rank, to, k, s, offer.status().ToString());
      catch_ups_.erase({to, k, s});
      return;
    }
    Message c;
    c.type = Type::kCatchUp;
    c.key = k;
    c.shard = s;
    c.round = sh.version;
    c.bytes = (*offer)->manifest_bytes();
    c.descriptor = (*offer)->descriptor();
    slot.version = sh.version;
    slot.offer = std::move(*offer);
    Status st = SendToPeer(to, c);
    if (!st.ok()) {
      catch_ups_.erase({to, k, s});
      return;  // its link failed: PeerDown follows
    }
    MEMBOX_LOG_WARN(
        "proxy {}: proxy {} still runs round {} of key {} shard {}, which we "
        "finished before a peer died; giving it the result",
        opt_.rank, to, round, k, s);
  }

  // The result of the round this proxy restarted, from a peer that
  // finished it: take it as the round's result.
  void OnCatchUp(uint32_t from, const Message& m) {
    Message done;
    done.type = Type::kCatchUpDone;
    done.key = m.key;
    done.shard = m.shard;
    done.round = m.round;
    auto it = keys_.find(m.key);
    if (it == keys_.end() || m.shard >= it->second.shards.size() ||
        it->second.shards[m.shard].version + 1 != m.round) {
      (void)SendToPeer(from, done);  // not (or no longer) behind
      return;
    }
    Key& key = it->second;
    Shard& sh = key.shards[m.shard];
    std::vector<CopiedShard> copied;
    Status st = [&]() -> Status {
      ASSIGN_OR_RETURN(auto ch, PeerChannel(from));
      ASSIGN_OR_RETURN(StateManifest man,
                       ReadStateManifest(*ch, *device_, m.descriptor, m.bytes,
                                         from, kIoTimeout));
      if (man.shards.size() != 1) {
        return DataLossError("it offers " + std::to_string(man.shards.size()) +
                             " shards, not one");
      }
      const OfferedShard& o = man.shards[0];
      if (o.key != m.key || o.shard != m.shard || o.version != m.round ||
          o.key_bytes != key.bytes || o.shard_bytes != key.shard_bytes ||
          o.bytes != sh.bytes || o.dtype != static_cast<uint8_t>(key.dtype)) {
        return DataLossError("its record is not the shard's next version");
      }
      ASSIGN_OR_RETURN(copied,
                       CopyShards(*ch, {&o}, CopyBuffers(), kIoTimeout));
      copied[0].offer = nullptr;  // `man` goes out of scope
      return Status::Ok();
    }();
    (void)SendToPeer(from, done);
    if (!st.ok()) {
      // The round keeps waiting (and is reported as waiting).
      MEMBOX_LOG_WARN(
          "proxy {}: the result of key {} shard {} round {} from proxy {} "
          "is unusable: {}",
          opt_.rank, m.key, m.shard, m.round - 1, from, st.ToString());
      return;
    }
    sh.ring.Stop();
    sh.version = m.round;
    sh.value = std::move(copied[0].value);
    sh.m1 = std::move(copied[0].m1);
    sh.m2 = std::move(copied[0].m2);
    MEMBOX_LOG_WARN(
        "proxy {}: caught up on key {} shard {}: round {} from proxy {}",
        opt_.rank, m.key, m.shard, m.round - 1, from);
    PublishRound(m.key, m.shard, st);
  }

  // ------------------------------------------------------------ joining

  // A replacement proxy (--join): for every shard, the newest version any
  // peer holds (with replicate, every peer holds every key; a peer that
  // finished a round the others did not have finished is ahead by one),
  // read from one peer only -- among peers holding the same version the
  // shards are spread round-robin -- straight into this proxy's buffers.
  Status Join() {
    if (nproxies_ < 2) {
      return FailedPreconditionError("--join needs peers (--ps-peers)");
    }
    const auto t0 = Clock::now();
    auto failed = [this](uint32_t p, const Status& s) {
      return Status(s.code(), "joining: cannot copy the state of proxy " +
                                  std::to_string(p) + " at " + opt_.peers[p] +
                                  ": " + std::string(s.message()));
    };
    std::map<uint32_t, StateManifest> manifests;
    auto tell_done = [&] {
      for (auto& [p, man] : manifests) {
        auto c = PeerClient(p);
        if (!c.ok()) continue;  // gone: it frees its offer with the link
        Message done;
        done.type = Type::kJoinDone;
        (void)(*c)->Call(static_cast<uint16_t>(Type::kJoinDone),
                         proto::Encode(done), kPeerTimeout);
      }
    };
    for (uint32_t p = 0; p < nproxies_; ++p) {
      if (p == opt_.rank) continue;
      auto man = FetchPeerManifest(p);
      if (!man.ok()) {
        tell_done();
        return failed(p, man.status());
      }
      manifests[p] = std::move(*man);
    }
    copy_timing_.manifests = Clock::now() - t0;
    // Who gives which shard.
    std::map<std::pair<uint64_t, uint32_t>,
             std::vector<std::pair<uint32_t, const OfferedShard*>>>
        offers;
    for (auto& [p, man] : manifests) {
      for (const auto& o : man.shards)
        offers[{o.key, o.shard}].push_back({p, &o});
    }
    std::map<uint32_t, std::vector<const OfferedShard*>> from;
    size_t turn = 0;
    uint64_t state_bytes = 0;
    for (auto& [id, list] : offers) {
      uint64_t newest = 0;
      for (auto& [p, o] : list) newest = std::max(newest, o->version);
      std::erase_if(list, [&](auto& e) { return e.second->version != newest; });
      auto& [p, o] = list[turn++ % list.size()];
      from[p].push_back(o);
      state_bytes += o->bytes * (1 + (o->m1 ? 1 : 0) + (o->m2 ? 1 : 0));
    }
    const auto t_read = Clock::now();
    std::vector<CopiedShard> copied;
    copied.reserve(offers.size());
    Status st;
    for (auto& [p, list] : from) {
      auto ch = PeerChannel(p);
      auto r = ch.ok() ? CopyShards(**ch, list, CopyBuffers(), kIoTimeout)
                       : Result<std::vector<CopiedShard>>(ch.status());
      if (!r.ok()) {
        st = failed(p, r.status());
        break;
      }
      for (auto& c : *r) copied.push_back(std::move(c));
    }
    copy_timing_.read = Clock::now() - t_read;
    tell_done();
    RETURN_IF_ERROR(st);
    const auto t_store = Clock::now();
    RETURN_IF_ERROR(InstallCopied(copied, "the peers' state"));
    auto sec = [](Clock::duration d) {
      return std::chrono::duration<double>(d).count();
    };
    MEMBOX_LOG_WARN(
        "proxy {} joined: copied {} keys ({} shards, {} bytes of state) from "
        "{} peer(s) in {:.3f} s (the peers offering it {:.3f} s, reading "
        "{:.3f} s, storing {:.3f} s)",
        opt_.rank, keys_.size(), copied.size(), state_bytes, from.size(),
        sec(Clock::now() - t0), sec(copy_timing_.manifests),
        sec(copy_timing_.read), sec(Clock::now() - t_store));
    return Status::Ok();
  }

  // Asks peer `p` for its state (kJoin) and reads the manifest it offers.
  Result<StateManifest> FetchPeerManifest(uint32_t p) {
    ASSIGN_OR_RETURN(service::Client * c, PeerClient(p));
    Message q;
    q.type = Type::kJoin;
    q.rank = opt_.rank;
    ASSIGN_OR_RETURN(auto body, c->Call(static_cast<uint16_t>(Type::kJoin),
                                        proto::Encode(q), kPeerTimeout));
    ASSIGN_OR_RETURN(Message r,
                     proto::Decode(static_cast<uint16_t>(Type::kReply), body));
    ASSIGN_OR_RETURN(auto ch, PeerChannel(p));
    return ReadStateManifest(
        *ch, *device_,
        std::span<const uint8_t>(
            reinterpret_cast<const uint8_t*>(r.text.data()), r.text.size()),
        r.version, p, kIoTimeout);
  }

  // A joining peer asks for this proxy's state (kJoin): every shard in
  // checkpoint format in a region it reads, kept until kJoinDone or until
  // it disconnects.
  void OnJoinRequest(uint64_t conn, Conn& c, const Message& m) {
    if (m.type == Type::kJoinDone) {
      join_snapshots_.erase(conn);
      return Reply(conn, m.type, m.id, Status::Ok());
    }
    if (m.rank != c.rank) {
      return Reply(conn, m.type, m.id,
                   InvalidArgumentError("a proxy joins as its own rank"));
    }
    std::vector<StateOffer::Item> items;
    for (auto& [k, key] : keys_) {
      for (uint32_t i = 0; i < key.shards.size(); ++i) {
        if (!key.shards[i].value) continue;
        items.push_back(
            {k, i, key.dtype, key.bytes, key.shard_bytes, &key.shards[i]});
      }
    }
    auto offer = StateOffer::Make(*device_, opt_.rank, items);
    if (!offer.ok()) return Reply(conn, m.type, m.id, offer.status());
    const uint64_t n = (*offer)->manifest_bytes();
    auto d = (*offer)->descriptor();
    MEMBOX_LOG_WARN(
        "proxy {} at {} is joining (replacing the one that was there): "
        "offering it {} shards ({} bytes of state)",
        c.rank, opt_.peers[c.rank], (*offer)->shards(),
        (*offer)->state_bytes());
    join_snapshots_[conn] = std::move(*offer);
    Reply(conn, m.type, m.id, Status::Ok(), n, std::string(d.begin(), d.end()));
  }

  // ------------------------------------------------------------ peers

  // The link to peer proxy `rank`, connected on first use (retrying while
  // the peer starts up). A link that was up and failed fails fast.
  Result<service::Client*> PeerClient(uint32_t rank) {
    auto it = peer_out_.find(rank);
    if (it != peer_out_.end()) {
      Status h = it->second->health();
      if (h.ok()) return it->second.get();
      return UnavailableError("proxy " + std::to_string(rank) + " at " +
                              opt_.peers[rank] + " is down: " + h.ToString());
    }
    auto deadline = Clock::now() + kPeerTimeout;
    Status last;
    while (Clock::now() < deadline && running_) {
      service::ClientOptions co;
      co.node_kind = "proxy " + std::to_string(rank);
      const uint64_t incarnation = peer_incarnation_[rank];
      co.on_failure = [this, rank, incarnation](const Status& s) {
        // PeerDown reports it, at a level that fits the moment.
        MEMBOX_LOG_DEBUG("link to proxy {} failed: {}", rank, s.ToString());
        Post([this, rank, incarnation, s] {
          if (peer_incarnation_[rank] == incarnation) PeerDown(rank, s);
        });
      };
      auto c = service::Client::Connect(*device_, opt_.peers[rank], co);
      if (c.ok()) {
        // Do not wait for the hello's answer here: the peer may be doing the
        // same towards us from its event loop. Messages on a channel are
        // ordered, so the peer sees the hello before anything else; a
        // refusal arrives later and is logged.
        Message h;
        h.type = Type::kPeerHello;
        h.name = device_->options().name;
        h.rank = opt_.rank;
        h.world = nonce_;
        h.endpoint = opt_.peers[opt_.rank];
        (*c)->Send(static_cast<uint16_t>(Type::kPeerHello), proto::Encode(h),
                   [rank](const Status& s, std::span<const uint8_t>) {
                     if (!s.ok()) {
                       MEMBOX_LOG_ERROR("proxy {} refused us: {}", rank,
                                        s.ToString());
                     }
                   });
        service::Client* raw = c->get();
        peer_out_[rank] = std::move(*c);
        return raw;
      }
      last = c.status();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return UnavailableError("cannot reach proxy " + std::to_string(rank) +
                            " at " + opt_.peers[rank] + ": " + last.ToString());
  }

  Result<std::shared_ptr<Channel>> PeerChannel(uint32_t rank) {
    ASSIGN_OR_RETURN(service::Client * c, PeerClient(rank));
    return c->channel_ptr();
  }

  // Ring notices (kReady, kDone) travel as service notices.
  Status SendToPeer(uint32_t rank, const Message& m) {
    ASSIGN_OR_RETURN(service::Client * c, PeerClient(rank));
    return c->Notify(static_cast<uint16_t>(m.type), proto::Encode(m));
  }

  // ------------------------------------------------------------ checkpoints

  void StartCheckpoint(const std::string& name,
                       std::function<void(Status)> done) {
    if (opt_.checkpoint_dir.empty()) {
      return done(FailedPreconditionError(
          "this proxy has no checkpoint directory (--checkpoint-dir)"));
    }
    // Snapshot: share the current buffers; later updates copy (storage).
    auto snap = std::make_shared<std::vector<ShardStorage::Snapshot>>();
    for (auto& [k, key] : keys_) {
      for (uint32_t i = 0; i < key.shards.size(); ++i) {
        snap->push_back(ShardStorage::Snap(k, i, key.dtype, key.bytes,
                                           key.shard_bytes, key.shards[i]));
      }
    }
    CheckpointHeader h;
    h.proxy_rank = opt_.rank;
    h.proxies = nproxies_;
    h.mode = static_cast<uint8_t>(mode_);
    h.optimizer = 0;  // optimizers are per key now (format: unused)
    std::string path = CheckpointPath(name);
    MutexLock l(&writers_mu_);
    writers_.emplace_back([this, snap, h, path, done = std::move(done)] {
      std::vector<CheckpointShard> shards;
      for (auto& sn : *snap) shards.push_back(sn.record);
      Status s = WriteCheckpoint(path, h, shards);
      if (s.ok()) {
        checkpoints_.fetch_add(1);
        MEMBOX_LOG_INFO("checkpoint written: {} ({} shards)", path,
                        shards.size());
      } else {
        MEMBOX_LOG_ERROR("checkpoint {} failed: {}", path, s.ToString());
      }
      // Release the snapshot's buffers on the event thread, where the
      // copy-on-write checks read the use counts.
      Post([snap] { snap->clear(); });
      done(s);
    });
  }

  // Each proxy writes its own file: <dir>/proxy-<rank>-<name>.
  std::string CheckpointPath(const std::string& name) const {
    return (std::filesystem::path(opt_.checkpoint_dir) /
            ("proxy-" + std::to_string(opt_.rank) + "-" + name))
        .string();
  }

  Status Restore() {
    std::string path = CheckpointPath(opt_.restore_name);
    CheckpointHeader h;
    std::vector<CheckpointShard> shards;
    RETURN_IF_ERROR(ReadCheckpoint(path, &h, &shards));
    if (h.proxies != nproxies_ || h.proxy_rank != opt_.rank) {
      return FailedPreconditionError(
          path + " was written by proxy " + std::to_string(h.proxy_rank) +
          " of " + std::to_string(h.proxies) + ", not by this one");
    }
    RETURN_IF_ERROR(LoadRecords(shards, path));
    MEMBOX_LOG_INFO("restored {} keys ({} shards) from {}", keys_.size(),
                    shards.size(), path);
    return Status::Ok();
  }

  ProxyOptions opt_;
  uint32_t nproxies_ = 1;
  std::unique_ptr<service::Server> server_;
  transport::Device* device_ = nullptr;  // server_'s
  std::string endpoint_;
  std::unique_ptr<SyncCores> sync_;
  std::unique_ptr<ShardStorage> storage_;  // after sync_: it uses the cores
  AdmissionScheduler sched_;
  std::atomic<bool> running_{false};
  mutable Mutex waits_mu_;
  std::string waits_ MEMBOX_GUARDED_BY(waits_mu_);  // ReportWaits' lines
  Mutex writers_mu_;
  std::vector<std::thread> writers_ MEMBOX_GUARDED_BY(writers_mu_);

  // Event-thread state.
  std::map<uint64_t, Conn> conns_;
  std::map<uint32_t, std::unique_ptr<service::Client>> peer_out_;
  std::map<std::pair<uint32_t, uint64_t>, std::shared_ptr<RemoteMemRegion>>
      peer_regions_;
  std::map<uint64_t, Key> keys_;
  std::vector<Message> early_notices_;
  // Our state as given to joining peers, by their connection (OnJoinRequest).
  std::map<uint64_t, std::unique_ptr<StateOffer>> join_snapshots_;
  // Where a join's copying went, for its log line.
  struct CopyTiming {
    Clock::duration manifests{}, read{};
  } copy_timing_;
  // Round results given to lagging peers (kCatchUp), by (peer, key,
  // shard), until their kCatchUpDone or until the peer is replaced.
  struct CatchUp {
    uint64_t version = 0;
    std::unique_ptr<StateOffer> offer;
  };
  std::map<std::tuple<uint32_t, uint64_t, uint32_t>, CatchUp> catch_ups_;
  std::unique_ptr<MemRegion> staging_;
  std::unique_ptr<MemRegion> probe_;
  // Result writes and flushes in flight (WriteThenReply); done ones are
  // dropped as new ones start.
  std::deque<transport::OpHandle> inflight_;
  uint32_t world_ = 0;
  bool configured_ = false;
  uint32_t staleness_ = 0;
  proto::Mode mode_ = proto::Mode::kSum;
  std::string dead_worker_;
  // Failover (replicate): peers down, since when; peers whose notices are
  // dropped until their kResume; each peer's current incoming link,
  // incarnation nonce and the count of its incarnations seen (outgoing
  // links of an older one are ignored when they fail).
  std::set<uint32_t> peers_down_;
  Clock::time_point down_since_{};
  std::set<uint32_t> awaiting_resume_;
  std::map<uint32_t, uint64_t> peer_conn_;
  std::map<uint32_t, uint32_t> peer_nonce_;
  std::map<uint32_t, uint64_t> peer_incarnation_;
  const uint32_t nonce_ = std::random_device{}();

  std::atomic<uint64_t> n_keys_{0}, n_shards_{0}, n_clients_{0}, rounds_{0},
      bytes_reduced_{0}, ring_steps_{0}, rejected_{0}, checkpoints_{0},
      result_bytes_{0}, waiting_rounds_{0}, failovers_{0}, peers_down_count_{0},
      stored_bytes_in_{0};
};

}  // namespace

Result<std::unique_ptr<Proxy>> Proxy::Start(const ProxyOptions& options) {
  auto p = std::make_unique<ProxyImpl>(options);
  RETURN_IF_ERROR(p->Init());
  return std::unique_ptr<Proxy>(std::move(p));
}

}  // namespace membox::ps
