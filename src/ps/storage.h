// Parameter storage of a memory node (seed 000 COARSE §III.D): shard values,
// optimizer state and versions, the node's byte limit, copy-on-write against
// checkpoint snapshots, and the update a finished round applies (replace,
// add, or an optimizer step).
//
// Copy-on-write: a snapshot shares a shard's buffers (shared_ptr); Apply
// never writes into a buffer someone else holds, it copies it first. So a
// checkpoint writer reads a consistent version while training goes on.
//
// Ownership and threading: a ShardStorage belongs to one proxy and is used
// on its event loop; the arithmetic runs on the SyncCores passed in.
// stored_bytes() may be read from any thread. Buffers it allocated may
// outlive it only as long as the allocator's device does; buffers let go
// of are recycled (RegionRecycler) until CloseRecycling(), which the owner
// calls before the device goes.
#ifndef MEMBOX_SRC_PS_STORAGE_H_
#define MEMBOX_SRC_PS_STORAGE_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "membox/base/accumulate.h"
#include "membox/base/mutex.h"
#include "membox/base/status.h"
#include "membox/transport/mem_region.h"

#include "src/ps/checkpoint.h"
#include "src/ps/protocol.h"

namespace membox::ps {

// A key's optimizer and hyperparameters: fixed in kind by the first worker's
// Declare, hyperparameters changed by kTune between rounds.
struct OptimizerSettings {
  proto::Optimizer kind = proto::Optimizer::kNone;
  double lr = 0, momentum = 0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double weight_decay = 0;

  static OptimizerSettings From(const proto::Message& m) {
    return {m.optimizer, m.lr,  m.momentum,    m.beta1,
            m.beta2,     m.eps, m.weight_decay};
  }
  // Whether the kind keeps a second moment (m2).
  bool has_second_moment() const {
    return kind == proto::Optimizer::kAdam || kind == proto::Optimizer::kAdamW;
  }
  bool operator==(const OptimizerSettings&) const = default;
  std::string ToString() const;
};

// What a node stores for one shard of a key.
struct StoredShard {
  uint64_t offset = 0, bytes = 0;  // within the key
  uint64_t version = 0;            // rounds applied
  // value: the current parameters; scratch: where a round's sum is built
  // (swapped with value by a plain replace); m1 / m2: optimizer state;
  // previous: the value before the last optimizer step (the step writes
  // the new value there and swaps: no extra pass), for a restarted
  // worker that must recompute that step's other keys exactly.
  std::shared_ptr<transport::MemRegion> value, scratch, m1, m2, previous;
  // The version is newer than the value: a backup that took version
  // notices (kBackupVersion: a sum nobody's next round depends on), or a
  // replacement that reopened the round such a notice announced. Such a
  // value is never served; the next round applied here replaces it.
  bool value_stale = false;
};

// How a finished round changes a shard.
enum class Update {
  kReplace,  // value <- g (synchronous rounds without an optimizer)
  kAdd,      // value <- value + g (asynchronous pushes without one)
  kOptimizer,
};

// Buffers a node let go of, kept for the next allocation of the same size
// instead of being unregistered and unmapped: a replicated round allocates
// a shard-sized buffer on the owner and on its backup every round, and a
// fresh one costs its page faults and zeroing (a 32 MiB buffer: about as
// long as the round's own copies on one host). Holds at most `cap_bytes`;
// Close() frees what it holds and makes later Put()s refuse, so that no
// buffer outlives the device it was registered with.
// Thread-safety: every method may be called from any thread (a buffer's
// last holder may be the copier thread or a transport completion).
class RegionRecycler {
 public:
  explicit RegionRecycler(uint64_t cap_bytes) : cap_bytes_(cap_bytes) {}
  // Lowers the cap (never raises it); what is kept stays until taken.
  void LowerCap(uint64_t cap_bytes);
  // A kept buffer of exactly `bytes`, or null.
  std::unique_ptr<transport::MemRegion> Take(uint64_t bytes);
  // Keeps `r` (of `bytes`); false, leaving `r` to the caller, when closed
  // or full.
  bool Put(std::unique_ptr<transport::MemRegion>& r, uint64_t bytes);
  // Frees what it holds (a job ended: an idle node keeps nothing).
  void Clear();
  // Clear(), and Put() refuses from now on.
  void Close();
  uint64_t bytes() const;

 private:
  mutable Mutex mu_;
  uint64_t cap_bytes_ MEMBOX_GUARDED_BY(mu_);
  bool closed_ MEMBOX_GUARDED_BY(mu_) = false;
  uint64_t bytes_ MEMBOX_GUARDED_BY(mu_) = 0;
  std::multimap<uint64_t, std::unique_ptr<transport::MemRegion>> kept_
      MEMBOX_GUARDED_BY(mu_);
};

class ShardStorage {
 public:
  using Allocator =
      std::function<Result<std::unique_ptr<transport::MemRegion>>(uint64_t)>;

  // Buffers let go of are recycled up to `recycle_bytes` (RegionRecycler),
  // and never more than a quarter of the byte limit: recycled buffers are
  // not counted as stored, so a principal's quota bounds them too.
  ShardStorage(Allocator allocate, uint64_t max_bytes, SyncCores* cores,
               uint64_t recycle_bytes = kDefaultRecycleBytes)
      : allocate_(std::move(allocate)),
        max_bytes_(max_bytes),
        cores_(cores),
        recycler_(std::make_shared<RegionRecycler>(
            std::min(recycle_bytes, max_bytes / 4))) {}
  static constexpr uint64_t kDefaultRecycleBytes = 512ull << 20;

  // Frees the recycled buffers (a job ended), or (Close) also stops
  // recycling: before the allocator's device goes.
  void TrimRecycled() { recycler_->Clear(); }
  void CloseRecycling() { recycler_->Close(); }
  uint64_t recycled_bytes() const { return recycler_->bytes(); }
  ShardStorage(const ShardStorage&) = delete;
  ShardStorage& operator=(const ShardStorage&) = delete;

  // A zeroed buffer counted against the limit until its last holder drops
  // it. RESOURCE_EXHAUSTED past the limit.
  Result<std::shared_ptr<transport::MemRegion>> Allocate(uint64_t bytes);
  // The same without zeroing: for a buffer the caller overwrites whole
  // (a shard copied from a peer).
  Result<std::shared_ptr<transport::MemRegion>> AllocateForOverwrite(
      uint64_t bytes);
  // The same, for a buffer a copy fills next: a fresh one has its pages
  // faulted in with one call first (transport/huge_pages.h); a recycled
  // one has them already (populating it again costs about a tenth of the
  // copy).
  Result<std::shared_ptr<transport::MemRegion>> AllocateForCopy(uint64_t bytes);
  // Zeroed too, without touching fresh memory: the allocator's fresh
  // regions are new mappings, the kernel's zero pages until written, so
  // only a recycled buffer (which may hold an earlier job's bytes) is
  // cleared. For a value kept as its version only (`value_stale`), which
  // may never be written here: its pages cost neither the time to fault
  // them in nor memory.
  Result<std::shared_ptr<transport::MemRegion>> AllocateUntouched(
      uint64_t bytes);

  // Buffers for a new shard: a zeroed value.
  Status Create(StoredShard& sh, uint64_t offset, uint64_t bytes);

  // Applies a round: `g` holds the reduced tensor (scaled by `scale`
  // first). kReplace swaps `g`'s buffer in when `g` is the shard's scratch;
  // the others never write into a buffer a snapshot holds. Bumps nothing:
  // the caller publishes the version.
  Status Apply(DType dtype, const OptimizerSettings& opt, Update update,
               StoredShard& sh, transport::MemRegion* g, double scale);

  // Makes `buffer` this shard's own (a fresh copy when a snapshot holds it).
  Status Unshare(std::shared_ptr<transport::MemRegion>& buffer, uint64_t bytes);

  // A checkpoint record viewing the shard's buffers, and the buffers it
  // keeps alive until written.
  struct Snapshot {
    CheckpointShard record;
    std::vector<std::shared_ptr<transport::MemRegion>> keep;
  };
  static Snapshot Snap(uint64_t key, uint32_t index, DType dtype,
                       uint64_t key_bytes, uint64_t shard_bytes,
                       const StoredShard& sh);

  // Loads a checkpoint record into `sh` (offset and bytes already set):
  // value, optimizer state, version; a stale record (its version alone)
  // stays stale, its value untouched. DATA_LOSS when sizes disagree.
  Status Load(StoredShard& sh, const CheckpointShard& record);

  uint64_t stored_bytes() const { return stored_.load(); }
  uint64_t max_bytes() const { return max_bytes_.load(); }
  // Lowers the limit (never raises it) to a principal's quota; `why` names
  // it in the error of an allocation over the limit. Event loop only.
  void LimitTo(uint64_t bytes, std::string why) {
    if (bytes < max_bytes_.load()) {
      max_bytes_.store(bytes);
      limit_why_ = std::move(why);
      recycler_->LowerCap(bytes / 4);
    }
  }

 private:
  // A buffer from the recycler (`*recycled` true) or the allocator.
  Result<std::shared_ptr<transport::MemRegion>> Take(uint64_t bytes,
                                                     bool* recycled);
  Allocator allocate_;
  std::atomic<uint64_t> max_bytes_;
  std::string limit_why_ = "raise --ps-max-bytes";
  SyncCores* cores_;
  std::shared_ptr<std::atomic<uint64_t>> stored_counter_ =
      std::make_shared<std::atomic<uint64_t>>(0);
  std::atomic<uint64_t>& stored_ = *stored_counter_;
  // Shared with the buffers' deleters, which may run after this is gone.
  std::shared_ptr<RegionRecycler> recycler_;
};

}  // namespace membox::ps

#endif  // MEMBOX_SRC_PS_STORAGE_H_
