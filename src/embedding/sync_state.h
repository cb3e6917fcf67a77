// A table's sync state on disk (docs/formats/embedding_sync_state.md):
// which backup process holds a copy of the table that is whole but for
// the rows listed, as of the table's SSD tier after the last flush. With
// the push log (every push since that flush) it lets a node that
// restarts with its disk resync only the rows its backup may lack,
// instead of the whole table (docs/design/embedding.md, "Resyncs").
//
// The file is untrusted on reading: Parse checks the header, the count
// against kMaxSyncStateRows and the checksum; fuzz/
// embedding_sync_state_fuzzer.cc drives it. A bad or missing file means
// "not known" (the table is then resynced whole); it never fails a start.
//
// Threading: plain functions; the server calls them on its event loop
// (and at its start).
#ifndef MEMBOX_SRC_EMBEDDING_SYNC_STATE_H_
#define MEMBOX_SRC_EMBEDDING_SYNC_STATE_H_

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "membox/base/status.h"

namespace membox::embedding {

struct SyncState {
  uint64_t backup = 0;          // the backup's incarnation (never 0)
  std::vector<uint64_t> dirty;  // rows it may lack, sorted, no repeats
  bool operator==(const SyncState&) const = default;
};

// More rows than this: the table is sent whole instead (the server's own
// bound on what it tracks).
constexpr uint64_t kMaxSyncStateRows = uint64_t{1} << 20;

std::vector<uint8_t> EncodeSyncState(const SyncState& s);
// DATA_LOSS on anything but a whole, valid file.
Result<SyncState> ParseSyncState(std::span<const uint8_t> bytes);

// <table dir>/SYNCSTATE. Write replaces it durably (a temporary file,
// fsync, rename, the directory synced); Remove deletes it (a missing file
// is fine) and syncs the directory; Read gives nullopt for a missing or
// bad file (a bad one is logged).
std::string SyncStatePath(const std::string& table_dir);
Status WriteSyncState(const std::string& table_dir, const SyncState& s);
Status RemoveSyncState(const std::string& table_dir);
std::optional<SyncState> ReadSyncState(const std::string& table_dir);
// Records `s` with its rows sorted and deduplicated, or removes the file
// where more than kMaxSyncStateRows remain (the table goes whole); a write
// that fails removes the file too, and says why.
Status KeepSyncState(const std::string& table_dir, SyncState s);

}  // namespace membox::embedding

#endif  // MEMBOX_SRC_EMBEDDING_SYNC_STATE_H_
