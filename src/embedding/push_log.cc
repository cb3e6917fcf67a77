#include "src/embedding/push_log.h"

#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "membox/base/wire.h"

namespace membox::embedding {

namespace {

// Format 1 had no `applied` list; Open writes format 2.
constexpr char kMagicV1[8] = {'M', 'B', 'X', 'P', 'L', 'O', 'G', '1'};
constexpr char kMagic[8] = {'M', 'B', 'X', 'P', 'L', 'O', 'G', '2'};
constexpr uint32_t kMaxRecord = 1u << 30;
constexpr uint32_t kMaxSections = 1u << 16;

Status Errno(const std::string& what) {
  return InternalError(what + ": " + std::strerror(errno));
}

Status WriteAll(int fd, const uint8_t* p, size_t n) {
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return Errno("push log write");
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<PushLog>> PushLog::Open(const std::string& path) {
  int fd =
      ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return Errno("open " + path);
  std::unique_ptr<PushLog> log(new PushLog(fd, path));
  struct stat st {};
  if (::fstat(fd, &st) != 0) return Errno("stat " + path);
  if (st.st_size == 0) {
    RETURN_IF_ERROR(
        WriteAll(fd, reinterpret_cast<const uint8_t*>(kMagic), sizeof(kMagic)));
    if (::fdatasync(fd) != 0) return Errno("fdatasync " + path);
    log->bytes_ = sizeof(kMagic);
  } else {
    log->bytes_ = static_cast<uint64_t>(st.st_size);
  }
  return log;
}

PushLog::~PushLog() { ::close(fd_); }

std::vector<uint8_t> PushLog::Encode(const PushLogRecord& record, int version) {
  wire::Writer payload;
  payload.U32(static_cast<uint32_t>(record.sections.size()));
  for (const PushLogSection& s : record.sections) {
    wire::PutStr(payload, s.table);
    payload.U32(s.row_bytes);
    payload.U32(static_cast<uint32_t>(s.keys.size()));
    for (uint64_t k : s.keys) payload.U64(k);
    payload.Bytes(s.rows.data(), s.rows.size());
  }
  if (version >= 2) {
    payload.U32(static_cast<uint32_t>(record.applied.size()));
    for (const PushLogApplied& a : record.applied) {
      payload.U64(a.client);
      payload.U64(a.floor);
      payload.U64(a.seq);
    }
  }
  const std::vector<uint8_t>& p = payload.buffer();
  wire::Writer out;
  out.U32(static_cast<uint32_t>(p.size()));
  out.U32(wire::Crc32(p.data(), p.size()));
  out.Bytes(p.data(), p.size());
  return std::move(out.buffer());
}

Status PushLog::Append(const PushLogRecord& record) {
  RETURN_IF_ERROR(Write(record));
  return Sync();
}

Status PushLog::Write(const PushLogRecord& record) {
  std::vector<uint8_t> b = Encode(record);
  RETURN_IF_ERROR(WriteAll(fd_, b.data(), b.size()));
  bytes_ += b.size();
  appends_++;
  return Status::Ok();
}

Status PushLog::Sync() {
  auto t0 = std::chrono::steady_clock::now();
  if (::fdatasync(fd_) != 0) return Errno("fdatasync " + path_);
  sync_ns_ += static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(
          std::chrono::steady_clock::now() - t0)
          .count());
  syncs_++;
  return Status::Ok();
}

Status PushLog::Truncate(const PushLogRecord* first) {
  if (bytes_ == sizeof(kMagic) && !first) return Status::Ok();
  if (::ftruncate(fd_, sizeof(kMagic)) != 0) return Errno("truncate " + path_);
  bytes_ = sizeof(kMagic);
  if (first) {
    std::vector<uint8_t> b = Encode(*first);
    RETURN_IF_ERROR(WriteAll(fd_, b.data(), b.size()));
    bytes_ += b.size();
  }
  if (::fdatasync(fd_) != 0) return Errno("fdatasync " + path_);
  return Status::Ok();
}

Status PushLog::Parse(std::span<const uint8_t> bytes,
                      std::vector<PushLogRecord>* records, uint64_t* cut_bytes,
                      int* version) {
  records->clear();
  *cut_bytes = 0;
  int v = 0;
  if (bytes.size() >= sizeof(kMagic)) {
    if (std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) == 0) v = 2;
    if (std::memcmp(bytes.data(), kMagicV1, sizeof(kMagic)) == 0) v = 1;
  }
  if (v == 0) return DataLossError("not a membox push log (bad header)");
  if (version) *version = v;
  size_t pos = sizeof(kMagic);
  while (pos < bytes.size()) {
    wire::Reader head(bytes.subspan(pos));
    uint32_t len = 0, crc = 0;
    if (!head.U32(&len) || !head.U32(&crc) || len > kMaxRecord ||
        len > head.remaining()) {
      break;
    }
    auto payload = bytes.subspan(pos + 8, len);
    if (wire::Crc32(payload.data(), payload.size()) != crc) break;
    wire::Reader r(payload);
    PushLogRecord rec;
    uint32_t n = 0;
    bool ok = r.U32(&n) && n <= kMaxSections;
    for (uint32_t i = 0; ok && i < n; ++i) {
      PushLogSection s;
      uint32_t keys = 0;
      ok = wire::GetStr(r, &s.table, kMaxPushLogTableName) &&
           !s.table.empty() && r.U32(&s.row_bytes) && s.row_bytes > 0 &&
           r.U32(&keys) &&
           uint64_t{keys} * (8 + uint64_t{s.row_bytes}) <= r.remaining();
      if (!ok) break;
      s.keys.resize(keys);
      for (uint32_t k = 0; k < keys; ++k) r.U64(&s.keys[k]);
      ok = r.Bytes(&s.rows, size_t{keys} * s.row_bytes);
      rec.sections.push_back(std::move(s));
    }
    if (ok && v >= 2) {
      uint32_t applied = 0;
      ok = r.U32(&applied) && applied <= kMaxPushLogApplied &&
           uint64_t{applied} * 24 <= r.remaining();
      if (ok) rec.applied.resize(applied);
      for (uint32_t i = 0; ok && i < applied; ++i) {
        PushLogApplied& a = rec.applied[i];
        ok = r.U64(&a.client) && r.U64(&a.floor) && r.U64(&a.seq);
      }
    }
    if (!ok || r.remaining() != 0) break;  // a checksum hid a bad layout
    records->push_back(std::move(rec));
    pos += 8 + len;
  }
  *cut_bytes = bytes.size() - pos;
  return Status::Ok();
}

Status PushLog::Read(const std::string& path,
                     std::vector<PushLogRecord>* records, uint64_t* cut_bytes) {
  records->clear();
  *cut_bytes = 0;
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::Ok();
  std::vector<uint8_t> b((std::istreambuf_iterator<char>(in)),
                         std::istreambuf_iterator<char>());
  if (b.empty()) return Status::Ok();
  return Parse(b, records, cut_bytes).WithContext(path);
}

}  // namespace membox::embedding
