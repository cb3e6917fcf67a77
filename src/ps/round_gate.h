// When a synchronous round of a shard may start on this node, and what it
// waits for until then: the one rule the proxy starts rounds by
// (ProxyImpl::MaybeStart) and explains a wait by (ProxyImpl::ExplainShard,
// the hang reports and `membox status`). Before, each had its own copy of
// the rule, and the copies had drifted (the explanation did not know about
// a failed job, a failover pause, an undeclared key, or a single node with
// nothing pushed).
//
// Pure logic over a description the proxy fills in (RoundInputs): no
// transport, no clock, no threads. Ownership: the inputs are the caller's
// and only read during Check; the result owns its lists.
#ifndef MEMBOX_SRC_PS_ROUND_GATE_H_
#define MEMBOX_SRC_PS_ROUND_GATE_H_

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "src/ps/scheduler.h"

namespace membox::ps {

// One connected worker, as the round of one shard sees it.
struct RoundWorker {
  uint32_t rank = 0;
  std::string_view name;
  // Rejoining after a failover, its state not fully replayed (kRejoin ..
  // kRejoined): no round that depends on it starts.
  bool replaying = false;
  enum class Push {
    kNone,     // has not pushed this round here
    kReading,  // pushed; the node is still reading it (prefetch)
    kIn,       // pushed and ready to sum
  } push = Push::kNone;
  // Its routing table sends this round of the shard here, or it has sent
  // no table yet (unknown counts as here: never assume a skip). Unused for
  // striped keys, whose shards always go to their owner.
  bool routes_here = true;
};

// What the rule looks at: the job, the key, the shard and the workers.
struct RoundInputs {
  // The job.
  bool synchronous = true;  // not kAsync (asynchronous pushes apply alone)
  uint32_t world = 0;       // 0: no job configured
  bool job_failed = false;  // a worker died without failover
  // A peer node is down and rounds that run a ring between nodes pause
  // until its replacement (striped keys have no ring and go on).
  bool peers_down = false;
  uint32_t nodes = 1;
  // The key.
  bool declared = false;  // by a worker of this job
  bool striped = false;
  bool owned_here = true;  // striped: this node owns the shard
  // The shard.
  ShardRound round;              // key, shard, its current round
  bool copying = false;          // a replacement still copying it
  bool reducing = false;         // summing, in its ring, or being applied
  bool awaiting_backup = false;  // applied; its backup's copy is pending
  std::span<const RoundWorker> workers;  // connected workers, any order
  // The admission policy's word on starting this round (first-come-first-
  // serve: one tensor at a time). Asked only when nothing else waits.
  const AdmissionScheduler* scheduler = nullptr;
};

// What a round waits for. Empty (ready()) when it may start now.
struct RoundWait {
  enum class Blocker {
    kNone,
    kNoSyncJob,  // no job yet, or an asynchronous one
    kCopying,    // the replacement's copy of this shard
    kAwaitingBackup,
    kReducing,  // this round is running already
    kJobFailed,
    kPeersDown,      // a failover pause
    kUndeclared,     // not declared by this job yet
    kNotOwner,       // a striped shard of another node
    kWorkers,        // see the lists below
    kNothingPushed,  // a lone node with no push: no round to run
    kScheduler,      // behind an older tensor (FCFS); the last (DescribeWait)
  } blocker = Blocker::kNone;
  // kWorkers and the explanation: ranks that pushed; that must push here
  // and have not (with their names: views of RoundWorker::name, valid while
  // the inputs are); whose push is being read; that are not connected;
  // that are replaying their state.
  std::vector<uint32_t> pushed, reading, absent, replaying;
  std::vector<std::pair<uint32_t, std::string_view>> missing;

  bool ready() const { return blocker == Blocker::kNone; }
};

// The rule. A round may start when the job is synchronous and healthy, the
// shard is this node's, declared, idle and copied, every worker of the job
// is connected and not replaying, every push is read, every worker whose
// table sends the round here has pushed (a striped shard: every worker),
// something was pushed or other nodes take part, and the scheduler agrees.
RoundWait CheckRound(const RoundInputs& in);

// The wait in words, as the hang reports and `membox status` print it
// ("pushed by ranks 0 1; waiting for ranks 2 (worker-2)"); `ring` is the
// ring's own account, used when the round is reducing.
std::string DescribeWait(const RoundWait& w, const std::string& ring);

}  // namespace membox::ps

#endif  // MEMBOX_SRC_PS_ROUND_GATE_H_
