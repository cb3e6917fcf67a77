// Checkpoint files of the parameter storage (docs/formats/ps_checkpoint.md).
//
// WriteCheckpoint writes atomically: a temporary file in the same directory,
// fsync, rename over the target, fsync of the directory -- so a crash leaves
// either the old file or the new one. Every shard record and the file carry
// CRC-32 (zlib) checksums; ParseCheckpoint (driven by
// fuzz/ps_checkpoint_fuzzer.cc) validates every length and checksum and reports
// a damaged file as kDataLoss naming what is wrong. Thread-safety: pure
// functions (the file system is the shared state).
#ifndef MEMBOX_SRC_PS_CHECKPOINT_H_
#define MEMBOX_SRC_PS_CHECKPOINT_H_

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "membox/base/status.h"
#include "membox/base/wire.h"

namespace membox::ps {

// What names a shard and its geometry wherever a shard's state travels:
// in a checkpoint's records and in a state copy's manifest (state_copy.h).
struct ShardHeader {
  uint64_t key = 0;
  uint32_t shard = 0;
  uint8_t dtype = 0;
  uint64_t key_bytes = 0;
  uint64_t shard_bytes = 0;  // nominal shard size of the key
  uint64_t version = 0;
};

// The header's encoding (33 bytes, little-endian, in the order above), and
// its decoding: false when `r` ends first. The callers validate the values.
void PutShardHeader(wire::Writer& w, const ShardHeader& h);
bool GetShardHeader(wire::Reader& r, ShardHeader* h);

struct CheckpointShard : ShardHeader {
  // The data. ParseCheckpoint leaves views into the bytes it parsed (keep
  // them alive while the records are used); ReadCheckpoint's records own
  // their bytes in `owned_*` and the views point there (move such a
  // record, never copy it: a copy's views point into the original).
  std::span<const uint8_t> value, m1, m2;
  std::vector<uint8_t> owned_value, owned_m1, owned_m2;
  // The node held this shard's version only (StoredShard::value_stale):
  // `value`, `m1` and `m2` are empty, and a restore keeps it stale.
  bool value_stale = false;
};

struct CheckpointHeader {
  uint32_t proxy_rank = 0;
  uint32_t proxies = 1;
  uint8_t mode = 0;
  uint8_t optimizer = 0;
};

// Encodes a checkpoint into `sink` in pieces, in order (the file format
// without the file: a joining proxy reads its peers' state in this form).
using CheckpointSink = std::function<Status(const void*, size_t)>;
Status EncodeCheckpoint(const CheckpointHeader& header,
                        const std::vector<CheckpointShard>& shards,
                        const CheckpointSink& sink);
Status WriteCheckpoint(const std::string& path, const CheckpointHeader& header,
                       const std::vector<CheckpointShard>& shards);
Status ParseCheckpoint(std::span<const uint8_t> bytes, CheckpointHeader* header,
                       std::vector<CheckpointShard>* shards);
Status ReadCheckpoint(const std::string& path, CheckpointHeader* header,
                      std::vector<CheckpointShard>* shards);

}  // namespace membox::ps

#endif  // MEMBOX_SRC_PS_CHECKPOINT_H_
