// The parameter proxy: rounds -- admission, local sum, the ring between
// proxies, apply, pulls (src/ps/proxy_impl.h).
#include "src/ps/proxy_impl.h"

namespace membox::ps::proxy_internal {

void ProxyImpl::Schedule() {
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

bool ProxyImpl::Admissible(const Conn& c, const Message& m) {
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
    uint64_t slowest = *std::min_element(sh.applied.begin(), sh.applied.end());
    return sh.applied[c.rank] <= slowest + staleness_;
  }
  return m.round == sh.version && !sh.reducing;
}

void ProxyImpl::Admit(uint64_t conn, Conn& c, const Message& m) {
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
  sh.pushes[c.rank].held = m.held;
  sh.pushes[c.rank].had_result = m.had_result;
  // A reopened round's push whose worker had the result: read only if the
  // round is summed after all (StartReduce).
  if (!(m.had_result && sh.value_stale)) {
    Prefetch(conn, m.key, m.shard, c, sh.pushes[c.rank]);
  }
  MaybeStart(m.key, m.shard);
}

void ProxyImpl::Prefetch(uint64_t conn, uint64_t k, uint32_t s, Conn& c,
                         Contribution& p) {
  Shard& sh = keys_[k].shards[s];
  auto it = c.regions.find(p.region);
  if (it == c.regions.end() || it->second->mapped() || !c.channel) return;
  if (!WorkerRange(c, p.region, p.offset, sh.bytes, "input").ok()) {
    return;  // LocalSum reports it
  }
  p.prefetched = true;
  p.fetching = true;
  p.read_issued = false;
  c.reads_waiting.push_back({k, s, sh.version});
  IssueReads(conn, c);
}

void ProxyImpl::IssueReads(uint64_t conn, Conn& c) {
  // Pushes whose read could not start: read the slow way when the round
  // starts (LocalSum), so retry the start once the loop is done.
  std::vector<std::pair<uint64_t, uint32_t>> unfetched;
  while (!c.reads_waiting.empty()) {
    const Conn::WaitingRead w = c.reads_waiting.front();
    auto kit = keys_.find(w.key);
    Contribution* p = nullptr;
    Shard* sh = nullptr;
    if (kit != keys_.end() && w.shard < kit->second.shards.size()) {
      sh = &kit->second.shards[w.shard];
      auto pit = sh->pushes.find(c.rank);
      if (sh->version == w.round && pit != sh->pushes.end() &&
          pit->second.conn == conn && pit->second.prefetched &&
          pit->second.fetching && !pit->second.read_issued) {
        p = &pit->second;
      }
    }
    if (p == nullptr) {  // the round failed or ended meanwhile
      c.reads_waiting.pop_front();
      continue;
    }
    const Key& key = kit->second;
    if (key.striped && !WithinReadWindow(key, w.key, w.round, w.shard)) {
      if (!c.reads_waiting.front().held) {
        c.reads_waiting.front().held = true;
        reads_held_.fetch_add(1, std::memory_order_relaxed);
      }
      break;  // the key's window moves when a shard's sum starts
    }
    c.reads_waiting.pop_front();
    auto give_up = [&] {
      p->prefetched = false;
      p->fetching = false;
      unfetched.emplace_back(w.key, w.shard);
    };
    auto rr = WorkerRange(c, p->region, p->offset, sh->bytes, "input");
    if (!rr.ok() || !c.channel) {
      give_up();
      continue;
    }
    auto& buf = sh->inbox[p->rank];
    if (!buf || buf->size() < sh->bytes) {
      // (Read whole before it is used: p->fetched says so.)
      auto b = storage_->AllocateForOverwrite(sh->bytes);
      if (!b.ok()) {
        give_up();
        continue;
      }
      buf = std::move(*b);
    }
    const uint64_t k = w.key, round = w.round, bytes = sh->bytes;
    const uint32_t s = w.shard, rank = p->rank;
    auto h =
        c.channel->Read(buf->data(), *buf, (*rr)->address() + p->offset, **rr,
                        bytes, [this, k, s, rank, round](const Status& st) {
                          Post([this, k, s, rank, round, st] {
                            Fetched(k, s, rank, round, st);
                          });
                        });
    if (!h.ok()) {
      give_up();
      continue;
    }
    p->read_issued = true;
    Track(std::move(*h));
  }
  for (auto [k, s] : unfetched) MaybeStart(k, s);
}

void ProxyImpl::IssueReadsSoon() {
  if (reissue_posted_) return;
  reissue_posted_ = true;
  Post([this] {
    reissue_posted_ = false;
    for (auto& [id, c] : conns_) {
      if (!c.reads_waiting.empty()) IssueReads(id, c);
    }
  });
}

bool ProxyImpl::WithinReadWindow(const Key& key, uint64_t k, uint64_t round,
                                 uint32_t s) const {
  if (opt_.read_window_shards == 0) return true;
  // This node's shards of the key (Owner): every M-th from the first,
  // unless k + i wraps around (keys within a key's shard count of 2^64),
  // where the scan takes every shard and asks Owner.
  const uint32_t m = std::max<uint32_t>(1, nproxies_);
  const bool wraps = k > UINT64_MAX - key.shards.size();
  const uint32_t step = wraps ? 1 : m;
  uint32_t before = 0;
  for (uint32_t i = wraps ? 0
                          : static_cast<uint32_t>((opt_.rank + m - k % m) % m);
       i < key.shards.size(); i += step) {
    const Shard& o = key.shards[i];
    if (o.reducing || Owner(k, i) != opt_.rank) continue;
    if (o.version > round || (o.version == round && i >= s)) continue;
    if (++before >= opt_.read_window_shards) return false;
  }
  return true;
}

void ProxyImpl::Fetched(uint64_t k, uint32_t s, uint32_t rank, uint64_t round,
                        const Status& st) {
  auto kit = keys_.find(k);
  if (kit == keys_.end() || s >= kit->second.shards.size()) return;
  Shard& sh = kit->second.shards[s];
  auto it = sh.pushes.find(rank);
  if (sh.version != round || it == sh.pushes.end() || !it->second.fetching ||
      !it->second.read_issued) {
    return;  // the round failed or ended meanwhile
  }
  it->second.fetching = false;
  it->second.fetched = st.ok() ? Status::Ok() : st;
  MaybeStart(k, s);
}

bool ProxyImpl::RoutedHere(const Conn& c, uint64_t key, uint64_t bytes,
                           uint64_t round) const {
  const RoutingTable* t = c.routes.For(key, round);
  return !t || t->Route(bytes) == opt_.rank;
}

uint32_t ProxyImpl::Owner(uint64_t k, uint32_t s) const {
  return StripeOwner(k, s, nproxies_);
}

RoundInputs ProxyImpl::RoundOf(uint64_t k, uint32_t s,
                               std::vector<RoundWorker>* workers) const {
  const Key& key = keys_.at(k);
  const Shard& sh = key.shards[s];
  workers->clear();
  for (const auto& [id, c] : conns_) {
    if (c.role != Conn::Role::kClient) continue;
    RoundWorker w;
    w.rank = c.rank;
    w.name = c.name;
    w.replaying = c.replaying;
    auto p = sh.pushes.find(c.rank);
    if (p != sh.pushes.end()) {
      // A prefetched push still being read: Fetched() asks again.
      w.push = p->second.fetching ? RoundWorker::Push::kReading
                                  : RoundWorker::Push::kIn;
    }
    w.routes_here = c.routes.empty() || RoutedHere(c, k, sh.bytes, sh.version);
    workers->push_back(w);
  }
  RoundInputs in;
  in.synchronous = mode_ != proto::Mode::kAsync;
  in.world = world_;
  in.job_failed = !dead_worker_.empty();
  in.peers_down = !failover_.down().empty();
  in.nodes = nproxies_;
  // A key this job has not declared (kept from an earlier job, or
  // restored) has no round yet: its striping is decided by the
  // declaration, and a proxy must not join a ring for it before.
  in.declared = key.declared;
  in.striped = key.striped;
  in.owned_here = !key.striped || Owner(k, s) == opt_.rank;
  in.round = {k, s, sh.version};
  in.copying = sh.copying;
  in.reducing = sh.reducing;
  in.awaiting_backup = sh.awaiting_backup;
  in.workers = *workers;
  in.scheduler = &sched_;
  return in;
}

void ProxyImpl::MaybeStart(uint64_t k, uint32_t s) {
  if (mode_ == proto::Mode::kAsync || world_ == 0) return;  // the hot exit
  auto it = keys_.find(k);
  if (it == keys_.end() || s >= it->second.shards.size()) return;
  // A stored key has no rounds: a node no worker routes it to must not
  // start one (and sit in its ring, waiting for peers that never do).
  if (it->second.stored) return;
  if (CheckRound(RoundOf(k, s, &round_workers_)).ready()) StartReduce(k, s);
}

void ProxyImpl::MaybeStartAll() {
  for (auto& [k, key] : keys_) {
    for (uint32_t s = 0; s < key.shards.size(); ++s) MaybeStart(k, s);
  }
}

void ProxyImpl::StartReduce(uint64_t k, uint32_t s) {
  Key& key = keys_[k];
  Shard& sh = key.shards[s];
  // A round reopened from version notices (its owner died) whose every
  // worker had its result before the death: its sum feeds no later round
  // and nobody waits for it, so the workers' held pushes are not read
  // again. The version moves on; the value stays stale until the next
  // round (docs/design/ps.md, "Version notices").
  if (key.striped && key.opt.kind == proto::Optimizer::kNone &&
      sh.value_stale && !sh.pushes.empty() &&
      std::all_of(sh.pushes.begin(), sh.pushes.end(),
                  [](const auto& p) { return p.second.had_result; })) {
    redos_skipped_.fetch_add(1, std::memory_order_relaxed);
    sh.reducing = true;
    return FinishRound(k, s, /*apply=*/false);
  }
  // Where this node's sum is the round's result (one node, or a striped
  // key whose shard lives here alone), an average's 1/world is applied in
  // the summing pass on the sync cores, not in a pass of its own.
  const bool local_result = nproxies_ == 1 || key.striped;
  const double scale = local_result &&
                               key.opt.kind == proto::Optimizer::kNone &&
                               mode_ == proto::Mode::kAverage
                           ? 1.0 / world_
                           : 1.0;
  Status st = LocalSum(key, sh, scale,
                       local_result && key.opt.kind == proto::Optimizer::kNone);
  if (!st.ok()) {
    MEMBOX_LOG_WARN("key {} shard {}: {}", k, s, st.ToString());
    for (auto& [r, p] : sh.pushes) Reply(p.conn, Type::kPush, p.id, st);
    sh.pushes.clear();
    sh.first_push = {};
    return;
  }
  sh.reducing = true;
  if (key.striped) IssueReadsSoon();
  if (nproxies_ == 1 || key.striped) return FinishRound(k, s);
  RunRing(k, s, /*start=*/true);
}

Status ProxyImpl::LocalSum(Key& key, Shard& sh, double scale,
                           bool result_is_sum) {
  sh.sum_scaled = false;
  if (!sh.scratch || sh.scratch.use_count() > 1) {
    // Not zeroed: the sum writes every byte (zeros when nobody pushed).
    // Zeroing cost a pass over the shard per fresh scratch, on this
    // thread: every round where a step backup keeps the last one, and a
    // replacement's first rounds, where it faulted the pages in on one
    // core instead of in the sum on the sync cores.
    ASSIGN_OR_RETURN(sh.scratch, storage_->AllocateForOverwrite(sh.bytes));
  }
  // The pushes in rank order: in memory here (prefetched, or the worker's
  // memory mapped), or read when the sum gets to them.
  std::vector<PushInput> inputs;
  inputs.reserve(sh.pushes.size());
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
    PushInput in;
    if (p.prefetched) {
      RETURN_IF_ERROR(p.fetched);
      in.data = sh.inbox[r]->data();
    } else if (it->second->mapped()) {
      in.data = static_cast<const uint8_t*>(it->second->mapped()) + p.offset;
    } else {
      // (Clang 14 cannot capture a structured binding: its fields by value.)
      in.read = [this, &c, region = p.region, offset = p.offset,
                 bytes = sh.bytes](uint8_t* into,
                                   const MemRegion& into_region) {
        return ReadWorker(c, region, offset, bytes, into, into_region);
      };
    }
    if (result_is_sum && p.has_output) {
      // Where the sum is the result, the workers' mapped outputs get it in
      // the summing pass (one host: no second pass over the shard per
      // worker in PublishRound); the others get it there.
      auto rr = WorkerRange(c, p.out_region, p.out_offset, sh.bytes, "output");
      if (rr.ok() && (*rr)->mapped()) {
        in.output = static_cast<uint8_t*>((*rr)->mapped()) + p.out_offset;
      }
    }
    inputs.push_back(std::move(in));
  }
  ASSIGN_OR_RETURN(
      LocalSumDone done,
      SumPushes(*sync_, key.dtype, static_cast<uint8_t*>(sh.scratch->data()),
                *sh.scratch, sh.bytes, inputs, scale,
                [this](uint64_t n) { return Staging(n); }));
  if (done.outputs_written) {
    size_t i = 0;
    for (auto& [r, p] : sh.pushes) {
      if (inputs[i++].output) p.output_written = true;
    }
    result_bytes_.fetch_add(sh.bytes * done.outputs, std::memory_order_relaxed);
  }
  sh.sum_scaled = scale != 1.0;  // FinishRound does not scale again
  bytes_reduced_.fetch_add(sh.bytes * std::max<size_t>(1, sh.pushes.size()));
  return Status::Ok();
}

RingGeometry ProxyImpl::RingFor(uint64_t k, uint32_t s) const {
  return RingGeometry::For(nproxies_, opt_.rank, k, s);
}

RingProgress::Io ProxyImpl::RingIo(uint64_t k, uint32_t s) {
  RingProgress::Io io;
  io.read = [this, k, s](uint32_t step,
                         const RegionDescriptor& d) -> Result<bool> {
    Key& key = keys_[k];
    const RingGeometry ring = RingFor(k, s);
    if (opt_.before_ring_read_for_test) {
      RETURN_IF_ERROR(opt_.before_ring_read_for_test(
          k, s, key.shards[s].version, step, ring.prev));
    }
    return RingRead(k, s, ring, step, d);
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

void ProxyImpl::RunRing(uint64_t k, uint32_t s, bool start) {
  Shard& sh = keys_[k].shards[s];
  const uint64_t before = sh.ring.steps_done();
  const RingGeometry ring = RingFor(k, s);
  const RingProgress::Io io = RingIo(k, s);
  auto r =
      start ? sh.ring.Start(sh.version, ring, io) : sh.ring.Advance(ring, io);
  ring_steps_.fetch_add(sh.ring.steps_done() - before);
  if (!r.ok() && opt_.replicate) {
    // A link to a neighbour that failed: that peer is down (pause).
    if (RingNeighbourDown(ring, r.status())) return;
    if (r.status().code() == StatusCode::kUnavailable && sh.reducing) {
      // Perhaps a neighbour dying whose loss is not reported yet: wait
      // for it (CheckSuspectRings) before failing the round.
      const bool known = std::any_of(
          suspect_rings_.begin(), suspect_rings_.end(),
          [&](const SuspectRing& x) {
            return x.key == k && x.shard == s && x.version == sh.version &&
                   x.epoch == sh.ring.epoch();
          });
      if (!known) {
        MEMBOX_LOG_INFO(
            "key {} shard {} round {}: ring step failed ({}); waiting up to "
            "{} s for a neighbour's loss before failing the round",
            k, s, sh.version, r.status().ToString(),
            std::chrono::duration_cast<std::chrono::seconds>(kRingLossGrace)
                .count());
        suspect_rings_.push_back(
            SuspectRing{.key = k,
                        .shard = s,
                        .version = sh.version,
                        .epoch = sh.ring.epoch(),
                        .why = r.status(),
                        .deadline = Clock::now() + kRingLossGrace});
      }
      return;
    }
  }
  // Anything else fails this round.
  if (!r.ok()) return AbortRound(k, s, r.status());
  if (*r && sh.reducing) FinishRound(k, s);
}

bool ProxyImpl::RingNeighbourDown(const RingGeometry& ring, const Status& why) {
  for (uint32_t p : {ring.next, ring.prev}) {
    auto it = peer_out_.find(p);
    if (it != peer_out_.end() && !it->second->health().ok()) {
      PeerDown(p, why);
      return true;
    }
  }
  return false;
}

void ProxyImpl::CheckSuspectRings() {
  if (suspect_rings_.empty()) return;
  const auto now = Clock::now();
  std::vector<SuspectRing> due;
  std::erase_if(suspect_rings_, [&](const SuspectRing& x) {
    auto it = keys_.find(x.key);
    if (it == keys_.end() || x.shard >= it->second.shards.size()) return true;
    const Shard& sh = it->second.shards[x.shard];
    // The loss was reported meanwhile (PeerLost restarts the round), or the
    // round ended some other way: nothing left to decide.
    if (!sh.reducing || sh.version != x.version || sh.ring.running() ||
        sh.ring.epoch() != x.epoch) {
      return true;
    }
    due.push_back(x);
    return true;
  });
  for (const SuspectRing& x : due) {
    if (RingNeighbourDown(RingFor(x.key, x.shard), x.why)) continue;
    if (now < x.deadline) {
      suspect_rings_.push_back(x);  // neither yet: look again next tick
      continue;
    }
    AbortRound(x.key, x.shard, x.why);
  }
}

void ProxyImpl::OnPeerNotice(const Message& m) {
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
  if (sh.copying) {
    // A replacement still copying this shard: the notice counts once it
    // is here (a laggard's announcement needs its value for a catch-up).
    return WaitForCopy(m);
  }
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
      MEMBOX_LOG_WARN("peer sent a bad descriptor: {}", d.status().ToString());
      return;
    }
    sh.ring.OnReady(m.round, m.step, std::move(*d));
  } else {
    sh.ring.OnDone(m.round, m.step);
  }
  if (sh.reducing && sh.ring.running()) RunRing(m.key, m.shard, false);
}

Result<bool> ProxyImpl::RingRead(uint64_t k, uint32_t s,
                                 const RingGeometry& ring, uint32_t step,
                                 const RegionDescriptor& desc) {
  Key& key = keys_[k];
  Shard& sh = key.shards[s];
  const size_t es = DTypeSize(key.dtype);
  const bool reduce = ring.Reduces(step);
  auto [off, len] = RingChunk(sh.bytes, es, ring.P, ring.ChunkAt(step));
  if (len == 0) return true;
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
  if (rr->mapped()) {  // the peer's memory is mapped here: at once
    RingChunkIn(key.dtype, reduce, dst,
                static_cast<const uint8_t*>(rr->mapped()) + off, len);
    return true;
  }
  // Across a link: the read lands later (RingReadLanded) and the event
  // loop serves meanwhile. A sum reads into a staging buffer of its own
  // and adds it then; a copy reads into the shard's buffer. Both buffers
  // are held by the read until it lands, so a read that outlives its round
  // (the round stopped, or timed out) writes into memory no round uses.
  std::shared_ptr<MemRegion> into = sh.scratch;
  if (reduce) {
    ASSIGN_OR_RETURN(into, TakeRingStaging(len));
  }
  uint8_t* at = reduce ? static_cast<uint8_t*>(into->data()) : dst;
  const uint64_t id = ++next_ring_read_;
  ring_reads_[id] = RingReadInFlight{
      .key = k,
      .shard = s,
      .epoch = sh.ring.epoch(),
      .reduce = reduce,
      .off = off,
      .len = len,
      .into = into,
      .scratch = sh.scratch,
      // A chunk of a large key crosses a slow link while the workers'
      // pushes share it: 30 s plus a second per 4 MiB (a 4 MB/s floor)
      // before the read is given up, unless the options say otherwise.
      .deadline =
          Clock::now() + (opt_.ring_read_timeout.count() > 0
                              ? Clock::duration(opt_.ring_read_timeout)
                              : kIoTimeout + std::chrono::seconds(len >> 22))};
  auto h = ch->Read(at, *into, rr->address() + off, *rr, len,
                    [this, id](const Status& st) {
                      Post([this, id, st] { RingReadLanded(id, st); });
                    });
  if (!h.ok()) {
    if (reduce) ReturnRingStaging(std::move(into));
    ring_reads_.erase(id);
    return h.status();
  }
  Track(std::move(*h));
  return false;
}

void ProxyImpl::RingChunkIn(DType dtype, bool reduce, uint8_t* dst,
                            const uint8_t* src, uint64_t len) {
  if (reduce) {
    sync_->Run(dtype, dst, src, len / DTypeSize(dtype), 1.0);
  } else if (src != dst) {
    sync_->ParallelFor(len, 1 << 20, [&](size_t b, size_t e) {
      CopyPiece(dst + b, src + b, e - b, len);
    });
  }
}

Result<std::shared_ptr<MemRegion>> ProxyImpl::TakeRingStaging(uint64_t len) {
  for (auto it = ring_staging_.begin(); it != ring_staging_.end(); ++it) {
    if ((*it)->size() >= len) {
      std::shared_ptr<MemRegion> r = std::move(*it);
      ring_staging_.erase(it);
      return r;
    }
  }
  ASSIGN_OR_RETURN(
      auto r, device_->AllocateMemRegion(std::max<uint64_t>(len, 1 << 20)));
  return std::shared_ptr<MemRegion>(std::move(r));
}

void ProxyImpl::ReturnRingStaging(std::shared_ptr<MemRegion> r) {
  uint64_t held = r->size();
  for (const auto& f : ring_staging_) held += f->size();
  // A burst of large reads (many shards of a big key at once) would
  // otherwise keep its peak in registered memory for good.
  if (held > kRingStagingKeepBytes && !ring_staging_.empty()) return;
  ring_staging_.push_back(std::move(r));
}

void ProxyImpl::RingReadLanded(uint64_t id, const Status& st) {
  auto it = ring_reads_.find(id);
  if (it == ring_reads_.end()) return;
  if (opt_.lose_ring_read_for_test &&
      opt_.lose_ring_read_for_test(it->second.key, it->second.shard)) {
    return;  // as if it never landed: RingReadsOverdue gives it up
  }
  const RingReadInFlight read = std::move(it->second);
  ring_reads_.erase(it);
  // The staging buffer is free again, whatever became of the round.
  if (read.reduce) ReturnRingStaging(read.into);
  if (read.given_up) return;
  auto kit = keys_.find(read.key);
  if (kit == keys_.end() || read.shard >= kit->second.shards.size()) return;
  Shard& sh = kit->second.shards[read.shard];
  if (sh.ring.epoch() != read.epoch || !sh.ring.reading()) return;  // stale
  if (st.ok() && read.reduce) {
    RingChunkIn(kit->second.dtype, /*reduce=*/true,
                static_cast<uint8_t*>(read.scratch->data()) + read.off,
                static_cast<const uint8_t*>(read.into->data()), read.len);
  }
  sh.ring.ReadLanded(read.epoch, st);
  RunRing(read.key, read.shard, /*start=*/false);
}

void ProxyImpl::RingReadsOverdue() {
  const auto now = Clock::now();
  std::vector<RingReadInFlight> late;
  for (auto& [id, read] : ring_reads_) {
    if (read.given_up || read.deadline > now) continue;
    read.given_up = true;  // kept (with its buffers) until it lands
    late.push_back(read);
  }
  for (const RingReadInFlight& read : late) {
    auto kit = keys_.find(read.key);
    if (kit == keys_.end() || read.shard >= kit->second.shards.size()) continue;
    Shard& sh = kit->second.shards[read.shard];
    if (sh.ring.epoch() != read.epoch || !sh.ring.reading()) continue;
    sh.ring.ReadLanded(
        read.epoch,
        DeadlineExceededError(
            "ring read of " + std::to_string(read.len) + " bytes from proxy " +
            std::to_string(RingFor(read.key, read.shard).prev) + " timed out"));
    RunRing(read.key, read.shard, /*start=*/false);
  }
}

void ProxyImpl::AbortRound(uint64_t k, uint32_t s, const Status& why,
                           bool tell_peers) {
  Key& key = keys_[k];
  Shard& sh = key.shards[s];
  MEMBOX_LOG_WARN("key {} shard {} round {}: {}", k, s, sh.version,
                  why.ToString());
  Status st = UnavailableError("proxy ring failed: " + why.ToString());
  sh.aborted_round = sh.version;
  sh.aborted_why = st;
  if (tell_peers && !key.striped && nproxies_ > 1) {
    Message m;
    m.type = Type::kRingAbort;
    m.key = k;
    m.shard = s;
    m.round = sh.version;
    m.text = "proxy " + std::to_string(opt_.rank) + " gave up round " +
             std::to_string(sh.version) + ": " + why.ToString();
    for (uint32_t p = 0; p < nproxies_; ++p) {
      if (p == opt_.rank) continue;
      // A peer that cannot be told is down: its own failover handles it.
      if (Status sent = SendToPeer(p, m); !sent.ok()) {
        MEMBOX_LOG_DEBUG("proxy {}: ring abort not sent to proxy {}: {}",
                         opt_.rank, p, sent.ToString());
      }
    }
  }
  for (auto& [r, p] : sh.pushes) Reply(p.conn, Type::kPush, p.id, st);
  for (auto& p : sh.pulls) Reply(p.conn, Type::kPull, p.id, st);
  sh.pushes.clear();
  sh.pulls.clear();
  sh.reducing = false;
  sh.ring.Stop();
  sh.first_push = {};
}

void ProxyImpl::OnRingAbort(uint32_t from, const Message& m) {
  auto it = keys_.find(m.key);
  if (it == keys_.end() || m.shard >= it->second.shards.size()) return;
  Shard& sh = it->second.shards[m.shard];
  if (m.round < sh.version) return;  // a round this proxy finished
  const Status why = UnavailableError("proxy " + std::to_string(from) +
                                      " gave up the round: " + m.text);
  if (m.round == sh.version &&
      (sh.reducing || !sh.pushes.empty() || !sh.pulls.empty())) {
    return AbortRound(m.key, m.shard, why, /*tell_peers=*/false);
  }
  // Not started here yet: its pushes fail as they come.
  sh.aborted_round = std::min(sh.aborted_round, m.round);
  sh.aborted_why = UnavailableError("proxy ring failed: " + why.ToString());
}

void ProxyImpl::FinishRound(uint64_t k, uint32_t s, bool apply) {
  Key& key = keys_[k];
  Shard& sh = key.shards[s];
  const double scale =
      mode_ == proto::Mode::kAverage && !sh.sum_scaled ? 1.0 / world_ : 1.0;
  Status st = !apply ? Status::Ok()
                     : storage_->Apply(key.dtype, key.opt,
                                       key.opt.kind == proto::Optimizer::kNone
                                           ? Update::kReplace
                                           : Update::kOptimizer,
                                       sh, sh.scratch.get(), scale);
  sh.sum_scaled = false;
  sh.step_opt = key.opt;  // what a step backup repeats
  sh.step_scale = scale;
  // Every worker of the round holds its push: without an optimizer the
  // backup needs the version only (docs/design/ps.md, "Version notices");
  // with one the round is answered at once ("Answer first").
  sh.round_held = !sh.pushes.empty() &&
                  std::all_of(sh.pushes.begin(), sh.pushes.end(),
                              [](const auto& p) { return p.second.held; });
  if (st.ok()) {
    sh.version++;
    sh.value_stale = !apply;
  }
  if (st.ok() && BacksUp(key)) {
    SendBackup(k, s);
    // Answer first: the backup may then lag this round, which the
    // workers' held pushes redo on a replacement that copied the backup
    // (the next round waits for its kBackupDone: one round at most).
    if (sh.awaiting_backup && sh.round_held &&
        key.opt.kind != proto::Optimizer::kNone) {
      sh.answered_early = true;
      answered_early_.fetch_add(1, std::memory_order_relaxed);
      PublishRound(k, s, st);
    }
    return;
  }
  PublishRound(k, s, st);
}

void ProxyImpl::PublishRound(uint64_t k, uint32_t s, const Status& st) {
  Shard& sh = keys_[k].shards[s];
  sh.reducing = false;
  sh.first_push = {};
  auto pushes = std::move(sh.pushes);
  sh.pushes.clear();
  if (st.ok()) rounds_.fetch_add(1);
  for (auto& [r, p] : pushes) {
    if (opt_.drop_answer_for_test &&
        opt_.drop_answer_for_test(k, s, sh.version - 1, r)) {
      continue;
    }
    if (st.ok() && p.output_written) {
      Reply(p.conn, Type::kPush, p.id, st, sh.version);
    } else if (st.ok() && p.has_output) {
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

void ProxyImpl::ApplyAsync(uint64_t conn, Conn& c, Key& key, Shard& sh,
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

void ProxyImpl::ServePull(uint64_t k, Shard& sh, const PendingPull& p) {
  auto it = conns_.find(p.conn);
  if (it == conns_.end()) return;
  const std::shared_ptr<MemRegion>* src = &sh.value;
  const char* what = "value";
  switch (p.part) {
    case proto::Part::kValue:
      break;
    case proto::Part::kPrevious:
      // The value as of round p.min_version (PullAt): the current one, or
      // the one before the step that followed it.
      if (sh.version == p.min_version) break;
      if (sh.version != p.min_version + 1) {
        return Reply(p.conn, Type::kPull, p.id,
                     FailedPreconditionError(fmt::format(
                         "key {} shard is at version {}: its value as of "
                         "version {} is not kept",
                         k, sh.version, p.min_version)),
                     sh.version);
      }
      src = &sh.previous;
      what = "previous value (no optimizer step here since it started)";
      break;
    case proto::Part::kMoment1:
      src = &sh.m1;
      what = "optimizer state (no optimizer step yet)";
      break;
    case proto::Part::kMoment2:
      src = &sh.m2;
      what = "second moment (Adam's; none before its first step)";
      break;
  }
  if (!*src) {
    return Reply(p.conn, Type::kPull, p.id,
                 FailedPreconditionError("key " + std::to_string(k) +
                                         " shard has no " + what),
                 sh.version);
  }
  // Over the network the write is not waited for here (the flush's
  // completion replies): the node goes on summing pushes and serving other
  // pulls meanwhile, so its link carries both directions at once. The
  // buffer stays alive with the write; a later update copies on write.
  WriteThenReply(p.conn, Type::kPull, p.id, p.out_region, p.out_offset, *src,
                 sh.bytes, sh.version);
}

void ProxyImpl::ServeWaitingPulls(uint64_t k, Shard& sh) {
  if (keys_[k].awaiting_init || sh.value_stale) return;
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

}  // namespace membox::ps::proxy_internal
