// Parameter proxy + storage: the memory node's parameter-synchronisation
// service (seed 000 COARSE §III.C-F, §IV.A), run inside `membox serve`.
//
// Workers (ParamClient) push gradient shards and pull values. The proxy keeps
// one queue per worker (§III.F): a shard of round r is admitted as soon as it
// arrives, independently of what else is queued, so shards routed to
// different proxies in different orders cannot deadlock (the first-come-
// first-serve scheduler, kept for the test that shows the deadlock, admits
// only the oldest tensor). When every worker has pushed (or said it pushed
// elsewhere) round r of a shard, the sync cores sum the pushes -- reading
// them straight from the workers' registered memory, always in rank order so
// results are reproducible -- and, with several proxies, run a ring
// AllReduce (reduce-scatter + all-gather) with the other proxies; shards
// alternate between two ring directions so every link carries traffic both
// ways (§IV.A, Fig. 11). Storage then holds the new version of the shard
// (copy-on-write against snapshots) and the proxy writes it into the output
// buffers of the workers that asked.
//
// Modes: kSum / kAverage (synchronous), kAsync (each push applied on
// arrival; optional staleness bound: a worker more than `staleness` rounds
// ahead of the slowest waits in its queue). An optimizer on the node (SGD
// with momentum, Adam) turns pushed gradients into weight updates.
//
// Checkpoints: Checkpoint() (or a worker's request) snapshots every shard's
// current buffer (copy-on-write: later updates go to fresh buffers) and
// writes it in the background to <checkpoint_dir>/proxy-<rank>-<name>
// atomically (temporary file, fsync, rename, fsync of the directory) with
// checksums; `restore` loads and verifies it on start.
//
// Hangs explain themselves: a round waiting longer than hang_report is
// logged with who it waits for (workers, peer proxies, a declaration), and
// StatusText() carries the same lines.
//
// Parts with logic of their own are units in src/ps with transport-free
// tests: storage.h (buffers, copy-on-write, updates), scheduler.h
// (admission: per-client queues, FCFS), ring.h (the ring's geometry and
// step machine), checkpoint.h (the file format).
//
// Threading: the transport's progress thread queues messages; one event
// thread runs the state machine; the sync cores do the arithmetic.
// Start/Stop from one thread; Stats() from any thread.
#ifndef MEMBOX_PS_PROXY_H_
#define MEMBOX_PS_PROXY_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "membox/base/credential.h"
#include "membox/base/metrics.h"
#include "membox/base/status.h"

namespace membox::ps {

enum class Scheduler { kPerClientQueues, kFirstComeFirstServe };

struct ProxyOptions {
  std::string listen = "0.0.0.0:7310";
  std::string transports = "auto";
  std::string secret;  // required, >= 8 bytes
  // Admits (or refuses, e.g. revoked) principals; transport DeviceOptions.
  std::function<Status(const Principal&)> admit;
  // Every proxy's endpoint in ring order (this one included) and this
  // proxy's index in it. Empty: a single proxy.
  std::vector<std::string> peers;
  uint32_t rank = 0;
  int sync_cores = 2;
  Scheduler scheduler = Scheduler::kPerClientQueues;
  uint64_t max_bytes = 16ull << 30;  // storage limit (values + state)
  std::string checkpoint_dir;        // empty: checkpoints refused
  bool restore = false;  // load <checkpoint_dir>/proxy-<rank>-<restore_name>
  std::string restore_name = "latest.mbck";
  // A round (or pull) waiting longer than this is logged, once per period,
  // with what it waits for: the workers that have not pushed, the peer
  // proxy a ring step needs, rank 0's declaration. The same explanation is
  // in StatusText() (and so in a worker's view of a hang). Zero: never.
  std::chrono::milliseconds hang_report{10000};
  // Every proxy keeps every key's current value: keys are never striped
  // (a declaration asking for it is answered unstriped), so after each
  // round all proxies hold the same values, optimizer state and versions,
  // and any one of them can die without losing an acknowledged round.
  bool replicate = false;
  // How far one worker's reads of a striped key may run ahead here, in
  // shards: this proxy reads a worker's push of a shard only while fewer
  // than this many of the key's shards before it (this proxy's, in
  // (round, shard) order) still wait for their sum. Without it, TCP's
  // uneven share of a node's inbound link lets three workers' streams race
  // megabytes ahead while every sum waits for the fourth's (docs/design/
  // ps.md, "Read window"). It must cover a link's bandwidth-delay product
  // (the shard size is chosen for that). Zero: no limit.
  uint32_t read_window_shards = 4;
  // With replicate: how long rounds wait for a dead peer's replacement
  // before they fail.
  std::chrono::milliseconds failover_timeout{60000};
  // Replace a proxy that died: copy the state (values, optimizer state,
  // versions) from every peer, taking for each shard the newest version
  // any of them holds. The versions are known before it serves; the
  // buffers are copied while it serves (a request for a shard not copied
  // yet waits for it). The peers must be running.
  bool join = false;
  // Test hook: runs on the event loop before each ring read of shard
  // `shard` of `key`, round `round`, step `step`, from proxy `from`. Tests
  // use it to hold a proxy at a chosen point of a round (a peer dies
  // meanwhile), or to fail the read (an error it returns is the read's).
  // Unset in production.
  std::function<Status(uint64_t key, uint32_t shard, uint64_t round,
                       uint32_t step, uint32_t from)>
      before_ring_read_for_test;
  // A ring read across a link (a peer's memory not mapped here) that has
  // not landed after this fails its round, as a failed read does. 0: 30 s
  // plus a second per 4 MiB of the chunk (a 4 MB/s floor).
  std::chrono::milliseconds ring_read_timeout{0};
  // Test hook: runs on the event loop as each ring read across a link
  // lands; returning true loses the landing (a peer that never answers).
  // Unset in production.
  std::function<bool(uint64_t key, uint32_t shard)> lose_ring_read_for_test;
  // A replacement (`join`) copies its state in batches of at most this many
  // bytes while it serves; a request for a shard not copied yet waits for
  // it and moves it to the next batch.
  uint64_t join_batch_bytes = 32 << 20;
  // How many threads copy a join's batches at once (each batch from one
  // peer). On one host a read is a memcpy into fresh memory, which faults
  // its pages in: one thread per core copies that many batches at once.
  // 0: sync_cores.
  int join_copy_threads = 0;
  // Tests: called on the copier thread before each batch of a join's copy
  // (to slow it down). Unset in production.
  std::function<void()> before_join_batch_for_test;
  // Tests: called on the copier thread with each batch it took, before it
  // copies it (key, shard). Unset in production.
  std::function<void(const std::vector<std::pair<uint64_t, uint32_t>>&)>
      join_batch_for_test;
  // Test hook: runs on the event loop before the answer of worker `rank`'s
  // push of round `round` of (key, shard) goes out; returning true drops
  // it (a node that died before that answer left). Unset in production.
  std::function<bool(uint64_t key, uint32_t shard, uint64_t round,
                     uint32_t rank)>
      drop_answer_for_test;
  // Test hook: runs on the event loop when an owner's backup offer of
  // (key, shard) at `version` arrives here; returning true ignores it (no
  // copy, no kBackupDone: a backup whose copy has not landed). Unset in
  // production.
  std::function<bool(uint64_t key, uint32_t shard, uint64_t version)>
      ignore_backup_for_test;
};

struct ProxyStats {
  uint64_t keys = 0;
  uint64_t shards = 0;
  uint64_t stored_bytes = 0;
  uint64_t clients = 0;
  uint64_t rounds_completed = 0;
  uint64_t bytes_reduced = 0;
  uint64_t ring_steps = 0;
  uint64_t queued_pushes = 0;
  uint64_t rejected = 0;
  uint64_t checkpoints = 0;
  // Push reads that waited for their key's read window (a worker's stream
  // ahead of the others': ProxyOptions::read_window_shards).
  uint64_t reads_held = 0;
  // Bytes of round results and pulls written to workers.
  uint64_t result_bytes = 0;
  // Primary-backup (replicate, striped keys): rounds of shards owned here
  // whose backup acknowledged its copy; bytes of state copied here as the
  // backup of other owners' shards; shards applied here that wait for
  // their backup's copy right now. Of the copies here, rounds taken as a
  // step (the owner's sum and step applied here: one shard's bytes read,
  // not its value and moments).
  uint64_t backups_acked = 0;
  uint64_t backup_bytes_in = 0;
  // Rounds of other shards backed up here by their version alone (every
  // worker held its push: kBackupVersion).
  uint64_t version_notices = 0;
  // Rounds of shards owned here answered before their backup had them
  // (every push held, the key with an optimizer: docs/design/ps.md,
  // "Answer first").
  uint64_t answered_early = 0;
  uint64_t backup_steps = 0;
  uint64_t backups_pending = 0;
  // A replacement (join): shards whose buffers are still being copied;
  // the bytes of state it copies (or copied) from its peers; the shards it
  // took as their version alone (its own whose last round the workers'
  // held pushes redo, those it backs up whose owner applied the last
  // round from held pushes, and, with three or more nodes, striped shards
  // other nodes own and back up).
  uint64_t shards_copying = 0;
  uint64_t join_state_bytes = 0;
  uint64_t join_versions_only = 0;
  // Reopened rounds (version notices) not summed again: every worker had
  // the result before the owner died.
  uint64_t redos_skipped = 0;
};

class Proxy {
 public:
  static Result<std::unique_ptr<Proxy>> Start(const ProxyOptions& options);
  virtual ~Proxy() = default;
  virtual std::string endpoint() const = 0;
  virtual ProxyStats Stats() const = 0;
  virtual std::string StatusText() const = 0;
  // Prometheus metrics: rounds, bytes, keys, storage, workers, queued and
  // waiting rounds, and the service layer's request metrics. Any thread.
  virtual void Metrics(MetricsWriter& w) const = 0;
  // Snapshots now and writes <checkpoint_dir>/proxy-<rank>-<name>; returns
  // when written.
  virtual Status Checkpoint(const std::string& name) = 0;
  virtual void Stop() = 0;
};

}  // namespace membox::ps

#endif  // MEMBOX_PS_PROXY_H_
