// KeyTable: what a parameter client knows of its keys and of the memory the
// proxies can reach, and the one rule that turns a submission into an
// operation (Op).
//
// Regions: the client's own (AllocateTensor) and the user's tensors
// (RegisterTensor, RegisterSharedTensor), by start address. Locate finds
// the region holding a range: the proxies read and write there directly.
// Other memory goes through the key's staging buffer ([in | out]).
// Keys: one KeyInfo per declared key (its size and shards, the rounds this
// worker issued, its declaration for a replacement proxy, its staging
// buffer and the operations using it).
// Prepare: checks a submission against its key, takes its round, decides
// where its data goes (registered memory in place, or the staging buffer --
// behind the operation still using it), and builds the Op with its
// completion state.
//
// Ownership: owns the regions and the staging buffers; drop it before the
// transport device. Threading: none of its own and no lock: the parameter
// client guards it with its mutex, which also guards the routing history
// Prepare consults through its Context. Completion: Prepare's Op completes
// through Op::state (the caller's callback, then -- for a staged operation
// -- Context::staging_freed).
#ifndef MEMBOX_SRC_PS_CLIENT_KEY_TABLE_H_
#define MEMBOX_SRC_PS_CLIENT_KEY_TABLE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <vector>

#include "membox/base/completion.h"
#include "membox/base/dtype.h"
#include "membox/base/status.h"
#include "membox/ps/routing.h"
#include "membox/service/call.h"
#include "membox/transport/mem_region.h"

#include "src/ps/client/sender.h"
#include "src/ps/protocol.h"

namespace membox::ps::client {

struct KeyInfo {
  uint64_t bytes = 0;
  DType dtype = DType::kFloat32;
  uint64_t shard_bytes = 0;
  uint32_t shards = 0;
  bool striped = false;        // shard s lives on its stripe owner
  bool stored = false;         // Store / Pull only, registered memory only
  proto::Message declaration;  // as sent (without initial values): failover
  uint64_t rounds = 0;         // pushes issued by this worker
  uint64_t base_version = 0;   // stored version when declared
  std::unique_ptr<transport::MemRegion> staging;    // [in | out], registered
  std::shared_ptr<service::CallState> last_staged;  // last op using staging
  std::shared_ptr<service::CallState> last_push;    // the latest push
  // Held pushes (Context::hold): [even rounds | odd rounds], registered.
  // A push's input is copied into its round's half and stays there until
  // the next push is answered: the node's replacement may need it again
  // (docs/design/ps.md, "Version notices").
  std::unique_ptr<transport::MemRegion> hold;
  // In-memory combining (src/ps/combine.h): asked once, after round 0; a
  // proxy that said yes to a key this worker could not then use fails its
  // operations (the other workers are combining it already).
  bool combine_asked = false;
  bool combined = false;  // the Combiner has it
  Status combine_error;
  // The round this worker's next push of the key is.
  uint64_t next_round() const { return base_version + rounds; }
};

class KeyTable {
 public:
  // ---------------------------------------------------------------- regions
  // Adds `r` (a user's tensor when `user`: it may be registered again or
  // unregistered; the client's own stay).
  void AddRegion(std::unique_ptr<transport::MemRegion> r, bool user);
  // Takes out the user regions overlapping [data, data + bytes): memory
  // registered again (a tensor that moved and came back). The caller drops
  // them outside its lock.
  std::vector<std::unique_ptr<transport::MemRegion>> TakeUserRegionsOverlapping(
      const void* data, size_t bytes);
  // Takes out the user region that starts at `data`; kNotFound otherwise.
  Result<std::unique_ptr<transport::MemRegion>> TakeUserRegion(
      const void* data);
  // The region holding [p, p + n), or nullptr.
  const transport::MemRegion* Locate(const void* p, size_t n) const;
  const std::map<uintptr_t, std::unique_ptr<transport::MemRegion>>& regions()
      const {
    return regions_;
  }

  // ------------------------------------------------------------------- keys
  KeyInfo* Find(uint64_t key);
  const KeyInfo* Find(uint64_t key) const;
  // Declares (or declares again) `key`.
  void Put(uint64_t key, KeyInfo k) { keys_[key] = std::move(k); }
  std::map<uint64_t, KeyInfo>& keys() { return keys_; }
  // The size of the staging buffer `key` needs for `in` / `out` (memory
  // the proxies cannot reach) and lacks; 0 when it needs none or has one
  // (or is not declared, or is stored: Prepare says why).
  uint64_t StagingNeeded(uint64_t key, const void* in, const void* out) const;
  // Gives `key` its staging buffer unless it has one (two submitters may
  // race to make it). Returns `r` when it was not taken: the caller drops
  // it outside its lock.
  std::unique_ptr<transport::MemRegion> SetStaging(
      uint64_t key, std::unique_ptr<transport::MemRegion> r);
  // Whether a push of `key` is held when the client holds pushes: a
  // striped key (primary-backup) not combined in a node's memory. Without
  // an optimizer the backup then takes the round's version only; with one
  // the owner answers before its backup has the round (docs/design/ps.md,
  // "Version notices", "Answer first").
  static bool Holdable(const KeyInfo& k);
  // The size of the hold buffer `key` needs and lacks (0: none).
  uint64_t HoldNeeded(uint64_t key) const;
  // As SetStaging, for the hold buffer.
  std::unique_ptr<transport::MemRegion> SetHold(
      uint64_t key, std::unique_ptr<transport::MemRegion> r);

  // -------------------------------------------------------------- operations
  struct Submission {
    proto::Type type = proto::Type::kPush;
    uint64_t key = 0;
    const void* in = nullptr;
    void* out = nullptr;
    int priority = 0;
    // A PullState / StoreState of that part of a key with an optimizer (no
    // round: the nodes' buffers as they are); at_version: PullAt's.
    std::optional<proto::Part> state;
    uint64_t at_version = 0;
  };
  struct Context {
    uint32_t proxies = 1;
    bool async = false;    // the job's mode: pulls wait for no round
    uint64_t seq = 0;      // the operation's submission number
    RoutingTable current;  // the routing table now
    // The table a push of round `round` of `key` follows (RouteHistory).
    std::function<RoutingTable(uint64_t key, uint64_t round)> route_for;
    std::function<void()> staging_freed;  // a staged op released its buffer
    std::function<void()> progress;       // drives the transport (waiters)
    // The nodes replicate and failover is on: pushes of Holdable keys are
    // held (their hold buffer made first: HoldNeeded / SetHold), and each
    // waits for the previous push's answer.
    bool hold = false;
  };
  // The operation for `s`, or why it cannot be (nothing changed then, and
  // `*cb` is left to the caller). On success `*cb` is moved into the Op's
  // state; the key's round and staging bookkeeping advance.
  Result<Op> Prepare(const Submission& s, const Context& c,
                     CompletionCallback* cb);

  // ------------------------------------------------ in-memory combining
  // (src/ps/combine.h; the attaching itself is combining.h's.)
  //
  // Whether `k` may be combined in a node's memory as far as this worker
  // can tell (the proxy decides): unstored, one shard, on its only node or
  // striped (one home), small, no optimizer; the job synchronous.
  static bool CombineCandidate(const KeyInfo& k, uint32_t proxies, bool async);
  // Asking the key's home node whether it combines the key: after round 0
  // (`last`, the push that must be done everywhere first).
  struct CombineAsk {
    std::shared_ptr<service::CallState> last;
    uint64_t bytes = 0;
    DType dtype = DType::kFloat32;
  };
  // Before a push or pull of `key` (`in`: the push's input): the key's
  // combining failure, if any; the ask when this is the first push of a
  // candidate after its round 0 (asked once); nullopt otherwise.
  Result<std::optional<CombineAsk>> BeforeCombining(proto::Type type,
                                                    uint64_t key,
                                                    const void* in,
                                                    uint32_t proxies,
                                                    bool async);
  // Whether `key`'s operations go to the Combiner.
  bool Combined(uint64_t key) const;
  // The attach's outcome: combined from now on, or failed (its operations
  // fail with `st` from now on: the other workers combine it already).
  void CombineAttached(uint64_t key, const Status& st);
  // A push of a combined key: its round (taken), or why it cannot be (the
  // key's combining failed; `in` or `out` in CUDA memory, which the node's
  // host memory cannot share).
  Result<uint64_t> TakeCombinedRound(uint64_t key, const void* in,
                                     const void* out);

  // Drops every key and region (the client is closing).
  void Clear();

 private:
  std::map<uintptr_t, std::unique_ptr<transport::MemRegion>> regions_;
  std::set<uintptr_t> user_regions_;
  std::map<uint64_t, KeyInfo> keys_;
};

}  // namespace membox::ps::client

#endif  // MEMBOX_SRC_PS_CLIENT_KEY_TABLE_H_
