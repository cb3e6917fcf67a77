// SSD tier of the sparse parameter store (seed 004, "SSD-PS"): fixed-width
// rows (embedding values and optimizer state) keyed by 64-bit feature ids,
// kept in append-only parameter files on local storage.
//
// Layout (docs/formats/ssd_tier.md): a directory of files
// params-<number>.dat, each a sequence of fixed-size records {magic, crc,
// key, sequence number, row}. Updated rows are appended -- sequentially --
// to the newest file; a file that reaches file_bytes is closed and a new one
// started. An in-memory map key -> (file, slot, sequence) finds the live
// record; every file has a live and a stale count. Compact() rewrites files
// more than 50 % stale (their live records appended again), then deletes
// them, which bounds the space used to about 2x the live data.
//
// Durability: Put() appends without waiting; Sync() makes every earlier Put
// durable (fdatasync of the files written, and of the directory when files
// were created or removed) and is the acknowledgement: a crash loses no
// update acknowledged by Sync(), and may keep or lose later ones. Compaction
// deletes a file only after its live records are durable elsewhere.
//
// Recovery (Open): every file is scanned; a record whose magic or checksum
// is wrong is counted and skipped (records are fixed-size, so the scan goes
// on); a short record at the end of a file (a torn append) is cut off; the
// newest sequence number of each key wins. RecoveryStats says what was
// found, so damage is never silent.
//
// Thread-safety: all methods may be called from any thread; one mutex
// serialises them (the SSD is the bottleneck, not the lock), except that
// Compact() holds it only per chunk of 1024 records, so it can run on a
// background thread while Put / Get / Sync go on (one Compact at a time;
// a second call returns at once).
#ifndef MEMBOX_EMBEDDING_SSD_STORE_H_
#define MEMBOX_EMBEDDING_SSD_STORE_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "membox/base/status.h"

namespace membox::embedding {

struct SsdOptions {
  std::string dir;                 // created if missing
  uint32_t row_bytes = 0;          // fixed record payload, > 0
  uint64_t file_bytes = 64 << 20;  // size at which a new file starts
  double compact_stale_fraction = 0.5;
};

struct RecoveryStats {
  uint64_t files = 0;
  uint64_t records = 0;          // valid records scanned
  uint64_t corrupt_records = 0;  // bad magic / checksum, skipped
  uint64_t torn_tail_bytes = 0;  // cut off at file ends
  uint64_t keys = 0;             // live keys after recovery
};

struct SsdStats {
  uint64_t keys = 0;
  uint64_t files = 0;
  uint64_t live_bytes = 0;         // live records
  uint64_t file_bytes = 0;         // all files
  uint64_t bytes_written = 0;      // appended since Open (puts + compaction)
  uint64_t row_bytes_updated = 0;  // payload bytes Put since Open
  uint64_t compactions = 0;
  // Bytes written to files / bytes of updated rows (seed 004's measure).
  double write_amplification() const {
    return row_bytes_updated ? double(bytes_written) / row_bytes_updated : 0;
  }
};

class SsdStore {
 public:
  static Result<std::unique_ptr<SsdStore>> Open(
      const SsdOptions& options, RecoveryStats* recovery = nullptr);
  virtual ~SsdStore() = default;

  // Appends rows (rows.size() == keys.size() * row_bytes). Durable after
  // the next Sync().
  virtual Status Put(std::span<const uint64_t> keys,
                     std::span<const uint8_t> rows) = 0;
  virtual Status Sync() = 0;
  // Reads the rows of `keys` into `out` (keys.size() * row_bytes); found[i]
  // tells whether key i exists (missing rows are left untouched).
  virtual Status Get(std::span<const uint64_t> keys, std::span<uint8_t> out,
                     std::vector<bool>* found) = 0;
  virtual Status Erase(std::span<const uint64_t> keys) = 0;
  // The keys that have a row, in ascending order.
  virtual std::vector<uint64_t> Keys() const = 0;
  // Rewrites and deletes files more than compact_stale_fraction stale.
  // Safe to run concurrently with the other methods (see above).
  virtual Status Compact() = 0;
  virtual SsdStats Stats() const = 0;
  virtual uint32_t row_bytes() const = 0;
};

}  // namespace membox::embedding

#endif  // MEMBOX_EMBEDDING_SSD_STORE_H_
