// The parameter proxy: a replacement joining (--join) -- which peer gives
// which shard, the copy in the background while it serves, and what waits
// for a shard not copied yet (src/ps/proxy_impl.h; docs/design/ps.md,
// "Node failover", "A replacement serves while it copies").
#include <algorithm>

#include "src/ps/proxy_impl.h"

namespace membox::ps::proxy_internal {

namespace {

// A copier batch: at most ProxyOptions::join_batch_bytes (one read per
// buffer, all in flight at once), so a shard a request waits for is never
// behind more than one batch.
constexpr size_t kJoinBatchShards = 256;

uint64_t StateBytes(const OfferedShard& o) {
  return ps::StateBytes(o.bytes, o.m1.has_value(), o.m2.has_value());
}

}  // namespace

Status ProxyImpl::HelloRefusal(uint32_t p) {
  // The refusal is answered before the peer closes the link: it is here by
  // the time the copy failed, or within moments.
  for (int i = 0; i < 20; ++i) {
    {
      MutexLock l(&refusals_mu_);
      auto it = hello_refusals_.find(p);
      if (it != hello_refusals_.end()) return it->second;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return Status::Ok();
}

Status ProxyImpl::Join() {
  if (nproxies_ < 2) {
    return FailedPreconditionError("--join needs peers (--ps-peers)");
  }
  auto job = std::make_shared<JoinCopy>();
  job->start = Clock::now();
  // A peer that cannot be reached is taken as dead too: what it held comes
  // from the other holders, and what none of the live peers holds is lost.
  std::vector<uint32_t> down;
  std::string why_down;
  for (uint32_t p = 0; p < nproxies_; ++p) {
    if (p == opt_.rank) continue;
    const Status reached = PeerClient(p, kJoinPeerWait).status();
    const bool linked = reached.ok();  // our hello went out
    Result<StateManifest> man =
        linked || reached.code() != StatusCode::kUnavailable
            ? FetchPeerManifest(p)
            : Result<StateManifest>(reached);
    Result<std::shared_ptr<Channel>> ch =
        man.ok() ? PeerChannel(p)
                 : Result<std::shared_ptr<Channel>>(man.status());
    if (!ch.ok()) {
      // Another replacement has this place (a standby's claim): nothing to
      // do here, and the peers' refusal says who.
      if (Status why = linked ? HelloRefusal(p) : Status::Ok();
          why.code() == StatusCode::kAlreadyExists) {
        return AlreadyExistsError(
            "joining as proxy " + std::to_string(opt_.rank) +
            ": this place is taken (proxy " + std::to_string(p) + " says: " +
            std::string(why.message()) + "); this replacement is not needed");
      }
      if (ch.status().code() != StatusCode::kUnavailable) {
        TellJoinDone(*job);
        return Status(ch.status().code(),
                      "joining: cannot copy the state of proxy " +
                          std::to_string(p) + " at " + opt_.peers[p] + ": " +
                          std::string(ch.status().message()));
      }
      MEMBOX_LOG_WARN(
          "proxy {} joins without proxy {} at {} (down: {}): its shards "
          "come from their other holders",
          opt_.rank, p, opt_.peers[p], ch.status().ToString());
      down.push_back(p);
      why_down += " proxy " + std::to_string(p) + ": " + ch.status().ToString();
      continue;
    }
    job->manifests[p] = std::move(*man);
    job->channels[p] = *ch;
  }
  if (job->manifests.empty()) {
    return UnavailableError(
        "joining: no peer is reachable, so there is no state to copy "
        "(every other node is down:" +
        why_down + ")");
  }
  // Who gives which shard: the newest version any peer holds (with
  // primary-backup the owner or its backup; a peer that finished a ring
  // round the others did not is ahead by one), spread round-robin among
  // the peers holding it.
  for (auto& [p, man] : job->manifests) {
    for (const auto& o : man.shards) {
      job->sources[{o.key, o.shard}].push_back({p, &o});
    }
  }
  size_t turn = 0;
  // Shards whose holders have the version only (a backup that took
  // version notices): reopened here, not copied.
  std::set<std::pair<uint64_t, uint32_t>> reopened;
  // Shards this node keeps the version of only (below): not copied.
  std::set<std::pair<uint64_t, uint32_t>> versions_only;
  MutexLock l(&job->mu);
  for (auto& [id, list] : job->sources) {
    uint64_t newest = 0;
    for (auto& [p, o] : list) newest = std::max(newest, o->version);
    std::erase_if(list, [&](auto& e) { return e.second->version != newest; });
    // A holder with the bytes goes before one with the version only.
    if (std::any_of(list.begin(), list.end(),
                    [](auto& e) { return !e.second->stale_value; })) {
      std::erase_if(list, [](auto& e) { return e.second->stale_value; });
    }
    std::rotate(list.begin(), list.begin() + (turn++ % list.size()),
                list.end());
    const OfferedShard& o = *list.front().second;
    // The shard's geometry and version now (declarations are answered
    // with it at once); its buffers when the copier has them.
    ASSIGN_OR_RETURN(Shard * sh,
                     PrepareShard(o.key, o.shard, o.dtype, o.key_bytes,
                                  o.shard_bytes, "the peers' state"));
    if (sh->bytes != o.bytes) {
      TellJoinDone(*job);
      return DataLossError("the peers' state: shard size mismatch for key " +
                           std::to_string(o.key));
    }
    // A striped shard this node neither owns nor backs up (three or more
    // nodes): its owner and backup keep it; this node keeps its version
    // only, as a backup after version notices does. A shard it backs up
    // whose owner applied the last round from held pushes: the version is
    // all a backup of it holds (the workers' pushes redo the round if the
    // owner dies too). Neither is copied.
    const bool owner_here = Owner(o.key, o.shard) == opt_.rank;
    const bool elsewhere =
        o.striped && !owner_here && BackupOf(o.key, o.shard) != opt_.rank;
    const bool held = !owner_here &&
                      std::any_of(list.begin(), list.end(),
                                  [](auto& e) { return e.second->held_round; });
    if (elsewhere || held) {
      ASSIGN_OR_RETURN(sh->value, storage_->AllocateUntouched(sh->bytes));
      sh->version = o.version;
      sh->value_stale = true;
      versions_only.insert(id);
      continue;
    }
    if (o.stale_value) {
      // Only the version survived its owner's death: round version - 1
      // was applied, and maybe answered to some workers, but no round
      // after it was (its notice would be here). Every worker holds its
      // push of that round until its next answer, or has not been
      // answered; so the round is reopened and redone from their pushes
      // (docs/design/ps.md, "Version notices"). The value is never served
      // before that.
      ASSIGN_OR_RETURN(sh->value, storage_->AllocateUntouched(sh->bytes));
      sh->version = o.version > 0 ? o.version - 1 : 0;
      sh->value_stale = o.version > 0;
      reopened.insert(id);
      continue;
    }
    sh->version = o.version;
    sh->copying = true;
    job->order.push_back({id, 0});
    job->state_bytes += StateBytes(o);
    ++job->shards;
  }
  // The shards this node owns first: the survivors' rounds wait for them
  // (until a request marks one urgent, before the workers are back), the
  // ones it backs up only make the job safe again.
  std::stable_partition(
      job->order.begin(), job->order.end(), [&](const auto& e) {
        return Owner(e.first.first, e.first.second) == opt_.rank;
      });
  // A key a live peer holds but offers no shard of: every node that kept
  // its shards current is down. Its shards are lost (below), not silently
  // absent (a worker's declaration would make it afresh).
  for (auto& [p, man] : job->manifests) {
    for (const HeldKey& k : man.keys) {
      auto it = keys_.find(k.key);
      if (it != keys_.end() && !it->second.shards.empty()) continue;
      auto sh = PrepareShard(k.key, 0, k.dtype, k.key_bytes, k.shard_bytes,
                             "the peers' state");
      if (!sh.ok()) {
        TellJoinDone(*job);
        return sh.status();
      }
    }
  }
  // Every shard of every key must have a holder among the live peers.
  std::vector<std::pair<uint64_t, uint32_t>> lost;
  uint64_t lost_bytes = 0;
  for (auto& [k, key] : keys_) {
    for (uint32_t s = 0; s < key.shards.size(); ++s) {
      if (!key.shards[s].copying && reopened.count({k, s}) == 0 &&
          versions_only.count({k, s}) == 0) {
        lost.push_back({k, s});
        lost_bytes +=
            std::min(key.shard_bytes, key.bytes - s * key.shard_bytes);
      }
    }
  }
  if (!lost.empty()) {
    TellJoinDone(*job);
    std::string gone = "proxy " + std::to_string(opt_.rank) + " (replaced)";
    for (uint32_t p : down) gone += " and proxy " + std::to_string(p);
    std::string which;
    for (size_t i = 0; i < lost.size() && i < 4; ++i) {
      which += (i ? ", key " : "key ") + std::to_string(lost[i].first) +
               " shard " + std::to_string(lost[i].second);
    }
    if (lost.size() > 4) {
      which += " and " + std::to_string(lost.size() - 4) + " more";
    }
    return DataLossError(
        "joining: " + std::to_string(lost.size()) + " shard(s) (" +
        std::to_string(lost_bytes) +
        " bytes of parameters) were held only by " + gone +
        ", which are all down, so the job's state is lost: " + which +
        "; restart the job from a checkpoint" +
        (down.empty() ? std::string() : " (down:" + why_down + ")"));
  }
  // The peers found down: their rounds wait for their replacements, as
  // with a peer that dies while this node serves.
  for (uint32_t p : down) {
    PeerLost(p,
             "proxy " + std::to_string(p) + " at " + opt_.peers[p] +
                 " is down (found while joining)",
             false);
  }
  copying_shards_ = job->shards;
  shards_copying_.store(copying_shards_, std::memory_order_relaxed);
  join_state_bytes_.store(job->state_bytes, std::memory_order_relaxed);
  join_versions_only_.store(reopened.size() + versions_only.size(),
                            std::memory_order_relaxed);
  join_copy_ = job;
  MEMBOX_LOG_WARN(
      "proxy {} joins: {} keys ({} shards, {} bytes of state) from {} "
      "peer(s), copied while it serves; {} shard(s) held as versions only "
      "reopen their last round, which the workers' held pushes redo; {} "
      "shard(s) whose last round the workers hold, or that other nodes "
      "own and back up, are kept as versions only, not copied (the "
      "peers offered it in {:.3f} s)",
      opt_.rank, keys_.size(), job->shards, job->state_bytes,
      job->manifests.size(), reopened.size(), versions_only.size(),
      std::chrono::duration<double>(Clock::now() - job->start).count());
  return Status::Ok();
}

void ProxyImpl::StartJoinCopy() {
  std::shared_ptr<JoinCopy> job = join_copy_;
  if (!job) return;
  const int n = std::max(
      1, opt_.join_copy_threads > 0 ? opt_.join_copy_threads : opt_.sync_cores);
  job->copiers = n;
  for (int i = 0; i < n; ++i) {
    join_copiers_.emplace_back([this, job] { RunJoinCopy(job); });
  }
}

void ProxyImpl::RunJoinCopy(const std::shared_ptr<JoinCopy>& job) {
  for (;;) {
    if (!running_.load()) return;  // Stop
    if (opt_.before_join_batch_for_test) opt_.before_join_batch_for_test();
    // The next batch: shards a request waits for first, then key order;
    // consecutive ones from the same source.
    std::vector<std::pair<std::pair<uint64_t, uint32_t>, size_t>> batch;
    uint32_t from = 0;
    {
      MutexLock l(&job->mu);
      // Shards a backup offer brought meanwhile need no copy.
      if (!job->installed.empty()) {
        auto kept = job->order.begin();  // (no lambda: -Wthread-safety)
        for (auto it = job->order.begin(); it != job->order.end(); ++it) {
          if (job->installed.count(it->first) == 0) *kept++ = *it;
        }
        job->order.erase(kept, job->order.end());
        job->installed.clear();
      }
      if (job->order.empty()) break;
      auto pick = job->order.begin();
      if (!job->urgent.empty()) {
        for (auto it = job->order.begin(); it != job->order.end(); ++it) {
          if (job->urgent.count(it->first) != 0) {
            pick = it;
            break;
          }
        }
      }
      from = job->sources[pick->first][pick->second].first;
      // A batch with a shard a request waits for takes only such shards:
      // the others (the shards this node backs up, say) would make the
      // waiting requests wait for their copy too.
      const bool urgent_only = job->urgent.count(pick->first) != 0;
      uint64_t bytes = 0;
      for (auto it = pick; it != job->order.end() &&
                           batch.size() < kJoinBatchShards &&
                           bytes < opt_.join_batch_bytes;) {
        const auto& src = job->sources[it->first][it->second];
        if (src.first != from ||
            (urgent_only && job->urgent.count(it->first) == 0)) {
          if (it == pick) break;
          ++it;
          continue;
        }
        bytes += StateBytes(*src.second);
        job->urgent.erase(it->first);
        batch.push_back(*it);
        it = job->order.erase(it);
      }
    }
    if (opt_.join_batch_for_test) {
      std::vector<std::pair<uint64_t, uint32_t>> ids;
      for (auto& [id, i] : batch) ids.push_back(id);
      opt_.join_batch_for_test(ids);
    }
    std::vector<const OfferedShard*> list;
    for (auto& [id, i] : batch) list.push_back(job->sources[id][i].second);
    auto copied =
        CopyShards(*job->channels[from], list, CopyBuffers(), kIoTimeout);
    if (copied.ok()) {
      auto got = std::make_shared<std::vector<CopiedShard>>(std::move(*copied));
      Post([this, got, job, from] {
        for (auto& c : *got) InstallJoined(from, c);
      });
      continue;
    }
    // The giver is gone (or its buffers are): the next peer holding the
    // same version, else the shard is lost.
    MEMBOX_LOG_WARN("proxy {}: copying {} shard(s) from proxy {} failed: {}",
                    opt_.rank, batch.size(), from, copied.status().ToString());
    MutexLock l(&job->mu);
    for (auto& [id, i] : batch) {
      if (i + 1 < job->sources[id].size()) {
        job->order.push_front({id, i + 1});
        continue;
      }
      const std::string why =
          "key " + std::to_string(id.first) + " shard " +
          std::to_string(id.second) + " (version " +
          std::to_string(job->sources[id][i].second->version) +
          "): every peer holding it failed while proxy " +
          std::to_string(opt_.rank) + " copied it (last: proxy " +
          std::to_string(from) + ", " + copied.status().ToString() + ")";
      Post([this, why] { JoinCopyLost(why); });
    }
  }
  // Every batch this thread took is installed (posted) before this: the
  // last copier to finish ends the copy after every other's batches.
  if (job->copiers.fetch_sub(1) == 1) {
    Post([this, job] { FinishJoinCopy(*job); });
  }
}

void ProxyImpl::InstallJoined(uint32_t from, CopiedShard& c) {
  const OfferedShard& o = *c.offer;
  auto it = keys_.find(o.key);
  if (it == keys_.end() || o.shard >= it->second.shards.size()) return;
  Shard& sh = it->second.shards[o.shard];
  if (!sh.copying) return;  // an owner's backup offer brought it first
  if (join_copy_) {
    ++join_copy_->shards_copied;
    join_copy_->bytes_copied += StateBytes(o);
  }
  sh.value = std::move(c.value);
  sh.m1 = std::move(c.m1);
  sh.m2 = std::move(c.m2);
  // A shard this node owns, copied from its backup: the backup holds
  // exactly this (only the owner's offers change a backup's copy), so it
  // is in step, and the next round offers it the step, not the shard whole
  // (which would copy back every byte just copied from it).
  // (The offer says whether the key is striped: the workers' declarations,
  // which tell this node, may come later.)
  if (o.striped && opt_.replicate && Owner(o.key, o.shard) == opt_.rank &&
      BackupOf(o.key, o.shard) == from && !sh.value_stale) {
    sh.backup_synced = true;
  }
  ShardCopied(o.key, o.shard);
}

void ProxyImpl::ShardCopied(uint64_t k, uint32_t s) {
  Shard& sh = keys_[k].shards[s];
  if (!sh.copying) return;
  sh.copying = false;
  if (auto job = join_copy_) {  // (a copier's own batch is out of `order`)
    MutexLock l(&job->mu);
    job->installed.insert({k, s});
  }
  if (copying_shards_ > 0) --copying_shards_;
  shards_copying_.store(copying_shards_, std::memory_order_relaxed);
  auto w = copy_waiters_.find({k, s});
  if (w != copy_waiters_.end()) {
    auto waiting = std::move(w->second);
    copy_waiters_.erase(w);
    for (auto& [conn, m] : waiting) {
      auto c = conns_.find(conn);
      if (c != conns_.end()) OnClientMessage(conn, c->second, std::move(m));
    }
  }
  auto n = copy_notices_.find({k, s});
  if (n != copy_notices_.end()) {
    auto notices = std::move(n->second);
    copy_notices_.erase(n);
    for (const Message& m : notices) OnPeerNotice(m);
  }
  ServeWaitingPulls(k, sh);
  Schedule();
  MaybeStart(k, s);
}

void ProxyImpl::WaitForCopy(const Message& peer_notice) {
  if (auto job = join_copy_) {
    MutexLock l(&job->mu);
    job->urgent.insert({peer_notice.key, peer_notice.shard});
  }
  copy_notices_[{peer_notice.key, peer_notice.shard}].push_back(peer_notice);
}

bool ProxyImpl::WaitForCopy(uint64_t conn, Message& m) {
  if (copying_shards_ == 0) return false;
  auto it = keys_.find(m.key);
  if (it == keys_.end() || m.shard >= it->second.shards.size() ||
      !it->second.shards[m.shard].copying) {
    return false;
  }
  if (auto job = join_copy_) {
    MutexLock l(&job->mu);
    job->urgent.insert({m.key, m.shard});
  }
  copy_waiters_[{m.key, m.shard}].push_back({conn, std::move(m)});
  return true;
}

void ProxyImpl::JoinCopyLost(const std::string& why) {
  MEMBOX_LOG_ERROR("proxy {}: {}", opt_.rank, why);
  if (HasClients()) FailPendingRounds(why);
  for (auto& [id, waiting] : copy_waiters_) {
    for (auto& [conn, m] : waiting) {
      Reply(conn, m.type, m.id, DataLossError(why));
    }
  }
  copy_waiters_.clear();
}

void ProxyImpl::FinishJoinCopy(JoinCopy& job) {
  TellJoinDone(job);
  MEMBOX_LOG_WARN(
      "proxy {} joined: copied {} of {} shards of {} keys ({} of {} bytes "
      "of state; the others came in their owners' backup offers) from {} "
      "peer(s) in {:.3f} s, serving meanwhile",
      opt_.rank, job.shards_copied, job.shards, keys_.size(), job.bytes_copied,
      job.state_bytes, job.manifests.size(),
      std::chrono::duration<double>(Clock::now() - job.start).count());
  join_copy_.reset();
}

void ProxyImpl::TellJoinDone(const JoinCopy& job) {
  for (auto& [p, man] : job.manifests) {
    auto c = PeerClient(p);
    if (!c.ok()) continue;  // gone: it frees its offer with the link
    Message done;
    done.type = Type::kJoinDone;
    (*c)->Send(static_cast<uint16_t>(Type::kJoinDone), proto::Encode(done),
               [](const Status&, std::span<const uint8_t>) {});
  }
}

Result<StateManifest> ProxyImpl::FetchPeerManifest(uint32_t p) {
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
      std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(r.text.data()),
                               r.text.size()),
      r.version, p, kIoTimeout);
}

void ProxyImpl::OnJoinRequest(uint64_t conn, Conn& c, const Message& m) {
  if (m.type == Type::kJoinDone) {
    join_snapshots_.erase(conn);
    return Reply(conn, m.type, m.id, Status::Ok());
  }
  if (m.rank != c.rank) {
    return Reply(conn, m.type, m.id,
                 InvalidArgumentError("a proxy joins as its own rank"));
  }
  std::vector<StateOffer::Item> items;
  std::vector<HeldKey> held;
  for (auto& [k, key] : keys_) {
    if (!key.shards.empty()) {
      held.push_back(
          {k, static_cast<uint8_t>(key.dtype), key.bytes, key.shard_bytes});
    }
    for (uint32_t i = 0; i < key.shards.size(); ++i) {
      // (A shard this node is still copying itself has no state yet.)
      if (!key.shards[i].value || key.shards[i].copying) continue;
      // Of a striped key, every node has every shard's initial value, but
      // only the owner and its backup keep a shard current: a stale copy
      // offered as the newest would roll the shard back silently.
      if (key.striped && Owner(k, i) != opt_.rank &&
          !(BacksUp(key) && BackupOf(k, i) == opt_.rank)) {
        continue;
      }
      const Shard& sh = key.shards[i];
      // A round redone from the workers' held pushes if this node dies
      // (docs/design/ps.md, "Version notices"): the joiner, if it is the
      // shard's backup, takes its version only.
      const bool held_round =
          key.striped && BacksUp(key) && Owner(k, i) == opt_.rank &&
          key.opt.kind == proto::Optimizer::kNone && sh.round_held &&
          !sh.value_stale && !sh.written_since_offer;
      items.push_back({k, i, key.dtype, key.bytes, key.shard_bytes, &sh,
                       key.striped, held_round});
    }
  }
  auto offer = StateOffer::Make(*device_, opt_.rank, items, std::move(held));
  if (!offer.ok()) return Reply(conn, m.type, m.id, offer.status());
  const uint64_t n = (*offer)->manifest_bytes();
  auto d = (*offer)->descriptor();
  MEMBOX_LOG_WARN(
      "proxy {} at {} is joining (replacing the one that was there): "
      "offering it {} shards ({} bytes of state)",
      c.rank, opt_.peers[c.rank], (*offer)->shards(), (*offer)->state_bytes());
  join_snapshots_[conn] = std::move(*offer);
  Reply(conn, m.type, m.id, Status::Ok(), n, std::string(d.begin(), d.end()));
}

}  // namespace membox::ps::proxy_internal
