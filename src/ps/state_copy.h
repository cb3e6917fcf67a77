// Copying a proxy's shards to a peer without encoding them: what a
// replacement node (kJoin) and a lagging survivor (kCatchUp) read.
//
// The giver snapshots the shards it offers (StateOffer: references to the
// buffers, which copy-on-write keeps still while training goes on) and
// writes a small manifest -- per shard its key, geometry, version and the
// region descriptors of its value and optimizer state -- into a registered
// region. The taker reads the manifest (one read), parses it
// (ParseStateManifest: every field crosses a process boundary and is
// checked; fuzzed by fuzz/ps_state_manifest_fuzzer.cc), then reads each
// buffer it wants with one one-sided read straight into the buffer it
// keeps (CopyShards). Before, the giver encoded its whole state in
// checkpoint format (a copy and a CRC per byte, on its event loop) and the
// taker parsed and copied it once more: 9.4 s for 2 GiB of state here,
// where the reads alone took 3.4 s (docs/results/failures.md).
//
// Integrity: the manifest carries a CRC-32; the buffers cross the
// transport's reliable one-sided reads (UCX, or loads from a mapping on one
// host) and are not checksummed again -- a checkpoint file on disk is what
// needs checksums, memory-to-memory copies between authenticated peers do
// not.
//
// Format: docs/formats/ps_state_manifest.md.
//
// Ownership and threading: a StateOffer owns its manifest region and keeps
// the offered buffers alive; it belongs to the giving proxy's event loop and
// must outlive the taker's reads (the taker says when: kJoinDone,
// kCatchUpDone, or its link drops). CopyShards blocks the calling thread
// until every read finished; the buffers it returns are the caller's.
#ifndef MEMBOX_SRC_PS_STATE_COPY_H_
#define MEMBOX_SRC_PS_STATE_COPY_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "membox/base/status.h"
#include "membox/transport/channel.h"
#include "membox/transport/device.h"
#include "membox/transport/mem_region.h"

#include "src/ps/storage.h"

namespace membox::ps {

// One shard as the giver holds it.
struct OfferedShard : ShardHeader {
  uint64_t bytes =
      0;  // this shard's size: min(shard_bytes, key_bytes - offset)
  transport::RegionDescriptor value;
  std::optional<transport::RegionDescriptor> m1, m2;  // optimizer state
  // The giver holds the version only (StoredShard::value_stale): `value`
  // is not this version's and is not worth reading; the taker that owns
  // the shard redoes round version - 1 from the workers' held pushes.
  bool stale_value = false;
  // The key is striped: only the shard's owner and its backup keep it
  // current, so a joiner that is neither takes its version alone.
  bool striped = false;
  // The giver owns the shard and applied its last round from pushes every
  // worker holds, with no optimizer (and nothing stored into it since): a
  // taker that backs the shard up needs its version only, as a version
  // notice (kBackupVersion) would give it.
  bool held_round = false;
};

// The bytes of state a shard's buffers hold: its value and whichever
// optimizer moments it has.
inline uint64_t StateBytes(uint64_t shard_bytes, bool m1, bool m2) {
  return shard_bytes * (1 + (m1 ? 1 : 0) + (m2 ? 1 : 0));
}

// A key the giver holds, whether or not it offers any of its shards.
struct HeldKey {
  uint64_t key = 0;
  uint8_t dtype = 0;
  uint64_t key_bytes = 0;
  uint64_t shard_bytes = 0;  // nominal shard size
};

struct StateManifest {
  uint32_t proxy_rank = 0;  // the giver
  std::vector<OfferedShard> shards;
  // A join's manifest: every key the giver holds, so that a joiner learns
  // of a key none of whose shards a live peer offers (all its holders are
  // down: lost, not silently absent). Empty in other manifests.
  std::vector<HeldKey> keys;
};

std::vector<uint8_t> EncodeStateManifest(const StateManifest& manifest);
// DATA_LOSS naming what is wrong: bad magic, format or checksum, truncation,
// trailing bytes, inconsistent geometry (a shard's size must follow from the
// key's size, the shard size and its index), a descriptor that does not
// parse or is shorter than the shard, a (key, shard) given twice.
Status ParseStateManifest(std::span<const uint8_t> bytes,
                          StateManifest* manifest);

// What a giver offers, kept alive until the taker is done.
class StateOffer {
 public:
  struct Item {
    uint64_t key = 0;
    uint32_t shard = 0;
    DType dtype = DType::kFloat32;
    uint64_t key_bytes = 0, shard_bytes = 0;
    const StoredShard* stored = nullptr;  // must hold a value
    bool striped = false;                 // OfferedShard::striped
    bool held_round = false;              // OfferedShard::held_round
  };
  // Snapshots `items` (references to their buffers) and writes their
  // manifest into a region allocated on `device`.
  // `keys`: the manifest's list of held keys (a join's).
  static Result<std::unique_ptr<StateOffer>> Make(
      transport::Device& device, uint32_t giver_rank,
      const std::vector<Item>& items, std::vector<HeldKey> keys = {});

  // Where the taker reads the manifest, and how many bytes.
  std::vector<uint8_t> descriptor() const {
    return manifest_->Export().Serialize();
  }
  uint64_t manifest_bytes() const { return manifest_bytes_; }
  size_t shards() const { return shards_; }
  uint64_t state_bytes() const { return state_bytes_; }

 private:
  StateOffer() = default;
  std::unique_ptr<transport::MemRegion> manifest_;
  uint64_t manifest_bytes_ = 0, state_bytes_ = 0;
  size_t shards_ = 0;
  std::vector<std::shared_ptr<transport::MemRegion>> keep_;
};

// The same offer carried inline (in a message, not a region the taker
// reads first: one round trip less): the encoded manifest, and the buffers
// it names, which the giver keeps until the taker is done. What a shard's
// owner offers its backup every round (kBackup).
struct InlineOffer {
  std::vector<uint8_t> manifest;
  std::vector<std::shared_ptr<transport::MemRegion>> keep;
};
Result<InlineOffer> MakeInlineOffer(uint32_t giver_rank,
                                    const std::vector<StateOffer::Item>& items,
                                    std::vector<HeldKey> keys = {});

// Reads and parses the manifest a giver offered on `channel` (`descriptor`
// and `bytes` from its reply), and checks that it comes from `giver_rank`.
Result<StateManifest> ReadStateManifest(transport::Channel& channel,
                                        transport::Device& device,
                                        std::span<const uint8_t> descriptor,
                                        uint64_t bytes, uint32_t giver_rank,
                                        std::chrono::nanoseconds timeout);

// A shard's buffers, read from the giver into buffers of the taker's.
struct CopiedShard {
  const OfferedShard* offer = nullptr;  // into the manifest passed in
  std::shared_ptr<transport::MemRegion> value, m1, m2;
};
// Allocates a buffer of n bytes that the copy overwrites whole.
using CopyAllocator =
    std::function<Result<std::shared_ptr<transport::MemRegion>>(uint64_t)>;

// Reads every buffer of `shards` (from a manifest read on `channel`) into
// buffers from `allocate`, all reads in flight at once. Returns when all
// finished, or the first failure (a read still in flight then is waited
// for before its buffer is freed: channels complete every operation when
// they fail).
Result<std::vector<CopiedShard>> CopyShards(
    transport::Channel& channel, const std::vector<const OfferedShard*>& shards,
    const CopyAllocator& allocate, std::chrono::nanoseconds timeout);

// Starts reading the buffers of one shard (from a manifest) into buffers
// from `allocate`, without blocking: every read is in flight when it
// returns, and `done` runs exactly once -- on a transport thread, or
// inline when the reads complete at once (mapped memory) -- with the copy
// or the first failure. The read handles go to `track`, which must keep
// them until they complete. `shard` must outlive `done`'s call only as far
// as the returned CopiedShard::offer points to it.
// `import` (optional) resolves a descriptor to a readable region -- a
// cache of a peer's regions that every round names again; unset, each is
// imported on `channel` (no round trip: the manifest's peer is
// authenticated).
using RegionImporter =
    std::function<Result<std::shared_ptr<transport::RemoteMemRegion>>(
        const transport::RegionDescriptor&)>;
void StartCopyShard(transport::Channel& channel, const OfferedShard& shard,
                    const CopyAllocator& allocate,
                    const std::function<void(transport::OpHandle)>& track,
                    std::function<void(Result<CopiedShard>)> done,
                    const RegionImporter& import = {});

}  // namespace membox::ps

#endif  // MEMBOX_SRC_PS_STATE_COPY_H_
