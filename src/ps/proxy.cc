// The parameter proxy: construction, service plumbing, dispatch, hang
// reports and stats (src/ps/proxy_impl.h says how the files divide it).
#include "src/ps/proxy_impl.h"

namespace membox::ps::proxy_internal {

Status ProxyImpl::Init() {
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
  so.device.admit = opt_.admit;
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
  // A replacement copies its state while it serves (Join).
  server_->Post([this] { StartJoinCopy(); });
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

ProxyStats ProxyImpl::Stats() const {
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
  s.reads_held = reads_held_.load(std::memory_order_relaxed);
  s.result_bytes = result_bytes_.load(std::memory_order_relaxed);
  s.backups_acked = backups_acked_.load(std::memory_order_relaxed);
  s.backup_bytes_in = backup_bytes_in_.load(std::memory_order_relaxed);
  s.backup_steps = backup_steps_.load(std::memory_order_relaxed);
  s.version_notices = version_notices_in_.load(std::memory_order_relaxed);
  s.answered_early = answered_early_.load(std::memory_order_relaxed);
  s.backups_pending = backups_pending_.load(std::memory_order_relaxed);
  s.shards_copying = shards_copying_.load(std::memory_order_relaxed);
  s.join_state_bytes = join_state_bytes_.load(std::memory_order_relaxed);
  s.join_versions_only = join_versions_only_.load(std::memory_order_relaxed);
  s.redos_skipped = redos_skipped_.load(std::memory_order_relaxed);
  return s;
}

std::string ProxyImpl::StatusText() const {
  ProxyStats s = Stats();
  std::ostringstream o;
  o << "proxy " << opt_.rank << " of " << nproxies_ << " at " << endpoint()
    << "\nkeys " << s.keys << "\nshards " << s.shards << "\nstored_bytes "
    << s.stored_bytes << "\nclients " << s.clients << "\nrounds_completed "
    << s.rounds_completed << "\nbytes_reduced " << s.bytes_reduced
    << "\nring_steps " << s.ring_steps << "\nqueued_pushes " << s.queued_pushes
    << "\nrejected " << s.rejected << "\ncheckpoints " << s.checkpoints
    << "\nreads_held " << s.reads_held << "\nreplicate "
    << (opt_.replicate ? "on" : "off") << "\nfailovers " << failovers_.load()
    << "\nbackups_acked " << s.backups_acked << "\nbackup_bytes_in "
    << s.backup_bytes_in << "\nbackup_steps " << s.backup_steps
    << "\nversion_notices " << s.version_notices << "\nanswered_early "
    << s.answered_early << "\nbackups_pending " << s.backups_pending
    << "\nshards_copying " << s.shards_copying << "\njoin_state_bytes "
    << s.join_state_bytes << "\njoin_versions_only " << s.join_versions_only
    << "\nredos_skipped " << s.redos_skipped << "\n";
  MutexLock l(&waits_mu_);
  o << waits_;
  return o.str();
}

void ProxyImpl::Metrics(MetricsWriter& w) const {
  const ProxyStats s = Stats();
  w.Counter("membox_ps_rounds_total",
            "Shard rounds completed (rate: rounds/s).", s.rounds_completed);
  w.Counter("membox_ps_pushed_bytes_total", "Bytes of pushes summed.",
            s.bytes_reduced);
  w.Counter("membox_ps_result_bytes_total",
            "Bytes of results and pulls written to workers.", s.result_bytes);
  w.Counter("membox_ps_stored_bytes_total",
            "Bytes workers wrote into stored keys (Store).",
            stored_bytes_in_.load(std::memory_order_relaxed));
  w.Counter("membox_ps_backups_acked_total",
            "Rounds of shards owned here copied by their backup node.",
            s.backups_acked);
  w.Counter("membox_ps_backup_bytes_in_total",
            "Bytes of state copied here as other shards' backup.",
            s.backup_bytes_in);
  w.Counter("membox_ps_version_notices_total",
            "Rounds of other shards backed up here by their version alone "
            "(every worker held its push).",
            s.version_notices);
  w.Counter("membox_ps_answered_early_total",
            "Rounds answered before their backup had them (every push held; "
            "the next round waits for it).",
            s.answered_early);
  w.Counter("membox_ps_backup_steps_total",
            "Rounds of other shards backed up here by repeating their step.",
            s.backup_steps);
  w.Gauge("membox_ps_backups_pending",
          "Shards applied here waiting for their backup's copy.",
          s.backups_pending);
  w.Gauge("membox_ps_shards_copying",
          "A replacement's shards still being copied from its peers.",
          s.shards_copying);
  w.Gauge("membox_ps_join_state_bytes",
          "A replacement's bytes of state copied from its peers.",
          s.join_state_bytes);
  w.Gauge("membox_ps_join_versions_only",
          "A replacement's shards taken as their version alone.",
          s.join_versions_only);
  w.Counter("membox_ps_redos_skipped_total",
            "Reopened rounds every worker had the result of, not summed "
            "again.",
            s.redos_skipped);
  w.Counter("membox_ps_ring_steps_total", "Ring steps with peer proxies.",
            s.ring_steps);
  w.Counter("membox_ps_rejected_total", "Requests refused.", s.rejected);
  w.Counter("membox_ps_checkpoints_total", "Checkpoints written.",
            s.checkpoints);
  w.Counter("membox_ps_reads_held_total",
            "Push reads that waited for their key's read window (a worker "
            "ahead of the others).",
            s.reads_held);
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
  w.Gauge("membox_ps_waiting_rounds",
          "Rounds waiting longer than --hang-report-s (see the log or status).",
          waiting_rounds_.load(std::memory_order_relaxed));
  if (server_) service::WriteServerMetrics(*server_, "proxy", w);
}

Status ProxyImpl::Checkpoint(const std::string& name) {
  std::promise<Status> p;
  auto f = p.get_future();
  if (!server_->Post([this, name, &p] {
        StartCheckpoint(name, [&p](Status s) { p.set_value(s); });
      })) {
    return UnavailableError("the proxy is stopping");
  }
  return f.get();
}

void ProxyImpl::Stop() {
  // (The copier threads see running_ false and stop after their batch;
  // join_copy_ is the event loop's until the loop has ended, below.)
  if (!server_ || !running_.exchange(false)) return;
  // Ends the event loop (posted tasks still run) and closes every
  // connection; the device stays until server_ goes, after the memory
  // registered with it.
  server_->Stop();
  checkpoint_writer_.Stop();
  peer_prober_.Stop();
  for (std::thread& t : join_copiers_) t.join();
  join_copiers_.clear();
  join_copy_.reset();
  copy_waiters_.clear();
  copy_notices_.clear();
  peer_regions_.clear();
  join_snapshots_.clear();
  catch_ups_.clear();
  peer_out_.clear();    // closes the links to peers
  inflight_.clear();    // closed channels complete them
  ring_reads_.clear();  // their reads are done (above): buffers go
  ring_staging_.clear();
  conns_.clear();
  keys_.clear();
  staging_.reset();
  probe_.reset();
  // Recycled buffers go before the device they were registered with.
  storage_->CloseRecycling();
  sync_.reset();
  server_.reset();
  MEMBOX_LOG_INFO("parameter proxy stopped");
}

Status ProxyImpl::OnStart(transport::Device& device) {
  device_ = &device;
  return Status::Ok();
}

void ProxyImpl::OnConnect(service::ConnectionId conn, const std::string&) {
  conns_[conn].channel = server_->channel(conn);
}

void ProxyImpl::Reply(uint64_t conn, Type method, uint64_t id, const Status& s,
                      uint64_t version, std::string text) {
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

Result<MemRegion*> ProxyImpl::Staging(uint64_t bytes) {
  if (!staging_ || staging_->size() < bytes) {
    staging_.reset();
    ASSIGN_OR_RETURN(staging_, device_->AllocateMemRegion(
                                   std::max<uint64_t>(bytes, 1 << 20)));
  }
  return staging_.get();
}

Result<const RemoteMemRegion*> ProxyImpl::WorkerRange(const Conn& c,
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

Result<const uint8_t*> ProxyImpl::ReadWorker(Conn& c, uint64_t region,
                                             uint64_t offset, uint64_t len,
                                             uint8_t* into,
                                             const MemRegion& into_region) {
  ASSIGN_OR_RETURN(const RemoteMemRegion* rr,
                   WorkerRange(c, region, offset, len, "input"));
  if (rr->mapped()) return static_cast<const uint8_t*>(rr->mapped()) + offset;
  ASSIGN_OR_RETURN(auto h, c.channel->Read(into, into_region,
                                           rr->address() + offset, *rr, len));
  RETURN_IF_ERROR(h.Wait(kIoTimeout));
  return into;
}

Status ProxyImpl::WriteWorker(Conn& c, uint64_t region, uint64_t offset,
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
  ASSIGN_OR_RETURN(auto h, c.channel->Write(src, src_region,
                                            rr->address() + offset, *rr, len));
  RETURN_IF_ERROR(h.Wait(kIoTimeout));
  ASSIGN_OR_RETURN(auto f, c.channel->Flush());
  return f.Wait(kIoTimeout);
}

void ProxyImpl::WriteThenReply(uint64_t conn, Type method, uint64_t id,
                               uint64_t region, uint64_t offset,
                               std::shared_ptr<MemRegion> src, uint64_t len,
                               uint64_t version) {
  Conn& c = conns_[conn];
  auto rr = WorkerRange(c, region, offset, len, "output");
  if (!rr.ok()) return Reply(conn, method, id, rr.status(), version);
  result_bytes_.fetch_add(len, std::memory_order_relaxed);
  if ((*rr)->mapped() || !c.channel) {
    Status s = WriteWorker(c, region, offset,
                           static_cast<const uint8_t*>(src->data()), len, *src);
    return Reply(conn, method, id, s, version);
  }
  auto w = c.channel->Write(src->data(), *src, (*rr)->address() + offset, **rr,
                            len, [src](const Status&) {});
  if (!w.ok()) return Reply(conn, method, id, w.status(), version);
  Track(std::move(*w));
  auto f = c.channel->Flush([this, conn, method, id, version](const Status& s) {
    Post([this, conn, method, id, s, version] {
      Reply(conn, method, id, s, version);
    });
  });
  if (!f.ok()) return Reply(conn, method, id, f.status(), version);
  Track(std::move(*f));
}

void ProxyImpl::Track(transport::OpHandle h) {
  while (!inflight_.empty() && inflight_.front().done()) {
    inflight_.pop_front();
  }
  inflight_.push_back(std::move(h));
}

std::string ProxyImpl::ExplainShard(uint64_t k, uint32_t s) const {
  const Key& key = keys_.at(k);
  const Shard& sh = key.shards[s];
  std::string what;
  if (key.awaiting_init) {  // its pushes are not admitted yet
    what = "rank 0 has not declared it (its initial value wins)";
  } else {
    std::vector<RoundWorker> workers;
    const RoundWait wait = CheckRound(RoundOf(k, s, &workers));
    std::string detail;
    if (wait.blocker == RoundWait::Blocker::kAwaitingBackup) {
      const uint32_t b = BackupOf(k, s);
      detail = "applied here, waiting for the copy on its backup proxy " +
               std::to_string(b) +
               (failover_.down(b) ? " (down: waits for its replacement)" : "");
    } else if (wait.blocker == RoundWait::Blocker::kReducing) {
      detail = sh.ring.Waiting(RingFor(k, s));
    }
    what = DescribeWait(wait, detail);
  }
  return "key " + std::to_string(k) + " shard " + std::to_string(s) +
         " round " + std::to_string(sh.version) + ": " + what;
}

void ProxyImpl::ReportWaits() {
  CheckFailoverDeadline();
  RingReadsOverdue();
  CheckSuspectRings();
  const auto now = Clock::now();
  const auto limit = opt_.hang_report;
  std::string text;
  for (uint32_t r : failover_.down()) {
    text += fmt::format(
        "down proxy {} at {} for {:.1f} s: rounds wait for its "
        "replacement\n",
        r, opt_.peers[r],
        std::chrono::duration<double>(now - failover_.down_since()).count());
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

void ProxyImpl::OnRequest(const service::Request& r) {
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
  const bool ring =
      m->type == Type::kReady || m->type == Type::kDone ||
      m->type == Type::kResume || m->type == Type::kCatchUp ||
      m->type == Type::kCatchUpDone || m->type == Type::kBackup ||
      m->type == Type::kBackupDone || m->type == Type::kRingAbort ||
      m->type == Type::kBackupStep || m->type == Type::kBackupWhole ||
      m->type == Type::kBackupVersion;
  if (r.notice != ring) {
    rejected_.fetch_add(1);
    MEMBOX_LOG_WARN("connection {}: {} sent as a {}", conn,
                    proto::TypeName(m->type), r.notice ? "notice" : "request");
    return server_->Reply(
        r, InvalidArgumentError(std::string(proto::TypeName(m->type)) +
                                " must be sent as a notice"));
  }
  if (c.role == Conn::Role::kUnknown && m->type != Type::kHello &&
      m->type != Type::kPeerHello && m->type != Type::kRejoin &&
      m->type != Type::kClaim && m->type != Type::kWhere) {
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
    case Type::kRingAbort:
      if (c.role != Conn::Role::kPeer) break;
      if (!PeerCurrent(c.rank, conn)) return;
      return OnRingAbort(c.rank, *m);
    case Type::kCatchUp:
      if (c.role != Conn::Role::kPeer) break;
      if (!PeerCurrent(c.rank, conn)) return;
      return OnCatchUp(c.rank, *m);
    case Type::kCatchUpDone:
      if (c.role != Conn::Role::kPeer) break;
      catch_ups_.erase({c.rank, m->key, m->shard});
      return;
    case Type::kBackup:
    case Type::kBackupStep:
    case Type::kBackupWhole:
    case Type::kBackupVersion:
    case Type::kBackupDone: {
      if (c.role != Conn::Role::kPeer) break;
      // Not tied to a ring attempt (kResume): only an incarnation that is
      // gone is ignored.
      if (!failover_.IsLink(c.rank, conn)) return;
      if (m->type == Type::kBackup) return OnBackup(c.rank, *m);
      if (m->type == Type::kBackupStep) return OnBackupStep(c.rank, *m);
      if (m->type == Type::kBackupWhole) return OnBackupWhole(c.rank, *m);
      if (m->type == Type::kBackupVersion) return OnBackupVersion(c.rank, *m);
      return OnBackupDone(c.rank, *m);
    }
    case Type::kJoin:
    case Type::kJoinDone:
      if (c.role != Conn::Role::kPeer) break;
      return OnJoinRequest(conn, c, *m);
    case Type::kClaim:
      if (c.role != Conn::Role::kUnknown) break;  // a standby is no peer
      return OnClaim(conn, c, *m);
    case Type::kWhere:  // addresses: for workers, and standbys before hello
      return Where(conn, *m);
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

bool ProxyImpl::FromNode(uint64_t conn, const Conn& c, const Message& m,
                         const char* what) {
  const Principal& who = c.channel ? c.channel->principal() : Principal();
  if (who.may(kRightNode)) return true;
  Reply(conn, m.type, m.id,
        PermissionDeniedError(std::string(what) + " from " + who.label() +
                              ", which has no node right"));
  server_->Close(conn, PermissionDeniedError("not a node"));
  return false;
}

void ProxyImpl::OnHello(uint64_t conn, Conn& c, const Message& m) {
  // The channel proved the secret in the transport's handshake.
  if (c.role != Conn::Role::kUnknown) {
    Reply(conn, m.type, m.id, FailedPreconditionError("already said hello"));
    return;
  }
  const Principal& who = c.channel ? c.channel->principal() : Principal();
  if (m.type == Type::kPeerHello) {
    // A worker's credential cannot say where a peer is, make this proxy
    // dial out, or take over a peer connection.
    if (!FromNode(conn, c, m, "peer hello")) return;
    if (m.rank >= nproxies_ || m.rank == opt_.rank) {
      Reply(conn, m.type, m.id, InvalidArgumentError("bad peer proxy rank"));
      return;
    }
    // One replacement per place: a standby that claimed it goes first.
    if (Status may = failover_.MayReplace(
            m.rank, m.endpoint.empty() ? opt_.peers[m.rank] : m.endpoint,
            Clock::now());
        !may.ok()) {
      MEMBOX_LOG_WARN("proxy {}: refused a replacement of proxy {}: {}",
                      opt_.rank, m.rank, may.ToString());
      Reply(conn, m.type, m.id, may);
      server_->Close(conn, may);
      return;
    }
    c.role = Conn::Role::kPeer;
    c.rank = m.rank;
    server_->Establish(conn);
    Reply(conn, m.type, m.id, Status::Ok());
    return PeerHello(m.rank, conn, m.world, m.endpoint);
  }
  if (!who.may(kRightWorker) && !who.may(kRightAdmin)) {
    Reply(conn, m.type, m.id,
          PermissionDeniedError(who.label() + " has no worker right"));
    return;
  }
  // A proxy serves one principal's job: its parameters and optimizer state
  // are that principal's. The first worker's principal owns the job for the
  // proxy's lifetime (the stored state outlives its connections); the
  // cluster principal may always connect.
  if (!who.cluster && !job_owner_.empty() && job_owner_ != who.name) {
    Reply(conn, m.type, m.id,
          PermissionDeniedError("this parameter proxy serves principal " +
                                job_owner_ + "'s job, not " + who.name + "'s"));
    return;
  }
  if (m.world == 0) {  // an observer: not part of the job
    c.role = Conn::Role::kObserver;
    c.name = m.name;
    server_->Establish(conn);
    Reply(conn, m.type, m.id, Status::Ok());
    return;
  }
  if (world_ != 0 && m.world != world_) {
    // Another job is still here (ABORTED, as for a rank still connected: a
    // worker set restarted with another size, such as torchft's next
    // quorum, retries until the previous job's connections have closed).
    Reply(conn, m.type, m.id,
          AbortedError("world size " + std::to_string(m.world) +
                       " differs from the job's " + std::to_string(world_) +
                       " (that job's workers are still connected)"));
    return;
  }
  if (world_ != 0 && m.job != job_) {
    // The workers of the job before are still connected (a process that
    // destroyed its group and made another may say hello before its peers'
    // old connections have closed). Admitting it would let their closing
    // end the new job, and the new one would skip the job's end (ABORTED:
    // the worker retries until they have gone).
    Reply(conn, m.type, m.id,
          AbortedError("job '" + m.job + "' waits: the workers of job '" +
                       job_ + "' are still connected"));
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
  job_ = m.job;
  if (job_owner_.empty()) {
    job_owner_ = who.name;
    // Everything the job makes this node hold (values and optimizer state)
    // counts against its principal's quota.
    if (!who.cluster) {
      const uint64_t quota = who.QuotaOf(opt_.max_bytes, opt_.max_bytes);
      storage_->LimitTo(quota, "the quota of principal " + who.name);
      job_disk_quota_ = quota;
    }
  }
  server_->Establish(conn);
  c.role = Conn::Role::kClient;
  c.rank = m.rank;
  c.replaying = m.type == Type::kRejoin;
  c.rejoined = m.type == Type::kRejoin;
  c.name = m.name;
  n_clients_.fetch_add(1);
  MEMBOX_LOG_DEBUG("worker {} ({}) joined, world {}", m.rank, m.name, m.world);
  // A replicating proxy says so: the worker then waits for a dead
  // proxy's replacement instead of failing (ParamClientOptions::failover).
  // The reply's version says which node of how many this is, so that a
  // worker given another list of nodes than the job's stops with a clear
  // error instead of waiting for rounds the others never join.
  Reply(conn, m.type, m.id, Status::Ok(),
        proto::HelloPlace(opt_.rank, nproxies_),
        opt_.replicate ? "replicate" : "");
  MaybeStartAll();
}

void ProxyImpl::OnDisconnect(service::ConnectionId conn, const Status& why) {
  join_snapshots_.erase(conn);
  auto it = conns_.find(conn);
  if (it == conns_.end()) return;
  if (it->second.role == Conn::Role::kClient) {
    n_clients_.fetch_sub(1);
    std::string who = "worker rank " + std::to_string(it->second.rank) + " (" +
                      it->second.name + ") disconnected: " + why.ToString();
    MEMBOX_LOG_INFO("{}", who);
    sched_.Remove(conn);
    // Workers waiting in a combining region for this one fail naming it.
    for (auto& [k, key] : keys_) {
      if (key.combine) AbortCombineRegion(key.combine->data(), it->second.rank);
    }
    conns_.erase(it);
    if (mode_ != proto::Mode::kAsync) FailPendingRounds(who);
  } else {
    bool peer = it->second.role == Conn::Role::kPeer;
    uint32_t rank = it->second.rank;
    conns_.erase(it);
    // A replaced incarnation's link closing late is old news.
    if (peer && failover_.IsLink(rank, conn)) {
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
    FoldCombined();
    world_ = 0;
    job_.clear();
    // The next job configures its own mode (a job that left the nodes
    // averaging must not make the next one's sums averages).
    configured_ = false;
    mode_ = proto::Mode::kSum;
    staleness_ = 0;
    for (auto& [k, key] : keys_) {
      // A job that failed mid-round may leave a key's shards one round
      // apart (some completed it). A key without an optimizer holds only
      // that round's sum, which the next job does not need: the shards
      // behind skip to the newest version, so it counts one round per key.
      // A key with one holds the model: the restarted workers redo the
      // round (CompletedRounds, RetriedRound).
      uint64_t lo = UINT64_MAX, hi = 0;
      for (const auto& sh : key.shards) {
        lo = std::min(lo, sh.version);
        hi = std::max(hi, sh.version);
      }
      if (!key.shards.empty() && lo != hi && !key.striped &&
          key.opt.kind == proto::Optimizer::kNone) {
        MEMBOX_LOG_WARN(
            "key {}: the job ended with its shards at versions {}..{}; "
            "the shards behind skip to {} (that round's sum is gone)",
            k, lo, hi, hi);
        for (auto& sh : key.shards) sh.version = hi;
      }
      key.awaiting_init = false;
      key.declared = false;  // the next job's first declaration decides
      key.holders.clear();
      key.skip_logged = false;
      for (auto& sh : key.shards) {
        sh.pushes.clear();
        sh.pulls.clear();
        sh.reducing = false;
        sh.ring.Reset();
        sh.first_push = {};
        sh.untouched_by_job = true;
        sh.aborted_round = UINT64_MAX;
        sh.aborted_why = Status::Ok();
        if (sh.awaiting_backup) {
          // Nobody waits for that answer any more; the backup gets the
          // shard whole with the next round (an offer is the full state).
          sh.awaiting_backup = false;
          sh.backup_synced = false;
          sh.backup_keep.clear();
          backups_pending_.fetch_sub(1);
        }
        sh.answered_early = false;
      }
    }
    if (const uint64_t freed = FreeScratch(); freed > 0) {
      MEMBOX_LOG_INFO("the job ended: freed {} bytes of its scratch keys",
                      freed);
    }
    // An idle node keeps no recycled buffers.
    storage_->TrimRecycled();
  }
}

uint64_t ProxyImpl::FreeScratch() {
  const uint64_t before = storage_->stored_bytes();
  for (auto it = keys_.begin(); it != keys_.end();) {
    const Key& key = it->second;
    const bool copying =
        std::any_of(key.shards.begin(), key.shards.end(),
                    [](const Shard& sh) { return sh.copying; });
    if (!key.scratch || copying) {
      ++it;
      continue;
    }
    it = EraseKey(it);
  }
  // What is still held elsewhere (a result write in flight) goes when
  // that lets go.
  return before - std::min(before, storage_->stored_bytes());
}

std::map<uint64_t, Key>::iterator ProxyImpl::EraseKey(
    std::map<uint64_t, Key>::iterator it) {
  const uint64_t k = it->first;
  n_shards_.fetch_sub(it->second.shards.size());
  n_keys_.fetch_sub(1);
  // Ring notices parked for a key that is gone belong to its last round.
  std::erase_if(early_notices_, [&](const Message& e) { return e.key == k; });
  return keys_.erase(it);
}

bool ProxyImpl::Quiet(uint64_t k, const Key& key) const {
  if (key.combine || !join_snapshots_.empty()) return false;
  for (const Shard& sh : key.shards) {
    if (!sh.pushes.empty() || !sh.pulls.empty() || sh.reducing ||
        sh.ring.running() || sh.copying || sh.awaiting_backup) {
      return false;
    }
  }
  for (const auto& [id, c] : conns_) {
    for (const auto& w : c.reads_waiting) {
      if (w.key == k) return false;
    }
    if (const auto* q = sched_.queue(id)) {
      for (const Message& m : *q) {
        if (m.key == k) return false;
      }
    }
  }
  for (const auto& t : sched_.line()) {
    if (t.key == k) return false;
  }
  for (const auto& [id, r] : ring_reads_) {
    if (r.key == k) return false;
  }
  for (const auto& [who, cu] : catch_ups_) {
    if (std::get<1>(who) == k) return false;
  }
  for (const auto& [where, notices] : copy_notices_) {
    if (where.first == k) return false;
  }
  return true;
}

Result<std::string> ProxyImpl::Free(const Conn& c, const Message& m) {
  for (uint64_t k : m.keys) {
    auto it = keys_.find(k);
    if (it != keys_.end() && !it->second.scratch) {
      return FailedPreconditionError(
          "key " + std::to_string(k) +
          " is not the job's scratch: only scratch is freed before the job "
          "ends");
    }
  }
  size_t freed = 0, waiting = 0;
  const uint64_t before = storage_->stored_bytes();
  for (uint64_t k : m.keys) {
    // A key this node never saw, or one this worker does not hold (never
    // declared it, or let it go already): nothing to do.
    auto it = keys_.find(k);
    if (it == keys_.end() || it->second.holders.erase(c.rank) == 0 ||
        !it->second.holders.empty()) {
      continue;
    }
    if (Quiet(k, it->second)) {
      EraseKey(it);
      ++freed;
    } else {
      ++waiting;  // freed when the job ends (FreeScratch)
    }
  }
  if (freed > 0 || waiting > 0) {
    MEMBOX_LOG_INFO(
        "worker {} let scratch keys go: {} freed ({} bytes now), {} busy "
        "(freed when the job ends)",
        c.rank, freed, before - std::min(before, storage_->stored_bytes()),
        waiting);
  }
  return "freed " + std::to_string(freed) + " waiting " +
         std::to_string(waiting);
}

}  // namespace membox::ps::proxy_internal

namespace membox::ps {

Result<std::unique_ptr<Proxy>> Proxy::Start(const ProxyOptions& options) {
  return MakeInitialized<Proxy, proxy_internal::ProxyImpl>(options);
}

}  // namespace membox::ps
