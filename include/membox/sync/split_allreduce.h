// A float32 sum over the workers split between two paths at once -- seed
// 000's dual synchronisation (§III.F) inside one tensor: the first share/16
// of the tensor goes around the workers' own ring (collective::RingAllreduce)
// while the rest goes through the memory nodes (ps::ParamClient::PushPull).
// Where the nodes have fewer links than the workers (4 worker hosts, 2
// memory hosts), neither path alone uses every link, and the split's link
// bound is 0.8x the ring's (docs/design/backend.md, "Split all_reduce").
// The torch backend and the DDP hook split the same way, with the same rule
// (SplitShare; membox._core exposes it to Python).
//
//   SplitShare     the ring's share, in sixteenths: where it starts (the
//                  links' balance), how it follows the two parts' measured
//                  times, and which calls must agree on it first. No I/O.
//   SplitAllreduce runs one split: PushPull of the tail (asynchronous), the
//                  ring over the head on the calling thread, both awaited;
//                  before a call that SplitShare says must agree, rank 0's
//                  share goes down the ring (Broadcast of 4 bytes), so
//                  every rank cuts alike.
//
// Ownership: SplitAllreduce borrows the client and the ring (they must
// outlive it); it owns its SplitShare and the table of tail keys it
// declared. Threading: one Allreduce at a time per SplitAllreduce, called in
// the same order with the same ids and sizes on every worker (the ring's
// rule). Completion: Allreduce is synchronous; it returns once `out` holds
// the sum (or the first error: then `out` is unspecified, and the ring may
// be unusable, see ring_allreduce.h).
#ifndef MEMBOX_SYNC_SPLIT_ALLREDUCE_H_
#define MEMBOX_SYNC_SPLIT_ALLREDUCE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <set>

#include "membox/base/status.h"

namespace membox::collective {
class RingAllreduce;
}
namespace membox::ps {
class ParamClient;
}

namespace membox::sync {

inline constexpr int kSplitSteps = 16;  // the share is a multiple of 1/16

// The ring's share, in sixteenths, that loads every link alike when all
// hosts' links have one rate. Per byte of the tensor the ring moves
// 2(p-1)/p bytes each way over each worker's link; the nodes' path moves 1
// over each worker's link and p/m over each node's (p workers, m nodes,
// striped). With p <= m the nodes alone are fastest (0); else the links
// balance at ring/nodes = (p/m - 1) p / (2 (p - 1)): 6 for 4 workers and
// 2 nodes. At most kSplitSteps - 1.
int FirstSplitShare(int workers, int nodes);

// The share of the next split after one at `share` whose ring part took
// `ring_s` and nodes part `nodes_s` seconds (measured while both ran, so a
// shared link shows in both): the share at which both take equally long,
// reached at once when within two sixteenths, half way when further, not
// moved within half a sixteenth (each new cut is a new key on the nodes,
// touched afresh). 0 stays 0 (the nodes alone were chosen).
int NextSplitShare(int share, double ring_s, double nodes_s);

// The share of each split of one job, and when the ranks must agree on it.
// Every rank keeps one and feeds it the same calls in the same order.
// value() is the share every rank cuts at; it changes only by Agreed(),
// with rank 0's proposal() -- which Measured() moves on rank 0 -- so a
// split taken without agreement cuts alike everywhere.
class SplitShare {
 public:
  SplitShare(int rank, int first)
      : rank_(rank), value_(first), proposal_(first) {}
  int value() const { return value_; }
  // What rank 0 would have the next agreement set (elsewhere: value()).
  int proposal() const { return proposal_; }
  // Whether the next split must first agree on rank 0's proposal: not the
  // first (every rank starts from the same value), never once the nodes
  // alone were chosen (0 stays 0); else while the share still moves (until
  // it held for 4 agreements in a row) every split, then every 16th, so
  // that a drift in the links is still followed.
  bool MustAgree() const;
  // The next split's share is `value` (rank 0's proposal, received).
  void Agreed(int value);
  // Counts a split (at value()), agreed on or not.
  void Taken() { ++splits_; }
  // Rank 0, after a split at value(): what each part took; moves the
  // proposal (NextSplitShare). Ignored on the other ranks.
  void Measured(double ring_s, double nodes_s);

 private:
  int rank_;
  int value_;
  int proposal_;
  uint64_t splits_ = 0;  // splits taken
  int held_ = 0;         // agreements in a row that left the value as it was
};

struct SplitOptions {
  int rank = 0;
  int world = 1;  // workers: the ring's and the client's
  int nodes = 1;  // memory nodes the tail is striped over
  // The tails' keys on the nodes: key_base + id * kSplitSteps + share, one
  // per (id, share), declared as the job's scratch on first use. Must not
  // meet the job's other keys.
  uint64_t key_base = uint64_t{3} << 60;
  // A tensor smaller than this goes to the nodes whole (a ring over small
  // chunks is latency, not bandwidth).
  size_t min_bytes = 4u << 20;
  // The ring's RingOptions::max_bytes: the head goes round in pieces of at
  // most this.
  size_t ring_max_bytes = 64u << 20;
  // The ring's first share in sixteenths; -1: FirstSplitShare(world, nodes).
  int first_share = -1;
  // Whether the share follows the measured times (SplitShare); false keeps
  // the first share and never broadcasts.
  bool adapt = true;
  // The nodes' mode for the job: with kAverage (ParamClient::Configure)
  // their part comes back averaged, and the ring's part is divided to
  // match. Pass false for kSum.
  bool average = false;
};

class SplitAllreduce {
 public:
  // kInvalidArgument for a world or node count below 1, a rank outside the
  // world, a first share outside [0, kSplitSteps), or a null client / ring.
  static Result<std::unique_ptr<SplitAllreduce>> Create(
      ps::ParamClient* client, collective::RingAllreduce* ring,
      const SplitOptions& options);

  // out[i] <- sum (or average) over workers of in[i], i < count. `in` and
  // `out` (may be equal) are memory from the client's AllocateTensor or
  // RegisterTensor. `id` names the tensor (equal on every worker; at most
  // 2^54 - 1): its tails become the keys of SplitOptions::key_base.
  Status Allreduce(uint64_t id, const float* in, float* out, size_t count);

  // The share the next split cuts at unless an agreement moves it, in
  // sixteenths (equal on every rank).
  int share() const { return share_.value(); }
  // Splits run so far, and what the last one took on each path (seconds;
  // each from the split's start).
  uint64_t splits() const { return splits_; }
  double last_ring_seconds() const { return last_ring_s_; }
  double last_nodes_seconds() const { return last_nodes_s_; }

 private:
  SplitAllreduce(ps::ParamClient* client, collective::RingAllreduce* ring,
                 const SplitOptions& options, int first);
  Status RingPart(float* data, size_t count);

  ps::ParamClient* client_;
  collective::RingAllreduce* ring_;
  SplitOptions opt_;
  SplitShare share_;
  std::set<uint64_t> declared_;  // tail keys declared so far
  uint64_t splits_ = 0;
  double last_ring_s_ = 0, last_nodes_s_ = 0;
};

}  // namespace membox::sync

#endif  // MEMBOX_SYNC_SPLIT_ALLREDUCE_H_
