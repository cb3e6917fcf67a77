#include "src/embedding/sync_state.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>

#include <fcntl.h>
#include <unistd.h>

#include "membox/base/durable_file.h"
#include "membox/base/logging.h"
#include "membox/base/wire.h"

namespace membox::embedding {
namespace {

constexpr char kMagic[8] = {'M', 'B', 'X', 'S', 'Y', 'N', 'C', '1'};
constexpr size_t kFixed = 8 + 8 + 8 + 4;  // magic, backup, count, crc

}  // namespace

std::vector<uint8_t> EncodeSyncState(const SyncState& s) {
  wire::Writer w;
  w.Bytes(kMagic, sizeof(kMagic));
  w.U64(s.backup);
  w.U64(s.dirty.size());
  for (uint64_t k : s.dirty) w.U64(k);
  const uint32_t crc = wire::Crc32(w.buffer().data(), w.buffer().size());
  w.U32(crc);
  return std::move(w.buffer());
}

Result<SyncState> ParseSyncState(std::span<const uint8_t> bytes) {
  if (bytes.size() < kFixed ||
      std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    return DataLossError("not a sync state file (" +
                         std::to_string(bytes.size()) + " bytes)");
  }
  wire::Reader r(bytes.subspan(sizeof(kMagic)));
  SyncState s;
  uint64_t n = 0;
  r.U64(&s.backup);
  r.U64(&n);
  if (s.backup == 0) return DataLossError("sync state names no backup");
  if (n > kMaxSyncStateRows || bytes.size() != kFixed + n * 8) {
    return DataLossError("sync state of " + std::to_string(bytes.size()) +
                         " bytes says " + std::to_string(n) + " rows");
  }
  uint32_t crc = 0;
  std::memcpy(&crc, bytes.data() + bytes.size() - 4, 4);
  if (wire::Crc32(bytes.data(), bytes.size() - 4) != crc) {
    return DataLossError("sync state checksum mismatch");
  }
  s.dirty.resize(n);
  for (uint64_t& k : s.dirty) r.U64(&k);
  if (!std::is_sorted(s.dirty.begin(), s.dirty.end()) ||
      std::adjacent_find(s.dirty.begin(), s.dirty.end()) != s.dirty.end()) {
    return DataLossError("sync state rows are not sorted and distinct");
  }
  return s;
}

std::string SyncStatePath(const std::string& table_dir) {
  return table_dir + "/SYNCSTATE";
}

Status WriteSyncState(const std::string& table_dir, const SyncState& s) {
  return ReplaceFileDurably(SyncStatePath(table_dir), EncodeSyncState(s));
}

Status RemoveSyncState(const std::string& table_dir) {
  const std::string path = SyncStatePath(table_dir);
  if (::unlink(path.c_str()) != 0) {
    if (errno == ENOENT) return Status::Ok();
    return InternalError("unlink " + path + ": " + strerror(errno));
  }
  return SyncDirectory(table_dir);
}

Status KeepSyncState(const std::string& table_dir, SyncState s) {
  std::sort(s.dirty.begin(), s.dirty.end());
  s.dirty.erase(std::unique(s.dirty.begin(), s.dirty.end()), s.dirty.end());
  if (s.dirty.size() > kMaxSyncStateRows) return RemoveSyncState(table_dir);
  Status st = WriteSyncState(table_dir, s);
  if (!st.ok()) (void)RemoveSyncState(table_dir);
  return st;
}

std::optional<SyncState> ReadSyncState(const std::string& table_dir) {
  const std::string path = SyncStatePath(table_dir);
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::vector<uint8_t> b((std::istreambuf_iterator<char>(in)),
                         std::istreambuf_iterator<char>());
  auto s = ParseSyncState(b);
  if (!s.ok()) {
    MEMBOX_LOG_WARN("{}: {}; the table goes to its backup whole", path,
                    s.status().ToString());
    return std::nullopt;
  }
  return std::move(*s);
}

}  // namespace membox::embedding
