// The push log of an embedding server (docs/formats/embedding_push_log.md):
// what makes a push durable when it is acknowledged. Before the server
// answers a push, the rows it changed -- their whole new contents,
// optimizer state included -- are appended to <dir>/PUSHLOG and synced.
// A flush (every table's changed rows written and synced to the SSD tier)
// empties the log. Write + Sync let a server commit a group of pushes with
// one fdatasync and answer them all after it. After a crash, Start replays the
// log into the tables' SSD tiers in order (the last record of a key holds its
// newest acknowledged row; replay is idempotent) and empties it.
//
// The file is untrusted on reading (a torn write at a crash, a disk
// error): Parse checks every length and checksum and stops at the first
// bad record, reporting how many bytes it cut; fuzz/
// embedding_push_log_fuzzer.cc drives it.
//
// Open starts a missing or empty file with the current header; the server
// replays a log and removes it before opening a new one, so a log of an
// older format is read, never appended to.
//
// Ownership and threading: a PushLog owns its file descriptor. Write and
// Truncate run on one thread (the embedding server's event loop); Sync may
// run on another at the same time (fdatasync covers every write that
// returned before it started). Parse is pure.
#ifndef MEMBOX_SRC_EMBEDDING_PUSH_LOG_H_
#define MEMBOX_SRC_EMBEDDING_PUSH_LOG_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "membox/base/status.h"

namespace membox::embedding {

// The rows one push changed in one table.
struct PushLogSection {
  std::string table;
  uint32_t row_bytes = 0;
  std::vector<uint64_t> keys;
  std::vector<uint8_t> rows;  // keys.size() * row_bytes
};
// What a server knows of a client's pushes: each one numbered `floor` or
// less was answered (the client will not send it again), and push `seq`
// (0: none) was applied.
struct PushLogApplied {
  uint64_t client = 0;
  uint64_t floor = 0;
  uint64_t seq = 0;
  bool operator==(const PushLogApplied&) const = default;
};
// One acknowledged push: the rows it changed and which client's push it
// was. A record with no sections is what a truncated log starts with:
// every client's floor and the pushes above it that were applied, so a
// push resent after the flush is still recognised
// (docs/formats/embedding_push_log.md).
struct PushLogRecord {
  std::vector<PushLogSection> sections;
  std::vector<PushLogApplied> applied;
};

constexpr size_t kMaxPushLogTableName = 255;
constexpr uint32_t kMaxPushLogApplied = 1u << 20;

class PushLog {
 public:
  // Opens (creating) `path` for appending; reads nothing.
  static Result<std::unique_ptr<PushLog>> Open(const std::string& path);
  ~PushLog();
  PushLog(const PushLog&) = delete;
  PushLog& operator=(const PushLog&) = delete;

  // Appends one record and syncs it (fdatasync): durable on return.
  Status Append(const PushLogRecord& record);
  // Appends without syncing; Sync() makes every record written before it
  // was called durable with one fdatasync (group commit). Sync may run on
  // another thread than Write / Truncate (a sync thread), concurrently.
  Status Write(const PushLogRecord& record);
  Status Sync();
  uint64_t syncs() const { return syncs_.load(); }
  // Empties the log (its rows are durable in the SSD tiers now), then
  // writes `first` (if given) and syncs: durable on return.
  Status Truncate(const PushLogRecord* first = nullptr);

  uint64_t bytes() const { return bytes_; }      // in the file now
  uint64_t appends() const { return appends_; }  // since Open
  double sync_seconds() const { return sync_ns_.load() * 1e-9; }

  // Encodes one record as it lies in a file of format `version` (1: no
  // `applied`; 2, what Open writes) -- length, CRC, payload.
  static std::vector<uint8_t> Encode(const PushLogRecord& record,
                                     int version = 2);
  // The records of a log's bytes, in order (either format; `version`, if
  // given, says which). A file that does not start with a header is
  // DATA_LOSS; a torn or corrupt record ends the list and `cut_bytes` says
  // how much followed it.
  static Status Parse(std::span<const uint8_t> bytes,
                      std::vector<PushLogRecord>* records, uint64_t* cut_bytes,
                      int* version = nullptr);
  // Reads and parses `path`; a missing file has no records.
  static Status Read(const std::string& path,
                     std::vector<PushLogRecord>* records, uint64_t* cut_bytes);

 private:
  PushLog(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  int fd_;
  std::string path_;
  uint64_t bytes_ = 0, appends_ = 0;             // the writer's thread
  std::atomic<uint64_t> sync_ns_{0}, syncs_{0};  // any thread
};

}  // namespace membox::embedding

#endif  // MEMBOX_SRC_EMBEDDING_PUSH_LOG_H_
