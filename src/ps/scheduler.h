// Admission of pushed shards into synchronous rounds (seed 000 COARSE
// §III.F). Pure logic: no transport, no clock, no threads.
//
// Every worker connection has its own queue of pushes not yet admitted. With
// per-client queues (COARSE's scheduler) any queued push whose round is
// current may be admitted, whatever is queued ahead of it, so shards routed
// to different proxies in different orders cannot deadlock. The first-come-
// first-serve scheduler, kept to show that deadlock (scheduler_test), works
// on one tensor at a time: the oldest one a push or a peer's ring notice
// named, until its round completes.
//
// Ownership and threading: owned by the proxy; every call on its event loop.
// queued() may be read from any thread.
#ifndef MEMBOX_SRC_PS_SCHEDULER_H_
#define MEMBOX_SRC_PS_SCHEDULER_H_

#include <atomic>
#include <compare>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <vector>

#include "membox/ps/proxy.h"

#include "src/ps/protocol.h"

namespace membox::ps {

// One round of one shard of a key.
struct ShardRound {
  uint64_t key = 0;
  uint32_t shard = 0;
  uint64_t round = 0;
  auto operator<=>(const ShardRound&) const = default;
};

class AdmissionScheduler {
 public:
  explicit AdmissionScheduler(Scheduler kind) : kind_(kind) {}
  AdmissionScheduler(const AdmissionScheduler&) = delete;
  AdmissionScheduler& operator=(const AdmissionScheduler&) = delete;

  Scheduler kind() const { return kind_; }

  // A push of connection `conn` waits for admission (FCFS: its tensor joins
  // the line).
  void Enqueue(uint64_t conn, proto::Message push);

  // A peer proxy is ready for round `t` (FCFS: the tensor joins the line as
  // if a push had named it).
  void PeerReady(const ShardRound& t);

  // Admits queued pushes until nothing changes: a push is admitted when
  // `ready(conn, push)` (the shard's state allows it: its round is current
  // and not being reduced, or the staleness bound) and, for a synchronous
  // round, the policy allows it (MayAdmit). `sync(push)` says whether the
  // push belongs to a synchronous round. `admit` may call Enqueue/Drain
  // again (re-entrancy is handled: the loop restarts).
  void Drain(const std::function<bool(uint64_t, const proto::Message&)>& ready,
             const std::function<bool(const proto::Message&)>& sync,
             const std::function<void(uint64_t, proto::Message)>& admit);

  // Whether the policy lets a push of round `t` in, and the round start.
  bool MayAdmit(const ShardRound& t) const;
  bool MayStart(const ShardRound& t) const { return MayAdmit(t); }

  // Round t.round of (key, shard) completed: the shard's rounds before
  // `next_round` leave the line.
  void Completed(uint64_t key, uint32_t shard, uint64_t next_round);

  // Removes connection `conn`'s queue; returns what was in it.
  std::deque<proto::Message> Remove(uint64_t conn);
  // Removes every queue (a failed job); returns (conn, push) pairs.
  std::vector<std::pair<uint64_t, proto::Message>> TakeAll();

  // What a connection has queued (for explanations of a wait).
  const std::deque<proto::Message>* queue(uint64_t conn) const;
  // The FCFS line, oldest first.
  const std::deque<ShardRound>& line() const { return line_; }

  uint64_t queued() const { return queued_.load(std::memory_order_relaxed); }

 private:
  void Join(const ShardRound& t);

  const Scheduler kind_;
  std::map<uint64_t, std::deque<proto::Message>> queues_;
  std::deque<ShardRound> line_;  // FCFS only
  std::atomic<uint64_t> queued_{0};
  bool draining_ = false, again_ = false;
};

}  // namespace membox::ps

#endif  // MEMBOX_SRC_PS_SCHEDULER_H_
