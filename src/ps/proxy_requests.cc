// The parameter proxy: workers' requests other than pushes and pulls
// (src/ps/proxy_impl.h).
#include "src/ps/proxy_impl.h"

namespace membox::ps::proxy_internal {

void ProxyImpl::RegionImported(
    uint64_t conn, uint64_t id, const RegionDescriptor& d,
    const Result<std::shared_ptr<RemoteMemRegion>>& rr) {
  auto cit = conns_.find(conn);
  if (cit == conns_.end()) return;  // the worker left meanwhile
  Conn& c = cit->second;
  if (c.imports_pending > 0) --c.imports_pending;
  if (!rr.ok()) return Reply(conn, Type::kRegion, id, rr.status());
  // A worker's shared file at an address range an earlier one covered
  // replaces it (that memory was unregistered and freed or moved): unmap
  // the old file now rather than keep it alive with the link.
  for (auto it = c.regions.begin(); it != c.regions.end();) {
    const auto& od = it->second->descriptor();
    if (od.shared_file && od.address < d.address + d.length &&
        d.address < od.address + od.length) {
      it = c.regions.erase(it);
    } else {
      ++it;
    }
  }
  c.regions[d.region_id] = *rr;
  // version 1: mapped here (loads and stores), 0: reached by transfers
  Reply(conn, Type::kRegion, id, Status::Ok(),
        (*rr)->mapped() != nullptr ? 1 : 0);
}

void ProxyImpl::OnClientMessage(uint64_t conn, Conn& c, Message m) {
  switch (m.type) {
    case Type::kRegion: {
      auto d = RegionDescriptor::Deserialize(m.descriptor);
      if (!d.ok()) return Reply(conn, m.type, m.id, d.status());
      if (c.regions.size() + c.imports_pending >= kMaxRegionsPerWorker) {
        return Reply(conn, m.type, m.id,
                     ResourceExhaustedError(
                         "a worker may register at most " +
                         std::to_string(kMaxRegionsPerWorker) +
                         " regions with a memory node (kMaxRegionsPerWorker)"));
      }
      // Importing asks the worker to vouch for the region (a round trip):
      // never on the event loop, which a worker that does not answer would
      // hold. The connection's own importer thread does it, within
      // kImportTimeout, and posts the outcome back.
      if (!c.importer) {
        c.importer = std::make_shared<SerialWorker>("region registration",
                                                    kMaxImportsPending);
      }
      std::shared_ptr<Channel> ch = c.channel;
      const uint64_t id = m.id;
      Status queued = c.importer->Submit([this, ch, conn, id, desc = *d] {
        auto rr = ch->Import(desc, kImportTimeout);
        Post(
            [this, conn, id, desc, rr] { RegionImported(conn, id, desc, rr); });
      });
      if (!queued.ok()) return Reply(conn, m.type, m.id, queued);
      ++c.imports_pending;
      return;
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
        return Reply(conn, m.type, m.id, InvalidArgumentError("no such proxy"));
      }
      if (c.routes.size() >= kMaxRoutesPerWorker ||
          m.from_rounds.size() > keys_.size() + kMaxRouteSlack) {
        return Reply(conn, m.type, m.id,
                     ResourceExhaustedError(
                         "a worker may send at most " +
                         std::to_string(kMaxRoutesPerWorker) +
                         " routing tables, each naming at most its declared "
                         "keys (+" +
                         std::to_string(kMaxRouteSlack) + ")"));
      }
      RoutingTable table;
      table.threshold = m.threshold;
      table.lat_proxy = m.lat_proxy;
      table.bw_proxy = m.bw_proxy;
      c.routes.Add(table, std::map<uint64_t, uint64_t>(m.from_rounds.begin(),
                                                       m.from_rounds.end()));
      Reply(conn, m.type, m.id, Status::Ok());
      return MaybeStartAll();
    }
    case Type::kPush: {
      if (WaitForCopy(conn, m)) return;
      SkipToTheJobsRound(m, c.rejoined);
      if (RetriedRound(conn, m)) return;
      Status s = CheckShardRequest(m);
      if (!s.ok()) {
        MEMBOX_LOG_DEBUG("push from rank {} refused: {}", c.rank, s.ToString());
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
      if (WaitForCopy(conn, m)) return;
      Status s = CheckShardRequest(m);
      if (!s.ok()) return Reply(conn, m.type, m.id, s);
      Key& key = keys_[m.key];
      Shard& sh = key.shards[m.shard];
      PendingPull p{conn,         m.id,         m.min_version, m.out_region,
                    m.out_offset, Clock::now(), m.part};
      // Optimizer state and the previous value are read as they are now.
      // A stale value (a reopened round) waits for the round's redo.
      if ((sh.version >= p.min_version || m.part != proto::Part::kValue) &&
          !key.awaiting_init && !sh.value_stale) {
        return ServePull(m.key, sh, p);
      }
      if (!dead_worker_.empty()) {
        return Reply(conn, m.type, m.id, AbortedError(dead_worker_));
      }
      sh.pulls.push_back(p);
      return;
    }
    case Type::kStore:
      if (WaitForCopy(conn, m)) return;
      return Store(conn, c, m);
    case Type::kCombine:
      return Combine(conn, m);
    case Type::kFree: {
      auto freed = Free(c, m);
      return Reply(conn, m.type, m.id, freed.status(), 0,
                   freed.ok() ? *freed : std::string());
    }
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

void ProxyImpl::Store(uint64_t conn, Conn& c, const Message& m) {
  auto reply = [&](const Status& s, uint64_t v = 0) {
    Reply(conn, Type::kStore, m.id, s, v);
  };
  if (Status s = CheckShardRequest(m); !s.ok()) return reply(s);
  Key& key = keys_[m.key];
  // A key for rounds takes writes of its value or optimizer state (a
  // loaded state dict) when it has an optimizer, between its rounds.
  const bool state = !key.stored && key.opt.kind != proto::Optimizer::kNone;
  if (!key.stored && !state) {
    return reply(FailedPreconditionError(
        "key " + std::to_string(m.key) +
        " is not a stored key (declare it stored to write it with Store)"));
  }
  if (key.stored && m.part != proto::Part::kValue) {
    return reply(InvalidArgumentError("a stored key has no optimizer state"));
  }
  if (state &&
      (!key.shards[m.shard].pushes.empty() || key.shards[m.shard].reducing)) {
    return reply(FailedPreconditionError(
        "key " + std::to_string(m.key) +
        " is in a round: write its state between steps"));
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
    // Not zeroed: installed only once written whole (FinishStore).
    auto fresh = storage_->AllocateForOverwrite(sh.bytes);
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
    auto v = FinishStore(m.key, m.shard, seq, std::move(buf), m.part);
    return reply(v.status(), v.ok() ? *v : 0);
  }
  if (!c.channel) return reply(UnavailableError("worker link is gone"));
  auto r = c.channel->Read(
      dst, *buf, (*rr)->address() + m.offset, **rr, sh.bytes,
      [this, conn, id = m.id, k = m.key, shard = m.shard, seq, buf,
       part = m.part](const Status& st) {
        Post([this, conn, id, k, shard, seq, buf, st, part] {
          if (!st.ok()) return Reply(conn, Type::kStore, id, st);
          auto v = FinishStore(k, shard, seq, buf, part);
          Reply(conn, Type::kStore, id, v.status(), v.ok() ? *v : 0);
        });
      });
  if (!r.ok()) return reply(r.status());
  Track(std::move(*r));
}

Result<uint64_t> ProxyImpl::FinishStore(uint64_t k, uint32_t shard,
                                        uint64_t seq,
                                        std::shared_ptr<MemRegion> buf,
                                        proto::Part part) {
  auto it = keys_.find(k);
  if (it == keys_.end() || shard >= it->second.shards.size() ||
      it->second.shards[shard].bytes > buf->size()) {
    return AbortedError("key " + std::to_string(k) +
                        " was replaced while a store was in flight");
  }
  Key& key = it->second;
  Shard& sh = key.shards[shard];
  if (!key.stored) {
    // A loaded state: the round count stays (Adam's step is the version);
    // the value before the last step is no longer meaningful.
    if (seq > sh.stores_applied) {
      sh.stores_applied = seq;
      std::shared_ptr<MemRegion>& dst = part == proto::Part::kValue ? sh.value
                                        : part == proto::Part::kMoment1 ? sh.m1
                                                                        : sh.m2;
      dst = std::move(buf);
      sh.previous.reset();
      sh.backup_synced = false;  // the backup gets the shard whole next
      sh.written_since_offer = true;
    }
    return sh.version;
  }
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

Status ProxyImpl::Configure(const Message& m) {
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
            "averaging needs floating-point tensors (key " + std::to_string(k) +
            " is not)");
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

uint64_t ProxyImpl::CompletedRounds(uint64_t id, const Key& k) const {
  if (k.opt.kind == proto::Optimizer::kNone) return CurrentRound(id, k);
  std::optional<uint64_t> v;
  for (uint32_t s = 0; s < k.shards.size(); ++s) {
    if (!k.striped || Owner(id, s) == opt_.rank) {
      v = std::min(v.value_or(UINT64_MAX), k.shards[s].version);
    }
  }
  return v.value_or(0);
}

uint64_t ProxyImpl::CurrentRound(uint64_t id, const Key& k) const {
  if (!k.striped) return k.shards[0].version;
  uint64_t v = 0;
  for (uint32_t s = 0; s < k.shards.size(); ++s) {
    if (Owner(id, s) == opt_.rank) v = std::max(v, k.shards[s].version);
  }
  return v;
}

Status ProxyImpl::Tune(const Conn& c, const Message& m) {
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
            std::to_string(it->first) + " for round " + std::to_string(round) +
            ": rank " + std::to_string(r) + " set " + k.opt.ToString() +
            ", rank " + std::to_string(c.rank) + " asks for " +
            want.ToString());
      }
    }
  }
  if (!any) {
    return NotFoundError("no declared key in [" + std::to_string(m.key) + ", " +
                         std::to_string(m.key_end) + ")");
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

Result<uint64_t> ProxyImpl::Declare(Conn& c, const Message& m) {
  auto dt = static_cast<DType>(m.dtype);
  // A stored key is bytes the workers keep: any dtype; no sums.
  if (m.dtype < 1 || m.dtype > static_cast<uint8_t>(DType::kUInt8) ||
      (!m.stored && !AccumulateSupports(dt))) {
    return InvalidArgumentError("unsupported dtype for synchronisation");
  }
  size_t es = DTypeSize(dt);
  if (m.bytes % es != 0 || m.shard_bytes % es != 0) {
    return InvalidArgumentError("sizes must be multiples of the element size");
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
    if (k.declared && k.scratch != m.scratch) {
      return FailedPreconditionError(
          "key " + std::to_string(m.key) + " was declared " +
          (k.scratch ? "as the job's scratch"
                     : "as state kept for later jobs") +
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
      // Stored keys on replicating nodes go to every node (the client
      // sends every shard everywhere): no backup copy to wait for.
      if (m.striped && nproxies_ > 1 && !(opt_.replicate && m.stored)) {
        k.striped = true;
      }
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
      k.scratch = m.scratch;
    }
    k.declared = true;
    k.restored = false;  // adopted by this job
  } else {
    Key k;
    k.bytes = m.bytes;
    k.dtype = dt;
    k.shard_bytes = m.shard_bytes;
    k.striped = m.striped && nproxies_ > 1 && !(opt_.replicate && m.stored);
    k.opt = OptimizerSettings::From(m);
    k.stored = m.stored;
    k.scratch = m.scratch;
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
  if (k.scratch) k.holders.insert(c.rank);
  // Initial values: rank 0's win, whatever the order declarations arrive
  // in; until rank 0 has declared, the key's pulls and pushes wait.
  if (!k.initialized && c.rank == 0) {
    if (m.has_input) {
      for (auto& sh : k.shards) {
        uint8_t* dst = static_cast<uint8_t*>(sh.value->data());
        ASSIGN_OR_RETURN(const uint8_t* src,
                         ReadWorker(c, m.region, m.offset + sh.offset, sh.bytes,
                                    dst, *sh.value));
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
  return CompletedRounds(m.key, k);
}

void ProxyImpl::SkipToTheJobsRound(const Message& m, bool rejoined) {
  auto it = keys_.find(m.key);
  if (it == keys_.end() || m.shard >= it->second.shards.size()) return;
  Key& key = it->second;
  Shard& sh = key.shards[m.shard];
  if (!sh.untouched_by_job) return;
  sh.untouched_by_job = false;
  // A round reopened by a replacement (version notices) is redone by the
  // job's workers, rejoining with their held pushes: a later round's push
  // among them is not a new job's. A new job (the workers restarted) has
  // no held pushes and skips it like any round nobody waits for.
  if (rejoined && sh.value_stale) return;
  if (mode_ == proto::Mode::kAsync || !key.striped || key.stored ||
      key.opt.kind != proto::Optimizer::kNone || m.round <= sh.version ||
      sh.reducing || sh.awaiting_backup || !sh.pushes.empty() ||
      Owner(m.key, m.shard) != opt_.rank) {
    return;
  }
  // Expected after a restart of the workers (a restore, or a backup that
  // took a round's version while the old workers' last round finished on
  // other shards only): not a fault, so said once per key, as information.
  if (!key.skip_logged) {
    key.skip_logged = true;
    MEMBOX_LOG_INFO(
        "key {}: this job's first pushes are for round {} and shard {} "
        "holds round {}; no worker of this job waits for the rounds "
        "between (the job before finished them on other shards only, or "
        "this node's copy came from a backup that took their versions), "
        "so the key's shards go on from the job's round",
        m.key, m.round, m.shard, sh.version);
  }
  sh.version = m.round;
}

bool ProxyImpl::RetriedRound(uint64_t conn, const Message& m) {
  if (mode_ == proto::Mode::kAsync) return false;
  auto it = keys_.find(m.key);
  if (it == keys_.end() || m.shard >= it->second.shards.size()) return false;
  Shard& sh = it->second.shards[m.shard];
  if (m.round + 1 != sh.version || !sh.value) return false;
  if (sh.value_stale) {
    // Only this node's version survived its predecessor's death (version
    // notices): the round's sum is gone. Every worker answered it is
    // past it, and one not answered holds its push of the round, which
    // the reopened round redoes -- so a push of the round before that
    // one is a held replay, answered without a result; with an output
    // it is a worker that broke the rule (ParamClient sends a held key's
    // next push only after the last one's answer).
    if (m.has_output) {
      Reply(conn, Type::kPush, m.id,
            DataLossError("round " + std::to_string(m.round) + " of key " +
                          std::to_string(m.key) + " shard " +
                          std::to_string(m.shard) +
                          " was answered to the other workers and its sum "
                          "is gone with the node that died; a held key's "
                          "push must wait for the previous push's answer"));
    } else {
      Reply(conn, Type::kPush, m.id, Status::Ok(), sh.version);
    }
    return true;
  }
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

Status ProxyImpl::CheckShardRequest(const Message& m) {
  auto it = keys_.find(m.key);
  if (it == keys_.end()) {
    return NotFoundError("key " + std::to_string(m.key) + " not declared");
  }
  if (m.shard >= it->second.shards.size()) {
    return OutOfRangeError("shard index out of range");
  }
  const Shard& sh = it->second.shards[m.shard];
  if (sh.aborted_round != UINT64_MAX &&
      ((m.type == Type::kPush && m.round >= sh.aborted_round) ||
       (m.type == Type::kPull && m.part == proto::Part::kValue &&
        m.min_version > sh.aborted_round))) {
    return sh.aborted_why;  // waits for a round given up
  }
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

std::string ProxyImpl::CombineRefusal(uint64_t k, const Key& key) const {
  // With several nodes a small key is one striped shard, whose owner is
  // its home: the workers combine in that node's memory.
  if (nproxies_ != 1 &&
      !(key.striped && key.shards.size() == 1 && Owner(k, 0) == opt_.rank)) {
    return "the job has several memory nodes and the key is not one "
           "striped shard owned here";
  }
  // Replication does not refuse: a combined key has no optimizer, and a
  // round's result is in every worker's memory when it is answered (each
  // computes it), so a node's death loses no answered round. The region
  // stays mapped by the workers if its node dies.
  (void)opt_.replicate;
  if (mode_ == proto::Mode::kAsync) return "asynchronous mode";
  if (key.stored) return "a stored key";
  if (key.opt.kind != proto::Optimizer::kNone)
    return "the key has an optimizer";
  if (!CombineSizeFits(key.bytes, world_)) {
    return "larger than kMaxCombineBytes, or world * bytes larger than "
           "kMaxCombineRoundBytes";
  }
  if (key.shards.size() != 1) return "more than one shard";
  if (!AccumulateSupports(key.dtype)) return "dtype cannot be summed";
  if (mode_ == proto::Mode::kAverage && !SupportsAveraging(key.dtype)) {
    return "dtype cannot be averaged";
  }
  if (key.shards[0].version == 0) return "no round done yet";
  uint32_t workers = 0;
  for (const auto& [id, c] : conns_) {
    if (c.role != Conn::Role::kClient) continue;
    ++workers;
    if (!c.channel || c.channel->protocol() != transport::Protocol::kMapped) {
      return "worker rank " + std::to_string(c.rank) +
             " does not map this node's memory";
    }
  }
  if (world_ == 0 || workers != world_) {
    return "not every worker of the job is connected";
  }
  return {};
}

void ProxyImpl::Combine(uint64_t conn, const Message& m) {
  auto it = keys_.find(m.key);
  if (it == keys_.end() || !it->second.declared) {
    return Reply(
        conn, m.type, m.id,
        NotFoundError("key " + std::to_string(m.key) + " is not declared"));
  }
  Key& key = it->second;
  if (!key.combine_decided) {
    key.combine_decided = true;
    key.combine_refused = CombineRefusal(m.key, key);
    if (key.combine_refused.empty()) {
      CombineGeometry g;
      g.world = world_;
      g.bytes = key.bytes;
      g.dtype = key.dtype;
      g.average = mode_ == proto::Mode::kAverage;
      // Regions count against the node's storage limit with its values: a
      // job of many small keys cannot take more memory than that.
      if (storage_->stored_bytes() + combine_bytes_ + g.region_bytes() >
          storage_->max_bytes()) {
        key.combine_refused =
            "the node's storage limit leaves no room for "
            "the region";
        return Reply(conn, m.type, m.id, Status::Ok(), 0, key.combine_refused);
      }
      auto r = device_->AllocateMemRegion(g.region_bytes());
      if (!r.ok()) {
        key.combine_refused =
            "no memory for the region: " + std::string(r.status().message());
      } else if (!(*r)->device_allocated()) {
        key.combine_refused = "the region is not shareable";
      } else {
        InitCombineRegion((*r)->data(), g);
        combine_bytes_ += g.region_bytes();
        key.combine = std::move(*r);
        key.combine_geometry = g;
        key.combine_from = key.shards[0].version;
        MEMBOX_LOG_INFO(
            "key {}: combined in memory from round {} ({} bytes, "
            "{} workers)",
            m.key, key.combine_from, g.bytes, g.world);
      }
    }
  }
  if (!key.combine) {
    return Reply(conn, m.type, m.id, Status::Ok(), 0, key.combine_refused);
  }
  auto d = key.combine->Export().Serialize();
  Reply(conn, m.type, m.id, Status::Ok(), key.combine_from,
        std::string(d.begin(), d.end()));
}

namespace {

// A fresh region of the device holding `bytes` of `src`. (In-process tests
// under TSan: the region may be mapped where a worker's freed one was, and
// this copy is then reported against that worker's writes, tests/tsan.supp.)
Result<std::unique_ptr<MemRegion>> CopyToFreshRegion(transport::Device& device,
                                                     const void* src,
                                                     size_t bytes) {
  auto r = device.AllocateMemRegion(bytes);
  if (r.ok()) std::memcpy((*r)->data(), src, bytes);
  return r;
}

}  // namespace

void ProxyImpl::FoldCombined() {
  for (auto& [k, key] : keys_) {
    if (key.combine && key.shards.size() == 1) {
      Shard& sh = key.shards[0];
      std::vector<uint8_t> sum(key.bytes);
      auto last = FoldCombineRegion(key.combine->data(), key.combine_geometry,
                                    key.combine_from, sum.data());
      // Round r (numbered from 0) leaves version r + 1.
      if (last.ok() && *last >= key.combine_from && *last + 1 > sh.version &&
          sh.value && sh.value->size() >= key.bytes) {
        if (sh.value.use_count() > 1) {  // a reader holds it: a new region
          auto buf = CopyToFreshRegion(*device_, sum.data(), key.bytes);
          if (!buf.ok()) continue;  // the value stays at its last version
          sh.value = std::shared_ptr<MemRegion>(std::move(*buf));
        } else {
          std::memcpy(sh.value->data(), sum.data(), key.bytes);
        }
        sh.version = *last + 1;
      }
    }
    if (key.combine) combine_bytes_ -= key.combine_geometry.region_bytes();
    key.combine.reset();
    key.combine_decided = false;
    key.combine_refused.clear();
    key.combine_from = 0;
  }
}

}  // namespace membox::ps::proxy_internal
