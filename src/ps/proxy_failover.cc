// The parameter proxy: peer links, failover, joining and catch-up
// (src/ps/proxy_impl.h; docs/design/ps.md, "Node failover").

#include "src/ps/proxy_impl.h"

namespace membox::ps::proxy_internal {

namespace {

// The answer to a peer's notice about one shard's round (key, shard, round
// as in `about`).
Message AnswerTo(Type type, const Message& about) {
  Message m;
  m.type = type;
  m.key = about.key;
  m.shard = about.shard;
  m.round = about.round;
  return m;
}

// Whether the one shard a peer offered is the one its notice named, with
// this node's geometry.
Status MatchesNotice(const OfferedShard& o, const Message& m, const Key& key,
                     uint64_t shard_bytes) {
  if (o.key != m.key || o.shard != m.shard || o.version != m.round ||
      o.key_bytes != key.bytes || o.shard_bytes != key.shard_bytes ||
      o.bytes != shard_bytes || o.dtype != static_cast<uint8_t>(key.dtype)) {
    return DataLossError("its record is not the shard it announced");
  }
  return Status::Ok();
}

}  // namespace

void ProxyImpl::PeerDown(uint32_t rank, const Status& why) {
  if (!running_) return;  // this proxy is stopping too
  bool any_client = false;
  for (auto& [id, c] : conns_) any_client |= c.role == Conn::Role::kClient;
  std::string who = "proxy " + std::to_string(rank) + " at " +
                    opt_.peers[rank] + " is down (" + why.ToString() + ")";
  if (opt_.replicate && mode_ != proto::Mode::kAsync && dead_worker_.empty()) {
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

void ProxyImpl::PeerHello(uint32_t rank, uint64_t conn, uint32_t nonce,
                          const std::string& endpoint) {
  if (!endpoint.empty() && endpoint != opt_.peers[rank]) {
    // A replacement on another host (`membox serve --join` there): we
    // reach it, and tell workers who ask (kWhere), at its new address.
    MEMBOX_LOG_WARN("proxy {}: proxy {} is now at {} (was {})", opt_.rank, rank,
                    endpoint, opt_.peers[rank]);
    opt_.peers[rank] = endpoint;
  }
  if (failover_.OnHello(rank, conn, nonce) == PeerFailover::Hello::kFirst) {
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
  if (!failover_.down(rank)) {
    PeerLost(rank,
             "proxy " + std::to_string(rank) + " at " + opt_.peers[rank] +
                 " was replaced",
             HasClients());
  }
  // The new incarnation gets new links.
  std::erase_if(catch_ups_,
                [&](const auto& e) { return std::get<0>(e.first) == rank; });
  std::erase_if(peer_regions_,
                [&](const auto& e) { return e.first.first == rank; });
  peer_out_.erase(rank);
  const bool all_up = failover_.Replaced(rank);
  peers_down_count_.store(failover_.down().size());
  // Rounds applied here whose backup died: the replacement copied this
  // node's state when it joined, so it has them; offer them again for its
  // answer.
  for (auto& [k, key] : keys_) {
    for (uint32_t s = 0; s < key.shards.size(); ++s) {
      if (BackupOf(k, s) != rank) continue;
      // A new backup: in step again only once it acknowledges a whole copy.
      key.shards[s].backup_synced = false;
      if (key.shards[s].awaiting_backup) SendBackup(k, s, /*whole=*/true);
    }
  }
  if (!all_up) return;  // another one is still down
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
      std::chrono::duration<double>(Clock::now() - failover_.down_since())
          .count();
  if (HasClients()) {
    MEMBOX_LOG_WARN(
        "proxy {}: proxy {} at {} is back (a replacement); the rounds "
        "resume after {:.2f} s",
        opt_.rank, rank, opt_.peers[rank], paused);
    failovers_.fetch_add(1);
  }
  MaybeStartAll();
}

void ProxyImpl::Where(uint64_t conn, const Message& m) {
  if (m.rank >= nproxies_) {
    return Reply(conn, m.type, m.id, InvalidArgumentError("no such proxy"));
  }
  Reply(conn, m.type, m.id, Status::Ok(), 0,
        nproxies_ > 1 ? opt_.peers[m.rank] : opt_.listen);
}

void ProxyImpl::OnClaim(uint64_t conn, Conn& c, const Message& m) {
  if (!FromNode(conn, c, m, "claim")) return;
  if (m.world == 0) {
    failover_.Unclaim(m.rank, m.endpoint);
    return Reply(conn, m.type, m.id, Status::Ok());
  }
  if (!opt_.replicate || nproxies_ < 2) {
    return Reply(conn, m.type, m.id,
                 FailedPreconditionError(
                     "this node keeps the only copy of its shards "
                     "(--ps-replicate off): a standby cannot take a dead "
                     "node's place"));
  }
  // Linked to it now: an out-link that works, or the in-link of its
  // current incarnation.
  bool linked = false;
  if (auto p = peer_out_.find(m.rank); p != peer_out_.end()) {
    linked = p->second->health().ok();
  }
  for (const auto& [id, o] : conns_) {
    linked |= o.role == Conn::Role::kPeer && o.rank == m.rank &&
              failover_.IsLink(m.rank, id);
  }
  Status st = failover_.Claim(m.rank, m.endpoint, linked, Clock::now());
  if (st.ok()) {
    MEMBOX_LOG_WARN("proxy {}: the standby at {} claims the place of proxy {}",
                    opt_.rank, m.endpoint, m.rank);
  } else if (st.code() == StatusCode::kNotFound &&
             m.world == proto::kClaimAfterLoss) {
    // The standby saw it up and lost it; see for ourselves. (A node the
    // standby never reached may be starting: not probed.)
    ProbeClaimedPeer(m.rank);
  }
  Reply(conn, m.type, m.id, st);
}

void ProxyImpl::ProbeClaimedPeer(uint32_t rank) {
  if (!running_ || !probing_.insert(rank).second) return;
  transport::DeviceOptions probe = device_->options();
  probe.listen_address.clear();
  probe.admit = nullptr;
  probe.name += "-probe";
  // membox's TCP path: a probe moves no data and maps no shared memory. A
  // device of its own: the proxy's hands out one channel per peer, which
  // the probe's closing would close for everyone.
  probe.transports = "tcp";
  const std::string endpoint = opt_.peers[rank];
  Status queued = peer_prober_.Submit([this, rank, endpoint, probe] {
    Status last;
    bool reached = false, dead = false;
    auto device = transport::Device::Create(probe);
    if (!device.ok()) last = device.status();
    for (int i = 0; device.ok() && i < 3 && running_ && !reached; ++i) {
      if (i > 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      service::ClientOptions co;
      co.node_kind = "proxy " + std::to_string(rank);
      auto c = service::Client::Connect(**device, endpoint, co);
      reached = c.ok();
      if (!reached) last = c.status();
    }
    // Only a connection that fails is a death; anything else (our own
    // device, a refusal) says nothing of the peer.
    dead = !reached && (last.code() == StatusCode::kUnavailable ||
                        last.code() == StatusCode::kDeadlineExceeded);
    Post([this, rank, endpoint, reached, dead, last] {
      probing_.erase(rank);
      if (failover_.down(rank) || opt_.peers[rank] != endpoint) return;
      if (reached) {
        // Linked from now on: its death is noticed as the link's loss.
        if (!peer_out_.count(rank)) {
          (void)PeerClient(rank, std::chrono::milliseconds(200));
        }
        return;
      }
      if (!dead) {
        MEMBOX_LOG_WARN("proxy {}: cannot probe proxy {} at {}: {}", opt_.rank,
                        rank, endpoint, last.ToString());
        return;
      }
      PeerDown(rank, UnavailableError("a standby lost it, and it is "
                                      "unreachable from here too: " +
                                      last.ToString()));
    });
  });
  if (!queued.ok()) {
    probing_.erase(rank);
    MEMBOX_LOG_WARN("proxy {}: cannot probe proxy {}: {}", opt_.rank, rank,
                    queued.ToString());
  }
}

void ProxyImpl::OnResume(uint32_t from, const Message& m) {
  if (m.rank >= nproxies_ || m.rank == opt_.rank) return;
  if (failover_.ResumeIsNews(m.rank, m.world)) {
    PeerLost(m.rank,
             "proxy " + std::to_string(from) + " reports proxy " +
                 std::to_string(m.rank) + " replaced",
             HasClients());
  }
  failover_.Resumed(from);
}

void ProxyImpl::PeerLost(uint32_t rank, const std::string& who,
                         bool any_client) {
  if (!failover_.Lost(rank, Clock::now())) return;
  peers_down_count_.store(failover_.down().size());
  size_t restarted = 0;
  std::vector<std::pair<uint64_t, uint32_t>> complete;
  for (auto& [k, key] : keys_) {
    for (uint32_t s = 0; s < key.shards.size(); ++s) {
      Shard& sh = key.shards[s];
      // Applied here, waiting for its backup: done, whoever died.
      if (sh.awaiting_backup) continue;
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
  for (auto [k, s] : complete) FinishRound(k, s);
  if (any_client) {
    MEMBOX_LOG_WARN(
        "{}; {} round(s) in flight restart ({} complete here finish), and "
        "every round of an unstriped key and every answer its backup "
        "copy must precede waits for its "
        "replacement (membox serve --join; membox launch starts one) for "
        "up to {} s",
        who, restarted, complete.size(),
        std::chrono::duration_cast<std::chrono::seconds>(opt_.failover_timeout)
            .count());
  } else {
    MEMBOX_LOG_INFO("{}; no workers connected", who);
  }
}

bool ProxyImpl::HasClients() const {
  for (const auto& [id, c] : conns_) {
    if (c.role == Conn::Role::kClient) return true;
  }
  return false;
}

void ProxyImpl::CheckFailoverDeadline() {
  if (!HasClients() || !dead_worker_.empty()) return;
  if (!failover_.Overdue(Clock::now(), opt_.failover_timeout)) return;
  std::string who;
  for (uint32_t r : failover_.down()) {
    who += (who.empty() ? "proxy " : ", proxy ") + std::to_string(r) + " at " +
           opt_.peers[r];
  }
  FailPendingRounds(
      who + " was not replaced within " +
      std::to_string(std::chrono::duration_cast<std::chrono::seconds>(
                         opt_.failover_timeout)
                         .count()) +
      " s");
}

void ProxyImpl::FailPendingRounds(const std::string& who) {
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

CopyAllocator ProxyImpl::CopyBuffers() {
  return [this](uint64_t n) { return storage_->AllocateForCopy(n); };
}

void ProxyImpl::SendCatchUp(uint32_t to, uint64_t k, uint32_t s,
                            uint64_t round) {
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

void ProxyImpl::OnCatchUp(uint32_t from, const Message& m) {
  Message done = AnswerTo(Type::kCatchUpDone, m);
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
    RETURN_IF_ERROR(MatchesNotice(o, m, key, sh.bytes));
    ASSIGN_OR_RETURN(copied, CopyShards(*ch, {&o}, CopyBuffers(), kIoTimeout));
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

bool ProxyImpl::BacksUp(const Key& key) const {
  return key.striped && opt_.replicate && nproxies_ > 1 &&
         mode_ != proto::Mode::kAsync;
}

uint32_t ProxyImpl::BackupOf(uint64_t k, uint32_t s) const {
  return (Owner(k, s) + 1) % nproxies_;
}

void ProxyImpl::SendBackup(uint64_t k, uint32_t s, bool whole) {
  Key& key = keys_[k];
  Shard& sh = key.shards[s];
  const uint32_t to = BackupOf(k, s);
  if (!sh.awaiting_backup) backups_pending_.fetch_add(1);
  sh.awaiting_backup = true;
  sh.backup_keep.clear();
  if (failover_.down(to)) return;  // PeerHello of its replacement
  if (sh.round_held && key.opt.kind == proto::Optimizer::kNone) {
    // The version, not the bytes: the round's sum feeds no later round,
    // and every worker holds its push of it until its next answer from
    // here, so a replacement redoes it (docs/design/ps.md, "Version
    // notices").
    sh.backup_synced = false;
    Message b;
    b.type = Type::kBackupVersion;
    b.key = k;
    b.shard = s;
    b.round = sh.version;
    if (Status st = SendToPeer(to, b); !st.ok()) {
      MEMBOX_LOG_DEBUG(
          "proxy {}: version notice of key {} shard {} to "
          "proxy {}: {}",
          opt_.rank, k, s, to, st.ToString());
    }
    return;
  }
  // The step instead of its result: the round's sum, which the backup
  // applies to the previous round it acknowledged (docs/design/ps.md,
  // "Backing up a step instead of its result").
  const bool step = !whole && sh.backup_synced && sh.scratch &&
                    sh.step_opt.kind != proto::Optimizer::kNone;
  sh.backup_synced = false;  // until this offer is acknowledged
  sh.written_since_offer = false;
  StoredShard sum;
  if (step) {
    sum.offset = sh.offset;
    sum.bytes = sh.bytes;
    sum.version = sh.version;
    sum.value = sh.scratch;  // kept (backup_keep): the next round sums
                             // into a fresh buffer meanwhile
  }
  // The manifest travels in the notice: the backup reads the buffers at
  // once (no manifest region to read first).
  auto offer = MakeInlineOffer(
      opt_.rank,
      {{k, s, key.dtype, key.bytes, key.shard_bytes, step ? &sum : &sh}});
  if (offer.ok() && offer->manifest.size() > proto::kMaxDescriptor) {
    offer = InternalError("its manifest is too long for a notice");
  }
  if (!offer.ok()) {
    // The round is applied here; failing it now would leave the workers
    // a round apart from the nodes. Answer it with one copy, and say so.
    MEMBOX_LOG_WARN(
        "proxy {}: key {} shard {} round {} is answered without a backup "
        "copy (cannot offer it to proxy {}: {})",
        opt_.rank, k, s, sh.version - 1, to, offer.status().ToString());
    sh.awaiting_backup = false;
    backups_pending_.fetch_sub(1);
    return BackupSettled(k, s);
  }
  Message b;
  b.type = step ? Type::kBackupStep : Type::kBackup;
  b.key = k;
  b.shard = s;
  b.round = sh.version;
  b.bytes = offer->manifest.size();
  b.descriptor = std::move(offer->manifest);
  if (step) {
    b.optimizer = sh.step_opt.kind;
    b.lr = sh.step_opt.lr;
    b.momentum = sh.step_opt.momentum;
    b.beta1 = sh.step_opt.beta1;
    b.beta2 = sh.step_opt.beta2;
    b.eps = sh.step_opt.eps;
    b.weight_decay = sh.step_opt.weight_decay;
    b.grad_scale = sh.step_scale;
  }
  sh.backup_keep = std::move(offer->keep);
  Status st = SendToPeer(to, b);
  if (!st.ok()) {
    // Its link failed: PeerDown follows, and the replacement's hello
    // sends the offer again.
    MEMBOX_LOG_DEBUG("proxy {}: backup of key {} shard {} to proxy {}: {}",
                     opt_.rank, k, s, to, st.ToString());
  }
}

void ProxyImpl::RefuseBackup(uint32_t from, const Message& m, std::string why) {
  Message done = AnswerTo(Type::kBackupDone, m);
  done.text = std::move(why);
  MEMBOX_LOG_WARN("proxy {}: refused a {} from proxy {}: {}", opt_.rank,
                  proto::TypeName(m.type), from, done.text);
  (void)SendToPeer(from, done);
}

const Key* ProxyImpl::OfferedToMe(uint32_t from, const Message& m) {
  auto it = keys_.find(m.key);
  // (Whether the key is striped is not checked: a replacement learns it
  // from the workers' declarations, which its owners' offers may precede.)
  if (it == keys_.end() || m.shard >= it->second.shards.size() ||
      Owner(m.key, m.shard) != from || BackupOf(m.key, m.shard) != opt_.rank) {
    RefuseBackup(from, m,
                 "proxy " + std::to_string(opt_.rank) +
                     " is not the backup of key " + std::to_string(m.key) +
                     " shard " + std::to_string(m.shard));
    return nullptr;
  }
  return &it->second;
}

void ProxyImpl::OnBackup(uint32_t from, const Message& m) {
  if (IgnoreBackupForTest(m)) return;
  const Key* offered = OfferedToMe(from, m);
  if (offered == nullptr) return;
  const Key& key = *offered;
  const Shard& sh = key.shards[m.shard];
  if (sh.version >= m.round && !sh.copying) {
    // Copied already (a replacement that joined after the round).
    (void)SendToPeer(from, AnswerTo(Type::kBackupDone, m));
    return;
  }
  auto man = std::make_shared<StateManifest>();
  Status parsed = ParseStateManifest(m.descriptor, man.get());
  if (parsed.ok() && (man->proxy_rank != from || man->shards.size() != 1)) {
    parsed = DataLossError("it is not one shard offered by proxy " +
                           std::to_string(from));
  }
  if (parsed.ok()) parsed = MatchesNotice(man->shards[0], m, key, sh.bytes);
  if (!parsed.ok()) return RefuseBackup(from, m, parsed.ToString());
  auto ch = PeerChannel(from);
  if (!ch.ok()) return;  // its link failed: the owner's replacement offers it
  // The reads run while the event loop goes on (across hosts each takes
  // the shard's size at the link's rate); their completion installs the
  // copy on the loop. Many shards' copies are in flight at once.
  auto import = [this, from, channel = *ch](const RegionDescriptor& d) {
    return ImportPeerRegion(from, *channel, d);
  };
  StartCopyShard(
      **ch, man->shards[0], CopyBuffers(),
      [this](transport::OpHandle h) { Track(std::move(h)); },
      [this, from, m, man](Result<CopiedShard> got) {
        auto r = std::make_shared<Result<CopiedShard>>(std::move(got));
        Post([this, from, m, man, r] { InstallBackup(from, m, *r); });
      },
      import);
}

Result<std::shared_ptr<RemoteMemRegion>> ProxyImpl::ImportPeerRegion(
    uint32_t from, transport::Channel& channel, const RegionDescriptor& d) {
  // The owner offers the same few buffers of a shard round after round
  // (copy-on-write swaps them): import each once.
  auto key = std::make_pair(from, d.region_id);
  auto it = peer_regions_.find(key);
  if (it != peer_regions_.end() && it->second->descriptor().token == d.token) {
    return it->second;
  }
  ASSIGN_OR_RETURN(auto r, channel.Import(d, kIoTimeout, false));
  peer_regions_[key] = r;
  return r;
}

void ProxyImpl::InstallBackup(uint32_t from, const Message& m,
                              Result<CopiedShard>& got) {
  Message done = AnswerTo(Type::kBackupDone, m);
  auto it = keys_.find(m.key);
  if (it == keys_.end() || m.shard >= it->second.shards.size()) return;
  Shard& sh = it->second.shards[m.shard];
  if (!got.ok()) {
    done.text = got.status().ToString();
    MEMBOX_LOG_WARN(
        "proxy {}: cannot copy key {} shard {} version {} from proxy {}: {}",
        opt_.rank, m.key, m.shard, m.round, from, done.text);
  } else if (sh.version < m.round || sh.copying) {
    // (A replacement still copying the shard takes the owner's offer:
    // the same version or newer, and the answer must not come before the
    // bytes are here.)
    sh.version = m.round;
    sh.value = std::move(got->value);
    sh.value_stale = false;
    sh.m1 = std::move(got->m1);
    sh.m2 = std::move(got->m2);
    backup_bytes_in_.fetch_add(
        StateBytes(sh.bytes, sh.m1 != nullptr, sh.m2 != nullptr),
        std::memory_order_relaxed);
    ShardCopied(m.key, m.shard);
  }
  (void)SendToPeer(from, done);
}

void ProxyImpl::OnBackupDone(uint32_t from, const Message& m) {
  auto it = keys_.find(m.key);
  if (it == keys_.end() || m.shard >= it->second.shards.size()) return;
  Shard& sh = it->second.shards[m.shard];
  if (!sh.awaiting_backup || m.round != sh.version ||
      BackupOf(m.key, m.shard) != from) {
    return;  // an answer to an offer made again, or stale
  }
  if (!m.text.empty()) {
    MEMBOX_LOG_WARN(
        "proxy {}: key {} shard {} round {} is answered without a backup "
        "copy: proxy {} says {}",
        opt_.rank, m.key, m.shard, m.round - 1, from, m.text);
  }
  sh.awaiting_backup = false;
  sh.backup_synced = m.text.empty() && !sh.written_since_offer;
  sh.backup_keep.clear();
  backups_pending_.fetch_sub(1);
  if (m.text.empty()) backups_acked_.fetch_add(1, std::memory_order_relaxed);
  BackupSettled(m.key, m.shard);
}

void ProxyImpl::BackupSettled(uint64_t k, uint32_t s) {
  Shard& sh = keys_[k].shards[s];
  if (!sh.answered_early) return PublishRound(k, s, Status::Ok());
  // Answered when it was applied: the next round may start now.
  sh.answered_early = false;
  Schedule();
  MaybeStart(k, s);
}

void ProxyImpl::OnBackupWhole(uint32_t from, const Message& m) {
  auto it = keys_.find(m.key);
  if (it == keys_.end() || m.shard >= it->second.shards.size()) return;
  Shard& sh = it->second.shards[m.shard];
  if (!sh.awaiting_backup || m.round != sh.version ||
      BackupOf(m.key, m.shard) != from) {
    return;  // stale
  }
  SendBackup(m.key, m.shard, /*whole=*/true);
}

void ProxyImpl::OnBackupVersion(uint32_t from, const Message& m) {
  if (OfferedToMe(from, m) == nullptr) return;
  Shard& sh = keys_[m.key].shards[m.shard];
  if (m.round > sh.version || sh.copying) {
    // (A replacement still copying the shard from its owner keeps the
    // newer version; the bytes that land are older and stay stale.)
    sh.version = std::max(sh.version, m.round);
    sh.value_stale = true;
  }
  version_notices_in_.fetch_add(1, std::memory_order_relaxed);
  (void)SendToPeer(from, AnswerTo(Type::kBackupDone, m));
}

bool ProxyImpl::IgnoreBackupForTest(const Message& m) const {
  return opt_.ignore_backup_for_test &&
         opt_.ignore_backup_for_test(m.key, m.shard, m.round);
}

void ProxyImpl::OnBackupStep(uint32_t from, const Message& m) {
  if (IgnoreBackupForTest(m)) return;
  const Key* offered = OfferedToMe(from, m);
  if (offered == nullptr) return;
  const Key& key = *offered;
  const Shard& sh = key.shards[m.shard];
  if (sh.version >= m.round && !sh.copying) {
    (void)SendToPeer(from, AnswerTo(Type::kBackupDone, m));  // has it already
    return;
  }
  if (sh.copying || sh.version + 1 != m.round || !sh.value) {
    // Not the round the step starts from: the shard whole, please.
    (void)SendToPeer(from, AnswerTo(Type::kBackupWhole, m));
    return;
  }
  auto man = std::make_shared<StateManifest>();
  Status parsed = ParseStateManifest(m.descriptor, man.get());
  if (parsed.ok() && (man->proxy_rank != from || man->shards.size() != 1 ||
                      man->shards[0].m1 || man->shards[0].m2)) {
    parsed = DataLossError("it is not one round's sum offered by proxy " +
                           std::to_string(from));
  }
  if (parsed.ok()) parsed = MatchesNotice(man->shards[0], m, key, sh.bytes);
  if (!parsed.ok()) return RefuseBackup(from, m, parsed.ToString());
  auto ch = PeerChannel(from);
  if (!ch.ok()) return;  // its link failed: the owner's replacement offers it
  StartCopyShard(
      **ch, man->shards[0], CopyBuffers(),
      [this](transport::OpHandle h) { Track(std::move(h)); },
      [this, from, m, man](Result<CopiedShard> got) {
        auto r = std::make_shared<Result<CopiedShard>>(std::move(got));
        Post([this, from, m, man, r] { InstallBackupStep(from, m, *r); });
      },
      [this, from, channel = *ch](const RegionDescriptor& d) {
        return ImportPeerRegion(from, *channel, d);
      });
}

void ProxyImpl::InstallBackupStep(uint32_t from, const Message& m,
                                  Result<CopiedShard>& got) {
  Message done = AnswerTo(Type::kBackupDone, m);
  auto it = keys_.find(m.key);
  if (it == keys_.end() || m.shard >= it->second.shards.size()) return;
  Key& key = it->second;
  Shard& sh = key.shards[m.shard];
  if (!got.ok()) {
    done.text = got.status().ToString();
    MEMBOX_LOG_WARN(
        "proxy {}: cannot read key {} shard {} round {}'s sum from proxy {}: "
        "{}",
        opt_.rank, m.key, m.shard, m.round - 1, from, done.text);
  } else if (sh.version >= m.round && !sh.copying) {
    // (a whole offer brought it meanwhile)
  } else if (sh.copying || sh.version + 1 != m.round || !sh.value) {
    (void)SendToPeer(from, AnswerTo(Type::kBackupWhole, m));
    return;
  } else {
    // The owner's step, as it applied it: the same code on the same data
    // gives the owner's round bit for bit.
    Status st =
        storage_->Apply(key.dtype, OptimizerSettings::From(m),
                        Update::kOptimizer, sh, got->value.get(), m.grad_scale);
    if (st.ok()) {
      sh.version = m.round;
      backup_bytes_in_.fetch_add(sh.bytes, std::memory_order_relaxed);
      backup_steps_.fetch_add(1, std::memory_order_relaxed);
    } else {
      done.text = st.ToString();
      MEMBOX_LOG_WARN("proxy {}: cannot apply key {} shard {} round {}: {}",
                      opt_.rank, m.key, m.shard, m.round - 1, done.text);
    }
  }
  (void)SendToPeer(from, done);
}

Result<service::Client*> ProxyImpl::PeerClient(uint32_t rank,
                                               Clock::duration wait) {
  auto it = peer_out_.find(rank);
  if (it != peer_out_.end()) {
    Status h = it->second->health();
    if (h.ok()) return it->second.get();
    return UnavailableError("proxy " + std::to_string(rank) + " at " +
                            opt_.peers[rank] + " is down: " + h.ToString());
  }
  auto deadline = Clock::now() + wait;
  Status last;
  while (Clock::now() < deadline && running_) {
    service::ClientOptions co;
    co.node_kind = "proxy " + std::to_string(rank);
    const uint64_t incarnation = failover_.incarnation(rank);
    co.on_failure = [this, rank, incarnation](const Status& s) {
      // PeerDown reports it, at a level that fits the moment.
      MEMBOX_LOG_DEBUG("link to proxy {} failed: {}", rank, s.ToString());
      Post([this, rank, incarnation, s] {
        if (failover_.incarnation(rank) == incarnation) PeerDown(rank, s);
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
                 [this, rank](const Status& s, std::span<const uint8_t>) {
                   if (s.ok()) return;
                   MEMBOX_LOG_ERROR("proxy {} refused us: {}", rank,
                                    s.ToString());
                   MutexLock l(&refusals_mu_);
                   hello_refusals_[rank] = s;
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

Result<std::shared_ptr<Channel>> ProxyImpl::PeerChannel(uint32_t rank) {
  ASSIGN_OR_RETURN(service::Client * c, PeerClient(rank));
  return c->channel_ptr();
}

Status ProxyImpl::SendToPeer(uint32_t rank, const Message& m) {
  ASSIGN_OR_RETURN(service::Client * c, PeerClient(rank));
  return c->Notify(static_cast<uint16_t>(m.type), proto::Encode(m));
}

}  // namespace membox::ps::proxy_internal
