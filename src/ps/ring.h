// The ring AllReduce between proxies (seed 000 COARSE §IV.A, Fig. 11): the
// geometry (who is next, which chunk a step moves) and the per-shard step
// state machine. No transport: the proxy supplies the reads and the notices,
// so ring_test runs several proxies' state machines in one process.
//
// A shard's sum runs in 2(P-1) steps over P proxies: P-1 reduce-scatter
// steps (add the previous proxy's chunk) and P-1 all-gather steps (copy
// it). Step s of a proxy: it announces "my buffer is ready for step s"
// (kReady, to the next proxy), reads the previous proxy's chunk once that
// proxy announced the same step, tells it so (kDone), and moves on when the
// next proxy has read its own chunk (its kDone). Notices may arrive before
// the local round starts, or ahead of the local step: they are kept by
// (round, step). Shards alternate between the two ring directions so every
// link carries traffic both ways (Fig. 11b).
//
// Ownership and threading: a RingProgress belongs to one shard and is used
// on the proxy's event loop only. The geometry is a value.
#ifndef MEMBOX_SRC_PS_RING_H_
#define MEMBOX_SRC_PS_RING_H_

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>

#include "membox/base/status.h"
#include "membox/transport/mem_region.h"

namespace membox::ps {

struct RingGeometry {
  uint32_t P = 1;     // proxies in the ring
  uint32_t pos = 0;   // this proxy's position in the shard's direction
  uint32_t next = 0;  // rank this proxy announces to (and is read by)
  uint32_t prev = 0;  // rank this proxy reads from

  // The ring of shard `shard` of `key` seen from proxy `rank` of `P`.
  static RingGeometry For(uint32_t P, uint32_t rank, uint64_t key,
                          uint32_t shard);
  uint32_t steps() const { return 2 * (P - 1); }
  // Whether step `step` adds (reduce-scatter) or copies (all-gather).
  bool Reduces(uint32_t step) const { return step < P - 1; }
  // The chunk this proxy reads from `prev` at `step`.
  uint32_t ChunkAt(uint32_t step) const;
};

// Byte range (offset, length) of chunk `c` when `bytes` of `element_size`
// elements are split into P chunks of whole elements.
std::pair<uint64_t, uint64_t> RingChunk(uint64_t bytes, size_t element_size,
                                        uint32_t P, uint32_t c);

class RingProgress {
 public:
  struct Io {
    // Read prev's chunk for `step` (described by its buffer) into this
    // proxy's buffer: add it or copy it (RingGeometry::Reduces). True: the
    // data is in place. False: the read is in flight, and the proxy calls
    // ReadLanded with this ring's epoch() (as it was when read was called)
    // once the chunk is added or copied, or the read failed -- the event
    // loop is not held for a read across a slow link.
    std::function<Result<bool>(uint32_t step,
                               const transport::RegionDescriptor& prev_buffer)>
        read;
    std::function<Status(uint32_t step)> send_ready;  // to next
    std::function<Status(uint32_t step)> send_done;   // to prev
  };

  // Starts round `round` (the local sum is in the buffer): announces step 0
  // and runs what can run. Returns true when the ring is complete (P == 1).
  Result<bool> Start(uint64_t round, const RingGeometry& ring, const Io& io);

  // Notices from the neighbours, for any round (kept until used).
  void OnReady(uint64_t round, uint32_t step,
               transport::RegionDescriptor prev_buffer);
  void OnDone(uint64_t round, uint32_t step);

  // Runs every step whose notices are in (and whose read has landed). True
  // when the last step is done (the round's sum is complete in this
  // proxy's buffer). An error -- a failed read among them -- leaves the
  // ring stopped (Stop is implied).
  Result<bool> Advance(const RingGeometry& ring, const Io& io);
  // A read Io::read left in flight has landed (`st`: the chunk is in
  // place, or why not). Taken when `epoch` is still this ring's epoch and
  // a read is in flight; a stale one (the round stopped or started again
  // meanwhile) is dropped. Advance goes on from it.
  void ReadLanded(uint64_t epoch, Status st);
  // Changes whenever the round in progress ends, stops or starts: what a
  // read in flight is matched by.
  uint64_t epoch() const { return epoch_; }
  // A read of the current step is in flight (not landed yet).
  bool reading() const { return reading_ && !landed_; }

  bool running() const { return running_; }
  uint32_t step() const { return step_; }
  uint64_t round() const { return round_; }
  // Whether this proxy has read every chunk of the round in progress --
  // only its successor's last DONE is missing (or failed to go out): its
  // buffer holds the complete result. A neighbour that dies then cannot
  // change it, and a neighbour may already have finished the round.
  bool ReadsComplete(const RingGeometry& ring) const {
    return ring.steps() > 0 && step_ + 1 == ring.steps() && read_done_;
  }
  // Stops the round in progress (kept notices stay; a read in flight is
  // stale from now on).
  void Stop() {
    running_ = false;
    ForgetRead();
  }
  // Forgets everything (a job ended).
  void Reset();
  // What the step in progress waits for, for explanations of a wait.
  std::string Waiting(const RingGeometry& ring) const;
  // Steps completed over the life of this shard's ring.
  uint64_t steps_done() const { return steps_done_; }

 private:
  void ForgetRead() {
    reading_ = false;
    landed_.reset();
    ++epoch_;
  }

  bool running_ = false;
  uint64_t round_ = 0;
  uint32_t step_ = 0;
  bool read_done_ = false;
  uint64_t epoch_ = 0;
  bool reading_ = false;          // the step's read is in flight or landed
  std::optional<Status> landed_;  // ... and has landed, so
  uint64_t steps_done_ = 0;
  std::map<std::pair<uint64_t, uint32_t>, transport::RegionDescriptor> ready_;
  std::set<std::pair<uint64_t, uint32_t>> done_;
};

}  // namespace membox::ps

#endif  // MEMBOX_SRC_PS_RING_H_
