// The parameter proxy's implementation (include/membox/ps/proxy.h says what
// it does), split by job over several files that share this class:
//
//   proxy.cc           construction, the service plumbing (replies, worker
//                      memory), requests' dispatch, hang reports, stats
//   proxy_requests.cc  workers' requests: hello, configure, declare, tune,
//                      store, and the checks every shard request passes
//   proxy_rounds.cc    admission (AdmissionScheduler), local sum, the ring
//                      between proxies (RingProgress), apply, pulls
//   proxy_failover.cc  peers: links, death, replacement (join), catch-up,
//                      resume (state copies: src/ps/state_copy.h)
//   proxy_state.cc     checkpoints and restore (src/ps/checkpoint.h), and
//                      loading shards from a checkpoint or from peers
//
// The units with logic of their own live beside it with their own tests:
// storage.h (shards, copy-on-write, apply), scheduler.h, ring.h,
// round_gate.h (when a round starts, and what it waits for), local_sum.h
// (a round's sum of the pushes),
// checkpoint.h, state_copy.h, reduce.h, routing.h, peer_failover.h (what
// this node knows of its peers' deaths and replacements, and the
// decisions on them). What remains here is the orchestration of one
// node's state, on one event loop.
//
// Threading: everything runs on the service::Server's serial event loop
// (requests, peer notices, posted completions), so the members below the
// "Event-thread state" line need no locks; Stats/StatusText/Metrics read
// atomics and the mutex-guarded strings from any thread. Not for use
// outside src/ps (the public face is membox::ps::Proxy).
#ifndef MEMBOX_SRC_PS_PROXY_IMPL_H_
#define MEMBOX_SRC_PS_PROXY_IMPL_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <thread>
#include <tuple>

#include <fmt/format.h>

#include "membox/base/accumulate.h"
#include "membox/base/copy.h"
#include "membox/base/logging.h"
#include "membox/base/serial_worker.h"
#include "membox/ps/proxy.h"
#include "membox/ps/routing.h"
#include "membox/service/client.h"
#include "membox/service/server.h"
#include "membox/transport/device.h"

#include "src/ps/checkpoint.h"
#include "src/ps/combine.h"
#include "src/ps/local_sum.h"
#include "src/ps/peer_failover.h"
#include "src/ps/protocol.h"
#include "src/ps/reduce.h"
#include "src/ps/ring.h"
#include "src/ps/round_gate.h"
#include "src/ps/scheduler.h"
#include "src/ps/state_copy.h"
#include "src/ps/storage.h"

namespace membox::ps::proxy_internal {

using proto::Message;
using proto::Type;
using transport::Channel;
using transport::MemRegion;
using transport::RegionDescriptor;
using transport::RemoteMemRegion;
using Clock = std::chrono::steady_clock;

constexpr auto kPeerTimeout = std::chrono::seconds(30);
// How long a joining replacement tries to reach each peer: the survivors
// are up already, so one that does not answer by then is taken as dead too
// (its shards come from their other holders, or the join fails naming
// what no live peer holds).
constexpr auto kJoinPeerWait = std::chrono::seconds(3);
constexpr auto kIoTimeout = std::chrono::seconds(30);
// How long a ring step that failed on a link waits for that neighbour's
// loss to be reported before its round fails (ProxyImpl::SuspectRing).
constexpr auto kRingLossGrace = std::chrono::seconds(2);
// Free staging buffers of ring reads that sum, kept for the next reads
// (ProxyImpl::ReturnRingStaging): at most this many bytes.
constexpr uint64_t kRingStagingKeepBytes = 64 << 20;
// Per-worker limits (docs/design/network_face.md, "Limits"): regions it may
// register, registrations in flight, routing tables it may send and how far
// one may name more keys than the job declared, and how long a worker has
// to vouch for a region it registers.
constexpr size_t kMaxRegionsPerWorker = 4096;
constexpr size_t kMaxImportsPending = 8;
constexpr size_t kMaxRoutesPerWorker = 4096;
constexpr size_t kMaxRouteSlack = 1024;
constexpr auto kImportTimeout = std::chrono::seconds(10);

// One pushed contribution waiting for its round.
struct Contribution {
  uint64_t conn = 0;
  uint64_t id = 0;
  uint32_t rank = 0;
  uint64_t region = 0, offset = 0;
  bool has_output = false;
  uint64_t out_region = 0, out_offset = 0;
  // The round's result is already in the output (LocalSum wrote it there
  // with the sum); the reply is all that is left.
  bool output_written = false;
  // The worker holds this push until its next answer from this node
  // (kPush's `held`): a replacement can redo the round from it.
  bool held = false;
  // A held push sent again by a worker that had the round's result
  // (kPush's `had_result`): not read unless the round is summed.
  bool had_result = false;
  // Prefetched (pushes the proxy cannot map): read into the shard's inbox
  // for this rank as soon as admitted; `fetching` until the read is back.
  bool prefetched = false;
  bool fetching = false;
  bool read_issued = false;  // prefetched: the read has left the window
  Status fetched;
};

struct PendingPull {
  uint64_t conn = 0;
  uint64_t id = 0;
  uint64_t min_version = 0;
  uint64_t out_region = 0, out_offset = 0;
  Clock::time_point since{};
  proto::Part part = proto::Part::kValue;
};

// A shard of a key: what storage keeps (StoredShard), the round in
// progress and its ring.
struct Shard : StoredShard {
  // Synchronous round `version`: contributions by rank.
  std::map<uint32_t, Contribution> pushes;
  bool reducing = false;    // local sum done, ring running
  bool sum_scaled = false;  // LocalSum applied the average's 1/world
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
  // Primary-backup (a striped key on replicating nodes): the round just
  // applied here waits for its backup's copy before it is answered
  // (`reducing` stays set meanwhile, so the next round is not admitted),
  // and the buffers offered to the backup, kept until its kBackupDone.
  bool awaiting_backup = false;
  std::vector<std::shared_ptr<MemRegion>> backup_keep;
  // The owner's side of a step backup (kBackupStep): whether the backup
  // acknowledged this shard's current state (set by its kBackupDone,
  // cleared by anything that changes the state without a round: a
  // loaded value or moment, a backup replaced or an answer dropped), and
  // the step the round last applied here took (its settings as applied,
  // and the factor its sum was scaled by). With an optimizer and a backup
  // in step, a round offers its sum and step (n bytes) instead of the
  // value and moments (2n-3n).
  bool backup_synced = false;
  // A state written here (kStore) since the last backup offer: that
  // offer's kBackupDone does not put the backup in step (a round answered
  // first may take a loaded state dict before its backup has it).
  bool written_since_offer = false;
  // The round last applied here had every push held by its worker. Without
  // an optimizer its backup takes a version notice (kBackupVersion), not
  // the bytes; with one the round is answered before its backup has it
  // (`answered_early`; docs/design/ps.md, "Answer first"), and
  // `awaiting_backup` holds the next round until the backup's kBackupDone.
  bool round_held = false;
  bool answered_early = false;
  OptimizerSettings step_opt;
  double step_scale = 1;
  // A replacement's shard whose buffers are still being copied from a
  // peer (its version is known): requests for it wait (WaitForCopy).
  bool copying = false;
  // No push of the current job has reached this shard yet (set again when
  // every worker has left). See SkipToTheJobsRound.
  bool untouched_by_job = true;
  // A round given up (AbortRound, here or by a ring peer): its pushes, and
  // pulls waiting for it, fail with `aborted_why` instead of waiting for a
  // round that will not come. UINT64_MAX: none. Cleared when the job ends.
  uint64_t aborted_round = UINT64_MAX;
  Status aborted_why;
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
  // The job's scratch (kDeclare's `scratch`: a collective's sums and
  // exchanges): freed when the job ends (FreeScratch), left out of
  // checkpoints. Fixed by the first worker's Declare.
  bool scratch = false;
  // A scratch key: the workers of this job that declared it and have not
  // let it go (kFree). Emptied by kFree, the key is freed mid-job.
  std::set<uint32_t> holders;
  // SkipToTheJobsRound said so for a shard of this key in this job (it
  // says it once per key; set again when every worker has left).
  bool skip_logged = false;
  std::vector<Shard> shards;
  // In-memory combining (src/ps/combine.h), decided by the first kCombine
  // of the job and the same for every worker: the region and the round it
  // starts from, or why not. Reset when the job ends.
  bool combine_decided = false;
  std::string combine_refused;
  std::unique_ptr<MemRegion> combine;
  CombineGeometry combine_geometry;
  uint64_t combine_from = 0;
};

struct Conn {
  std::shared_ptr<Channel> channel;
  RouteHistory routes;  // the worker's tables (kRoute)
  // kObserver: `membox status` (a hello with world 0), kStats only.
  enum class Role { kUnknown, kClient, kPeer, kObserver } role = Role::kUnknown;
  uint32_t rank = 0;
  std::string name;
  std::map<uint64_t, std::shared_ptr<RemoteMemRegion>> regions;
  // Registrations being imported off the event loop (kRegion), and the
  // thread that imports them (created on first use).
  size_t imports_pending = 0;
  std::shared_ptr<SerialWorker> importer;
  // A worker rejoining after a failover, its state not fully replayed
  // (kRejoin .. kRejoined): no round that depends on it starts.
  bool replaying = false;
  // It said kRejoin: a worker of the job this node's predecessor served
  // (its held pushes redo a reopened round; SkipToTheJobsRound).
  bool rejoined = false;
  // Prefetch reads of this worker's pushes waiting for their key's read
  // window (ProxyOptions::read_window_shards), oldest first.
  struct WaitingRead {
    uint64_t key = 0;
    uint32_t shard = 0;
    uint64_t round = 0;
    bool held = false;  // has waited for the window (counted once)
  };
  std::deque<WaitingRead> reads_waiting;
};

// A replacement's background copy (ProxyImpl::Join, proxy_join.cc).
// What the copier threads work through. Built by Join on the event loop
// before the server serves; then the copiers read `manifests`, `channels`
// and `sources` (never changed again) and take work from `order` under
// `mu`, and the event loop only pushes to `urgent`.
struct JoinCopy {
  std::map<uint32_t, StateManifest> manifests;
  std::map<uint32_t, std::shared_ptr<Channel>> channels;
  // Per shard, the peers that hold its newest version (the first is tried
  // first; the next one after a failure).
  std::map<std::pair<uint64_t, uint32_t>,
           std::vector<std::pair<uint32_t, const OfferedShard*>>>
      sources;
  Clock::time_point start;
  uint64_t state_bytes = 0;
  size_t shards = 0;
  // What the copy itself installed (event loop only): the rest came first
  // in their owners' backup offers (InstallJoined).
  size_t shards_copied = 0;
  uint64_t bytes_copied = 0;
  Mutex mu;
  // Shards not copied yet, with the index of the source to try: the ones
  // this node owns first (a round waits for them; the ones it backs up
  // only restore redundancy), each part in key order; shards a request
  // waits for go before all of them.
  std::deque<std::pair<std::pair<uint64_t, uint32_t>, size_t>> order
      MEMBOX_GUARDED_BY(mu);
  std::set<std::pair<uint64_t, uint32_t>> urgent MEMBOX_GUARDED_BY(mu);
  // Shards the event loop has already (an owner's backup offer of a newer
  // round brought them): a copier drops them from `order` uncopied.
  std::set<std::pair<uint64_t, uint32_t>> installed MEMBOX_GUARDED_BY(mu);
  // Copier threads still working; the last one to find `order` empty
  // posts the end of the copy.
  std::atomic<int> copiers{0};
};

// Checkpoint names (a file name in the checkpoint directory): 1..128 of
// A-Z a-z 0-9 _ . -, not starting with '.'.
Status ValidateCheckpointName(const std::string& name);

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

  Status Init();

  std::string endpoint() const override { return endpoint_; }

  ProxyStats Stats() const override;

  std::string StatusText() const override;

  void Metrics(MetricsWriter& w) const override;

  Status Checkpoint(const std::string& name) override;

  void Stop() override;

 private:
  // ------------------------------------------------ service (proxy.cc)

  Status OnStart(transport::Device& device) override;

  void OnConnect(service::ConnectionId conn, const std::string&) override;

  void Post(std::function<void()> task) { server_->Post(std::move(task)); }

  // Answers request (method, id) of `conn`; an ok reply carries the
  // version (and the status text of kStats).
  void Reply(uint64_t conn, Type method, uint64_t id, const Status& s,
             uint64_t version = 0, std::string text = {});

  // A registered staging buffer of at least `bytes` (event thread only).
  Result<MemRegion*> Staging(uint64_t bytes);

  // The worker's registered region `region` if [offset, offset + len) lies
  // inside it; `what` ("input" / "output") names the side in errors.
  static Result<const RemoteMemRegion*> WorkerRange(const Conn& c,
                                                    uint64_t region,
                                                    uint64_t offset,
                                                    uint64_t len,
                                                    const char* what);

  // Resolves a worker's (region, offset, length) to something readable:
  // a mapped pointer, or the bytes read into `into` (registered).
  Result<const uint8_t*> ReadWorker(Conn& c, uint64_t region, uint64_t offset,
                                    uint64_t len, uint8_t* into,
                                    const MemRegion& into_region);

  Status WriteWorker(Conn& c, uint64_t region, uint64_t offset,
                     const uint8_t* src, uint64_t len,
                     const MemRegion& src_region);

  // Writes a round's result to a worker and replies once it is visible
  // there, without waiting on the event thread: the write and a flush are
  // issued, and the flush's completion posts the reply. The node's link then
  // carries this shard's results out while the next shard's pushes come in
  // (waiting here made every node use its link one direction at a time).
  // `src` is held until the write completes, so the value it points into is
  // copied on write meanwhile (Apply / LocalSum check use_count()).
  void WriteThenReply(uint64_t conn, Type method, uint64_t id, uint64_t region,
                      uint64_t offset, std::shared_ptr<MemRegion> src,
                      uint64_t len, uint64_t version);

  // Keeps a transfer's handle until it completes (a pending handle's
  // destructor would wait for it); completed ones are dropped here.
  void Track(transport::OpHandle h);

  // -------------------------------------------------- hangs (proxy.cc)

  // What shard s of key k waits for, or empty when it waits for nothing.
  std::string ExplainShard(uint64_t k, uint32_t s) const;

  // Logs every round (and pull) waiting longer than hang_report, once per
  // period each, and keeps the explanation -- with a summary of the job:
  // workers, versions -- for StatusText().
  void ReportWaits();

  // ----------------------------------------------- messages (proxy.cc)

  void OnRequest(const service::Request& r) override;

  void OnHello(uint64_t conn, Conn& c, const Message& m);

  void OnDisconnect(service::ConnectionId conn, const Status& why) override;

  // ------------------------------------------ peers (proxy_failover.cc)

  // Synchronous rounds need every proxy.
  // A peer that leaves while workers are connected is a failure of the job
  // (a warning); with no worker connected it is the end of one (the nodes of
  // a finished job stop one after another), so it is only noted.
  void PeerDown(uint32_t rank, const Status& why);

  // ---------------------------------------- failover (proxy_failover.cc)
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
                 const std::string& endpoint);

  // A peer restarted its rounds after `m.rank` (incarnation m.world) was
  // replaced. If we have not seen that yet, we pause now; its hello is on
  // its way.
  // Node-to-node messages need the node right (the cluster secret, or a
  // node credential). False: `what` was refused and the link closed.
  bool FromNode(uint64_t conn, const Conn& c, const Message& m,
                const char* what);
  // kWhere: where proxy m.rank listens now (workers, and standbys before
  // any hello).
  void Where(uint64_t conn, const Message& m);
  // A standby's kClaim (or its letting go) of a down peer's place.
  void OnClaim(uint64_t conn, Conn& c, const Message& m);
  // A standby lost its link to peer `rank` and claims its place, and this
  // proxy has no link to it (its jobs never needed one: an embedding-only
  // job): tries to reach it from here, off the event loop. Unreachable
  // too: it is down (PeerDown), and the standby's next claim is granted.
  // Reached: it is linked from now on, and the next claim refused. One
  // probe per peer at a time. Event loop.
  void ProbeClaimedPeer(uint32_t rank);
  void OnResume(uint32_t from, const Message& m);

  // Pauses every round until `rank` is back (PeerHello).
  void PeerLost(uint32_t rank, const std::string& who, bool any_client);

  // Whether ring notices from peer `rank` on `conn` count.
  bool PeerCurrent(uint32_t rank, uint64_t conn) const {
    return failover_.Current(rank, conn);
  }

  bool HasClients() const;

  // Called by ReportWaits: a peer not replaced in time fails the job.
  void CheckFailoverDeadline();

  // A synchronous round cannot finish once a worker or a proxy is gone: tell
  // everybody waiting instead of letting them hang.
  void FailPendingRounds(const std::string& who);

  // ------------------------------- workers' requests (proxy_requests.cc)

  // Everything a worker sends but its hello: pushes and pulls go on to
  // admission (proxy_rounds.cc); the rest is answered here.
  void OnClientMessage(uint64_t conn, Conn& c, Message m);
  // A kRegion's import finished (posted by the connection's importer).
  void RegionImported(uint64_t conn, uint64_t id, const RegionDescriptor& d,
                      const Result<std::shared_ptr<RemoteMemRegion>>& rr);

  // kStore: the worker's bytes replace the shard's value. They are read
  // into a buffer nobody else holds (the shard's scratch, or a new one) and
  // swapped in once whole, so a worker that dies in the middle leaves the
  // previous value. Over the network the read is not waited for on the
  // event loop (a state store is as large as a gradient push, and the
  // rounds go on meanwhile): its completion posts FinishStore and the
  // reply. Pulls waiting for a newer version are answered.
  void Store(uint64_t conn, Conn& c, const Message& m);

  // A store's bytes are all in `buf`: it becomes the shard's value (unless
  // a newer store already landed), the old value its scratch. Returns the
  // shard's version.
  Result<uint64_t> FinishStore(uint64_t k, uint32_t shard, uint64_t seq,
                               std::shared_ptr<MemRegion> buf,
                               proto::Part part = proto::Part::kValue);

  // The job-wide part of the configuration: the synchronisation mode and the
  // staleness bound. (Optimizers are per key: Declare / Tune.)
  Status Configure(const Message& m);

  // The round a worker's next push of `key` belongs to (striped keys: the
  // shards this proxy owns).
  uint64_t CurrentRound(uint64_t id, const Key& k) const;
  // What a declaration is answered with. A job that died may have
  // finished a round on some shards of a key only. A key with an
  // optimizer: the rounds every shard this proxy owns has completed (the
  // restarted workers redo that round; the shards that have it answer
  // with its result, RetriedRound). A key without: its round's sum is
  // gone with the job, and the newest shard's count is the next job's.
  uint64_t CompletedRounds(uint64_t id, const Key& k) const;

  // New hyperparameters for the declared keys in [m.key, m.key_end), from
  // the next round on (workers tune between rounds: after a step's results
  // are back, before the next step's pushes). All or nothing.
  Status Tune(const Conn& c, const Message& m);

  Result<uint64_t> Declare(Conn& c, const Message& m);

  // kCombine: offers the key's combining region (allocated on the first
  // request of the job), or says why not; every worker gets the same
  // answer.
  void Combine(uint64_t conn, const Message& m);
  // Why key `k` cannot be combined now, or empty.
  std::string CombineRefusal(uint64_t k, const Key& key) const;
  // The job ended: each combined key's last round becomes its stored value
  // and version, and its region is freed.
  void FoldCombined();
  // The job ended: its scratch keys are freed (their buffers go back to
  // the pool once nothing else holds them), except a key a replacement is
  // still copying (freed at a later job's end). Returns the bytes freed.
  uint64_t FreeScratch();
  // kFree: worker `c` lets these scratch keys go; a key no worker holds
  // any more is freed now if Quiet, else when the job ends. Refused, with
  // nothing changed, if a key named is not scratch. The reply's text says
  // how many were freed and how many wait.
  Result<std::string> Free(const Conn& c, const Message& m);
  // Whether nothing of this node's is under way on key `k`: no push, pull,
  // ring step, copy, backup, catch-up or queued request, no combining
  // region, no state offer to a replacement. Only such a key is freed
  // mid-job.
  bool Quiet(uint64_t k, const Key& key) const;
  // Forgets a key (its buffers go back to the pool once nothing else
  // holds them) and the ring notices parked for it; returns the next.
  std::map<uint64_t, Key>::iterator EraseKey(
      std::map<uint64_t, Key>::iterator it);

  // A push for the round just completed -- the answer is the current value:
  // that round's result, since the next one cannot have finished without
  // this worker. Two ways to get here: with replication, a worker whose
  // proxy died sends its push again to the replacement, which may hold the
  // round complete (a survivor finished it, and the replacement copied
  // that); and a restarted worker set pushes again the round its job died
  // in, which the dead workers finished on some shards of a key only.
  bool RetriedRound(uint64_t conn, const Message& m);
  // The other half of "a job that died may leave a key's shards one round
  // apart", for a striped key without an optimizer: every proxy reports
  // its own shards, and the restarted workers push the newest round
  // (ParamClient's Declare) -- also after a replacement copied a shard
  // from a backup that missed the dead owner's last, unanswered round. The
  // sum of a round nobody waits for any more is not needed, so the job's
  // first push of such a shard, if it is for a later round, moves the
  // shard to that round (as the unstriped keys' shards behind skip to the
  // newest when the job ends, OnDisconnect). Otherwise that push would
  // wait for a round nobody pushes.
  // `rejoined`: the push comes from a worker of the same job (Conn).
  void SkipToTheJobsRound(const Message& m, bool rejoined);

  Status CheckShardRequest(const Message& m);

  // ------------------------------------ scheduling (proxy_rounds.cc)

  // Admits queued pushes the shard's state and the scheduler allow.
  void Schedule();

  bool Admissible(const Conn& c, const Message& m);

  void Admit(uint64_t conn, Conn& c, const Message& m);

  // Starts reading a push the proxy cannot map (TCP, RMA) into the shard's
  // inbox as soon as the worker's read window has room, instead of when the
  // round starts: a node then reads the next shards' pushes while it writes
  // the last ones' results, and its link carries both directions at once.
  // The read's completion posts a task that marks it, refills the window
  // and retries the round's start.
  void Prefetch(uint64_t conn, uint64_t k, uint32_t s, Conn& c,
                Contribution& p);
  // Issues connection `conn`'s waiting reads, oldest first, while the
  // oldest is within its key's read window.
  void IssueReads(uint64_t conn, Conn& c);
  // IssueReads for every connection, from a posted task (a shard's
  // fetches finished: the key's read window moved).
  void IssueReadsSoon();
  // Whether shard `s` of striped key `k`, round `round`, is within
  // read_window_shards of the key's oldest shard still waiting for pushes
  // here: fewer than that many shards before it (this node's, in (round,
  // shard) order) have not started their sum. A worker whose stream runs
  // ahead waits there, and the link's share goes to the workers the round
  // waits for.
  bool WithinReadWindow(const Key& key, uint64_t k, uint64_t round,
                        uint32_t s) const;

  void Fetched(uint64_t k, uint32_t s, uint32_t rank, uint64_t round,
               const Status& st);

  // Whether worker `c`'s table sends (key, round) of a `bytes` shard here.
  // Without a table yet: unknown, treated as "here" (never assume a skip).
  bool RoutedHere(const Conn& c, uint64_t key, uint64_t bytes,
                  uint64_t round) const;

  // The proxy that owns shard s of a striped key.
  uint32_t Owner(uint64_t k, uint32_t s) const;

  // ------------------------------- primary-backup (proxy_failover.cc)
  //
  // With `replicate`, a striped shard lives on its owner and on a backup,
  // the next proxy in rank order: when the owner has applied a round it
  // offers the shard (value, optimizer state, version) to the backup, which
  // copies it (kBackup, kBackupDone) -- or, for a key with an optimizer and
  // a backup in step, the round's sum and step, which the backup repeats
  // (kBackupStep; kBackupWhole asks for the shard whole) -- and only then
  // are the round's workers answered. So a round acknowledged to any worker is
  // on two nodes, and the survivors of a death go on: the dead node's shards
  // are copied from their backups by its replacement (Join takes the newest
  // version any peer holds), its backup copies from their owners. A backup
  // that dies holds its owners' answers until its replacement -- which
  // copied the owners' state when it joined -- says hello; the offers are
  // then made again (docs/design/ps.md, "Primary-backup").

  // Whether a finished round of `key` must reach a backup first.
  bool BacksUp(const Key& key) const;
  // The backup of shard s of a striped key.
  uint32_t BackupOf(uint64_t k, uint32_t s) const;
  // Offers the shard's applied round to its backup (a held shard; sent when
  // the backup is up, else when its replacement says hello): the step
  // (kBackupStep) when the backup is in step and the round had an
  // optimizer, unless `whole`; else the shard whole (kBackup).
  void SendBackup(uint64_t k, uint32_t s, bool whole = false);
  // The backup side of an offer (kBackup, kBackupStep): the key, when
  // this proxy is the backup of m's shard and `from` its owner; else the
  // owner is told why not (kBackupDone with text) and it is null.
  const Key* OfferedToMe(uint32_t from, const Message& m);
  void RefuseBackup(uint32_t from, const Message& m, std::string why);
  // The backup side: copy the offered shard if it is newer (the reads in
  // flight while the event loop goes on), and answer.
  void OnBackup(uint32_t from, const Message& m);
  // A peer's region a backup copy reads (imported once per region: the
  // owner offers the same few buffers round after round).
  Result<std::shared_ptr<RemoteMemRegion>> ImportPeerRegion(
      uint32_t from, transport::Channel& channel, const RegionDescriptor& d);
  // The copy of OnBackup is done (or failed): keep it, answer the owner.
  void InstallBackup(uint32_t from, const Message& m, Result<CopiedShard>& got);
  // The backup side of a step offer: read the round's sum and apply the
  // owner's step to the previous round held here, or ask for the shard
  // whole (kBackupWhole) when this copy is not that round.
  void OnBackupStep(uint32_t from, const Message& m);
  void InstallBackupStep(uint32_t from, const Message& m,
                         Result<CopiedShard>& got);
  // The owner side: the backup cannot take the step; offer it whole.
  void OnBackupWhole(uint32_t from, const Message& m);
  // The backup side of a version notice: take the version, mark the value
  // stale, answer.
  void OnBackupVersion(uint32_t from, const Message& m);
  // The owner side: the backup holds round m.round; answer its workers.
  void OnBackupDone(uint32_t from, const Message& m);
  // The backup of shard (k, s)'s last round settled (acknowledged, or given
  // up): the round is answered now, or was when it was applied
  // (answered_early) and the next one may start.
  void BackupSettled(uint64_t k, uint32_t s);
  // ProxyOptions::ignore_backup_for_test says to drop this offer.
  bool IgnoreBackupForTest(const Message& m) const;

  // The round of shard s of key k as the start rule sees it
  // (src/ps/round_gate.h); `workers` holds the connected workers' part.
  RoundInputs RoundOf(uint64_t k, uint32_t s,
                      std::vector<RoundWorker>* workers) const;

  // Starts round `version` of a shard once every worker has pushed it here
  // or routes it elsewhere (no message needed: the proxies know every
  // worker's table). A proxy nobody pushes to joins the ring with zeros.
  // The rule is CheckRound's; ExplainShard words the same rule's answer.
  void MaybeStart(uint64_t k, uint32_t s);

  void MaybeStartAll();

  // ------------------------------------- reduction (proxy_rounds.cc)

  void StartReduce(uint64_t k, uint32_t s);

  // scratch <- sum of the pushes in rank order (zeros when every worker sent
  // this shard to another proxy), multiplied by `scale` (sets sh.sum_scaled
  // when scale != 1). `result_is_sum`: the round's result is this sum as
  // is (no ring, no optimizer); then the pushes whose output memory this
  // proxy maps get it in the summing pass (Contribution::output_written)
  // and PublishRound only replies to them.
  Status LocalSum(Key& key, Shard& sh, double scale, bool result_is_sum);

  // ------------------------------------------ ring (proxy_rounds.cc)

  RingGeometry RingFor(uint64_t k, uint32_t s) const;

  // The ring's reads and notices for shard s of key k.
  RingProgress::Io RingIo(uint64_t k, uint32_t s);

  // Starts the shard's ring for its current round, or runs the steps whose
  // notices are in; finishes the round when the sum is complete.
  void RunRing(uint64_t k, uint32_t s, bool start);

  void OnPeerNotice(const Message& m);

  // Step `step`: reduce-scatter (add the previous proxy's chunk) for the
  // first P-1 steps, all-gather (copy it) after. True when the chunk is in
  // place (the peer's memory is mapped here); false when its read is in
  // flight across a link: RingReadLanded goes on from it, and the event
  // loop serves meanwhile.
  Result<bool> RingRead(uint64_t k, uint32_t s, const RingGeometry& ring,
                        uint32_t step, const RegionDescriptor& desc);
  // dst <- dst + src (reduce) or src, `len` bytes of `dtype`, on the sync
  // cores.
  void RingChunkIn(DType dtype, bool reduce, uint8_t* dst, const uint8_t* src,
                   uint64_t len);
  // A registered buffer of at least `len` for a ring read that sums: one
  // of ring_staging_, or a new one (returned there when its read lands).
  Result<std::shared_ptr<MemRegion>> TakeRingStaging(uint64_t len);
  // Gives a staging buffer back to ring_staging_, which keeps at most
  // kRingStagingKeepBytes free (beyond that the buffer is freed).
  void ReturnRingStaging(std::shared_ptr<MemRegion> r);
  // A ring read in flight (ring_reads_, by its id): the shard, and the
  // buffers it writes into, held until it lands whatever becomes of its
  // round (Stop waits for the reads before it drops them).
  struct RingReadInFlight {
    uint64_t key = 0;
    uint32_t shard = 0;
    uint64_t epoch = 0;  // the shard's RingProgress::epoch() at the read
    bool reduce = false;
    uint64_t off = 0, len = 0;
    std::shared_ptr<MemRegion> into;     // staging (reduce) or the scratch
    std::shared_ptr<MemRegion> scratch;  // the shard's buffer of the round
    Clock::time_point deadline{};
    bool given_up = false;  // past its deadline: its round failed
  };
  // Ring read `id` landed (posted by its completion): add a sum's chunk,
  // tell the ring, and run it on. A stale one (its round stopped, or it
  // was given up) only gives its buffers back.
  void RingReadLanded(uint64_t id, const Status& st);
  // Gives up the ring reads past their deadline (ReportWaits' tick): their
  // rounds fail as a failed read fails them.
  void RingReadsOverdue();
  // A ring step that failed with UNAVAILABLE on a link whose loss is not
  // known yet (replicated jobs): a read from a neighbour killed a moment
  // ago can fail on its data channel before that neighbour's control link
  // reports the loss. The round is neither failed nor restarted until
  // either happens: the loss (PeerDown: the round restarts with the
  // survivors) or kRingLossGrace without it (AbortRound, as before).
  struct SuspectRing {
    uint64_t key = 0;
    uint32_t shard = 0;
    uint64_t version = 0;  // the shard's round
    uint64_t epoch = 0;    // its RingProgress::epoch() after the failure
    Status why;
    Clock::time_point deadline{};
  };
  // True (and PeerDown called) when one of the ring's neighbours has a
  // failed link: the failure `why` is that neighbour's death.
  bool RingNeighbourDown(const RingGeometry& ring, const Status& why);
  // ReportWaits' tick: decides the suspect rings whose neighbour's loss is
  // now known or whose grace has passed.
  void CheckSuspectRings();

  // Fails the round in progress of (k, s): its pushes and waiting pulls
  // get `why`, later requests of that round too (Shard::aborted_round).
  // With `tell_peers` (this proxy gave up on its own), the other proxies
  // of the ring are told (kRingAbort) and fail theirs instead of waiting.
  void AbortRound(uint64_t k, uint32_t s, const Status& why,
                  bool tell_peers = true);
  // A peer gave up round m.round of (m.key, m.shard) (kRingAbort).
  void OnRingAbort(uint32_t from, const Message& m);

  // The sum is complete in scratch: apply mode / optimizer, publish the new
  // version, answer the pushes and pulls, and admit the next round.
  // `apply` false: a reopened round every worker had the result of (see
  // StartReduce): the version moves on, the value stays stale.
  void FinishRound(uint64_t k, uint32_t s, bool apply = true);

  // The round's result is in storage (version bumped) or it failed with
  // `st`: answer its pushes and the pulls it satisfies, admit the next.
  void PublishRound(uint64_t k, uint32_t s, const Status& st);

  void ApplyAsync(uint64_t conn, Conn& c, Key& key, Shard& sh,
                  const Message& m);

  void ServePull(uint64_t k, Shard& sh, const PendingPull& p);

  void ServeWaitingPulls(uint64_t k, Shard& sh);

  // ------------------------------ loading shards (proxy_state.cc,
  //                                 proxy_failover.cc)

  // The shard `index` of key `k` as a record from a checkpoint or a peer
  // describes it: the key is created from the record's geometry when it is
  // new here, and must agree with it otherwise. Sets the shard's offset
  // and size; the caller fills the rest.
  Result<Shard*> PrepareShard(uint64_t k, uint32_t index, uint8_t dtype,
                              uint64_t key_bytes, uint64_t shard_bytes,
                              const std::string& path);

  // Every shard of every key has a value.
  Status CheckComplete(const std::string& path);

  Status LoadRecords(const std::vector<CheckpointShard>& shards,
                     const std::string& path);

  CopyAllocator CopyBuffers();

  // -------------------------------------- catch-up (proxy_failover.cc)

  // A peer died in the last step of a round that this proxy finished (it
  // had read every chunk) while peer `to` had not: `to` restarted the round
  // and announced it (round `round`), but nobody else runs that round any
  // more. Its result is this shard as it is now (the rounds after it wait
  // for `to`), so give it that: the shard in checkpoint format in a region
  // it reads (kCatchUp), kept until its kCatchUpDone.
  void SendCatchUp(uint32_t to, uint64_t k, uint32_t s, uint64_t round);

  // The result of the round this proxy restarted, from a peer that
  // finished it: take it as the round's result.
  void OnCatchUp(uint32_t from, const Message& m);

  // ------------------------------------------ joining (proxy_join.cc)

  // A replacement proxy (--join), before it serves: reads every peer's
  // manifest and picks, per shard, the newest version any peer holds
  // (with primary-backup its owner or its backup; a peer that finished a
  // ring round the others did not is ahead by one), spread round-robin
  // among the peers holding it. The shards get their geometry and version
  // now and their buffers later: the copy runs in the background once the
  // node serves (StartJoinCopy), so its pause does not grow with the
  // state. A request for a shard not copied yet waits for it, and moves it
  // to the front of the copy.
  Status Join();
  // Why peer `p` refused our kPeerHello, if it did (OK otherwise).
  Status HelloRefusal(uint32_t p);
  // After Serve: the copier threads start (no-op unless joining).
  void StartJoinCopy();
  // A copier thread: batches of shards from one peer each, read straight
  // into this node's buffers (CopyShards), installed on the event loop;
  // ProxyOptions::join_copy_threads of them take batches side by side.
  void RunJoinCopy(const std::shared_ptr<JoinCopy>& job);
  // A copier's shard from peer `from` lands (event loop).
  void InstallJoined(uint32_t from, CopiedShard& c);
  // Shard s of key k has its buffers: what waited for it goes on.
  void ShardCopied(uint64_t k, uint32_t s);
  // Parks `m` (a push, pull or store) when its shard is being copied.
  bool WaitForCopy(uint64_t conn, Message& m);
  // Parks a peer's ring notice for a shard being copied.
  void WaitForCopy(const Message& peer_notice);
  // No peer could give a shard: the job cannot go on.
  void JoinCopyLost(const std::string& why);
  void FinishJoinCopy(JoinCopy& job);
  // Lets the peers drop the snapshots they offered.
  void TellJoinDone(const JoinCopy& job);

  // Asks peer `p` for its state (kJoin) and reads the manifest it offers.
  Result<StateManifest> FetchPeerManifest(uint32_t p);

  // A joining peer asks for this proxy's state (kJoin): every shard in
  // checkpoint format in a region it reads, kept until kJoinDone or until
  // it disconnects.
  void OnJoinRequest(uint64_t conn, Conn& c, const Message& m);

  // ----------------------------------------- links (proxy_failover.cc)

  // The link to peer proxy `rank`, connected on first use (retrying while
  // the peer starts up). A link that was up and failed fails fast.
  // `wait`: how long to keep trying to connect to a peer not linked yet.
  Result<service::Client*> PeerClient(uint32_t rank,
                                      Clock::duration wait = kPeerTimeout);

  Result<std::shared_ptr<Channel>> PeerChannel(uint32_t rank);

  // Ring notices (kReady, kDone) travel as service notices.
  Status SendToPeer(uint32_t rank, const Message& m);

  // ---------------------------------------- checkpoints (proxy_state.cc)

  void StartCheckpoint(const std::string& name,
                       std::function<void(Status)> done);

  // Each proxy writes its own file: <dir>/proxy-<rank>-<name>.
  std::string CheckpointPath(const std::string& name) const;

  Status Restore();

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
  // Why a peer refused this proxy's kPeerHello (answered on a progress
  // thread): a joiner names it when it cannot copy from that peer.
  mutable Mutex refusals_mu_;
  std::map<uint32_t, Status> hello_refusals_ MEMBOX_GUARDED_BY(refusals_mu_);
  // Writes checkpoints one at a time, at most kMaxCheckpointsInFlight
  // queued (docs/design/network_face.md, "Limits").
  static constexpr size_t kMaxCheckpointsInFlight = 4;
  SerialWorker checkpoint_writer_{"checkpoint", kMaxCheckpointsInFlight};
  // ProbeClaimedPeer's connection attempts, and the peers being probed
  // (event loop).
  SerialWorker peer_prober_{"peer probes", proto::kMaxProxies};
  std::set<uint32_t> probing_;
  // A replacement's background copy (Join): its state, the copier, the
  // shards not copied yet and the requests waiting for them. Event loop.
  std::shared_ptr<JoinCopy> join_copy_;
  // The copier threads of join_copy_; joined by Stop (the event loop's
  // thread starts them, and only Stop touches them after that).
  std::vector<std::thread> join_copiers_;
  size_t copying_shards_ = 0;
  std::map<std::pair<uint64_t, uint32_t>,
           std::vector<std::pair<uint64_t, Message>>>
      copy_waiters_;
  std::map<std::pair<uint64_t, uint32_t>, std::vector<Message>> copy_notices_;

  // Event-thread state.
  std::map<uint64_t, Conn> conns_;
  std::map<uint32_t, std::unique_ptr<service::Client>> peer_out_;
  std::map<std::pair<uint32_t, uint64_t>, std::shared_ptr<RemoteMemRegion>>
      peer_regions_;
  std::map<uint64_t, Key> keys_;
  std::vector<Message> early_notices_;
  // Our state as given to joining peers, by their connection (OnJoinRequest).
  std::map<uint64_t, std::unique_ptr<StateOffer>> join_snapshots_;
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
  std::vector<RoundWorker> round_workers_;  // MaybeStart's, reused
  // Ring reads in flight, by (key, shard), and the free staging buffers of
  // ring reads that sum (RingRead).
  std::map<uint64_t, RingReadInFlight> ring_reads_;
  uint64_t next_ring_read_ = 0;
  std::vector<SuspectRing> suspect_rings_;  // CheckSuspectRings
  std::vector<std::shared_ptr<MemRegion>> ring_staging_;
  bool reissue_posted_ = false;          // IssueReadsSoon's task is queued
  std::atomic<uint64_t> reads_held_{0};  // ProxyStats::reads_held
  uint32_t world_ = 0;
  // The job of the workers connected now (their hellos' `job`; empty:
  // unnamed), while world_ != 0. Event loop only.
  std::string job_;
  // The principal whose job this proxy serves (set by the first worker's
  // hello; base/credential.h). Event loop only.
  std::string job_owner_;
  // A credential's job: the bytes its checkpoint files may hold here (0:
  // the cluster's, no limit) and what each name holds. Event loop only.
  uint64_t job_disk_quota_ = 0;
  std::map<std::string, uint64_t> checkpoint_bytes_;
  // Bytes of the combining regions the keys hold (Combine, FoldCombined).
  uint64_t combine_bytes_ = 0;
  bool configured_ = false;
  uint32_t staleness_ = 0;
  proto::Mode mode_ = proto::Mode::kSum;
  std::string dead_worker_;
  // Failover (replicate): peers' incarnations and links, who is down and
  // since when, whose notices wait for their kResume.
  PeerFailover failover_{
      opt_.rank,
      static_cast<uint32_t>(opt_.peers.empty() ? 1 : opt_.peers.size())};
  const uint32_t nonce_ = std::random_device{}();

  std::atomic<uint64_t> n_keys_{0}, n_shards_{0}, n_clients_{0}, rounds_{0},
      bytes_reduced_{0}, ring_steps_{0}, rejected_{0}, checkpoints_{0},
      result_bytes_{0}, waiting_rounds_{0}, failovers_{0}, peers_down_count_{0},
      stored_bytes_in_{0}, backup_bytes_in_{0}, backup_steps_{0},
      backups_acked_{0}, backups_pending_{0}, shards_copying_{0},
      version_notices_in_{0}, answered_early_{0}, join_state_bytes_{0},
      join_versions_only_{0}, redos_skipped_{0};
};

}  // namespace membox::ps::proxy_internal

#endif  // MEMBOX_SRC_PS_PROXY_IMPL_H_
