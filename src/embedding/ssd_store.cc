#include "membox/embedding/ssd_store.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>

#include <absl/container/flat_hash_map.h>
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "membox/base/durable_file.h"
#include "membox/base/logging.h"
#include "membox/base/mutex.h"

#include "src/embedding/ssd_record.h"

namespace membox::embedding {
namespace {

Status Errno(const std::string& what) {
  return InternalError(what + ": " + std::strerror(errno));
}

Status WriteAt(int fd, const uint8_t* p, size_t n, uint64_t off) {
  while (n > 0) {
    ssize_t w = ::pwrite(fd, p, n, static_cast<off_t>(off));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return Errno("pwrite");
    p += w;
    n -= static_cast<size_t>(w);
    off += static_cast<uint64_t>(w);
  }
  return Status::Ok();
}

Status ReadAt(int fd, uint8_t* p, size_t n, uint64_t off) {
  while (n > 0) {
    ssize_t r = ::pread(fd, p, n, static_cast<off_t>(off));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return Errno("pread");
    if (r == 0) return DataLossError("parameter file shorter than expected");
    p += r;
    n -= static_cast<size_t>(r);
    off += static_cast<uint64_t>(r);
  }
  return Status::Ok();
}

struct File {
  uint32_t number = 0;
  int fd = -1;
  uint64_t size = 0;
  uint64_t live = 0, stale = 0;  // records
  bool dirty = false;            // written since the last sync
};

struct Loc {
  uint32_t file = 0;
  uint64_t offset = 0;
  uint64_t seq = 0;
  bool tombstone = false;
};

class SsdStoreImpl final : public SsdStore {
 public:
  explicit SsdStoreImpl(SsdOptions o) : opt_(std::move(o)) {
    record_bytes_ = kRecordHeaderBytes + opt_.row_bytes;
  }
  ~SsdStoreImpl() override {
    MutexLock l(&mu_);
    (void)SyncLocked();
    for (auto& [n, f] : files_) ::close(f.fd);
  }

  Status Open(RecoveryStats* rs) {
    if (opt_.row_bytes == 0 || opt_.row_bytes > kMaxRowBytes) {
      return InvalidArgumentError("row_bytes must be in (0, 1 MiB]");
    }
    if (opt_.file_bytes < kFileHeaderBytes + record_bytes_) {
      return InvalidArgumentError("file_bytes smaller than one record");
    }
    if (::mkdir(opt_.dir.c_str(), 0755) != 0 && errno != EEXIST) {
      return Errno("mkdir " + opt_.dir);
    }
    std::vector<uint32_t> numbers;
    DIR* d = ::opendir(opt_.dir.c_str());
    if (!d) return Errno("opendir " + opt_.dir);
    while (dirent* e = ::readdir(d)) {
      unsigned n = 0;
      char tail = 0;
      if (std::sscanf(e->d_name, "params-%8u.da%c", &n, &tail) == 2 &&
          tail == 't' && std::strlen(e->d_name) == 19) {
        numbers.push_back(n);
      }
    }
    ::closedir(d);
    std::sort(numbers.begin(), numbers.end());
    RecoveryStats local;
    RecoveryStats& st = rs ? *rs : local;
    // Nobody else holds the store yet; the lock is for the analysis (and
    // costs nothing uncontended).
    MutexLock l(&mu_);
    st = RecoveryStats{};
    for (uint32_t n : numbers) RETURN_IF_ERROR(Recover(n, st));
    st.keys = 0;
    for (auto& [k, l] : map_) st.keys += l.tombstone ? 0 : 1;
    if (st.corrupt_records > 0) {
      MEMBOX_LOG_WARN("{}: {} corrupt records skipped during recovery",
                      opt_.dir, st.corrupt_records);
    }
    next_file_ = numbers.empty() ? 1 : numbers.back() + 1;
    return NewActiveFile();
  }

  Status Put(std::span<const uint64_t> keys,
             std::span<const uint8_t> rows) override {
    if (rows.size() != keys.size() * opt_.row_bytes) {
      return InvalidArgumentError("rows must be keys.size() * row_bytes");
    }
    MutexLock l(&mu_);
    buffer_.reserve(buffer_.size() + keys.size() * record_bytes_);
    for (size_t i = 0; i < keys.size(); ++i) {
      RETURN_IF_ERROR(
          AppendLocked(keys[i], seq_++, false,
                       rows.subspan(i * opt_.row_bytes, opt_.row_bytes)));
    }
    row_bytes_updated_ += rows.size();
    return FlushBufferLocked();
  }

  Status Erase(std::span<const uint64_t> keys) override {
    MutexLock l(&mu_);
    std::vector<uint8_t> zero(opt_.row_bytes, 0);
    for (uint64_t k : keys) {
      auto it = map_.find(k);
      if (it == map_.end() || it->second.tombstone) continue;
      RETURN_IF_ERROR(AppendLocked(k, seq_++, true, zero));
    }
    return FlushBufferLocked();
  }

  Status Sync() override {
    MutexLock l(&mu_);
    return SyncLocked();
  }

  Status Get(std::span<const uint64_t> keys, std::span<uint8_t> out,
             std::vector<bool>* found) override {
    if (out.size() != keys.size() * opt_.row_bytes) {
      return InvalidArgumentError("out must be keys.size() * row_bytes");
    }
    MutexLock l(&mu_);
    found->assign(keys.size(), false);
    for (size_t i = 0; i < keys.size(); ++i) {
      auto it = map_.find(keys[i]);
      if (it == map_.end() || it->second.tombstone) continue;
      const File& f = files_.at(it->second.file);
      RETURN_IF_ERROR(ReadAt(f.fd, out.data() + i * opt_.row_bytes,
                             opt_.row_bytes,
                             it->second.offset + kRecordHeaderBytes));
      (*found)[i] = true;
    }
    return Status::Ok();
  }

  std::vector<uint64_t> Keys() const override {
    std::vector<uint64_t> keys;
    {
      MutexLock l(&mu_);
      keys.reserve(map_.size());
      for (const auto& [k, loc] : map_) {
        if (!loc.tombstone) keys.push_back(k);
      }
    }
    std::sort(keys.begin(), keys.end());
    return keys;
  }

  // Holds the lock only per chunk of records, so Put / Get / Sync from other
  // threads go on while a background thread compacts.
  Status Compact() override {
    std::vector<uint32_t> victims;
    {
      MutexLock l(&mu_);
      if (compacting_) return Status::Ok();  // another thread is at it
      for (auto& [n, f] : files_) {
        uint64_t total = f.live + f.stale;
        if (n != active_ && total > 0 &&
            double(f.stale) / double(total) > opt_.compact_stale_fraction) {
          victims.push_back(n);
        }
      }
      if (victims.empty()) return Status::Ok();
      compacting_ = true;
    }
    Status s = CompactFiles(victims);
    MutexLock l(&mu_);
    compacting_ = false;
    return s;
  }

  SsdStats Stats() const override {
    MutexLock l(&mu_);
    SsdStats s;
    for (auto& [k, loc] : map_) s.keys += loc.tombstone ? 0 : 1;
    s.files = files_.size();
    for (auto& [n, f] : files_) {
      s.live_bytes += f.live * record_bytes_;
      s.file_bytes += f.size;
    }
    s.bytes_written = bytes_written_;
    s.row_bytes_updated = row_bytes_updated_;
    s.compactions = compactions_;
    return s;
  }

  uint32_t row_bytes() const override { return opt_.row_bytes; }

 private:
  std::string Path(uint32_t n) const {
    char name[32];
    std::snprintf(name, sizeof name, "params-%08u.dat", n);
    return opt_.dir + "/" + name;
  }

  Status Recover(uint32_t n, RecoveryStats& st) MEMBOX_REQUIRES(mu_) {
    std::string path = Path(n);
    int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) return Errno("open " + path);
    File f;
    f.number = n;
    f.fd = fd;
    struct stat sb;
    if (::fstat(fd, &sb) != 0) return Errno("fstat " + path);
    uint64_t size = static_cast<uint64_t>(sb.st_size);
    std::vector<uint8_t> hdr(kFileHeaderBytes);
    if (size < kFileHeaderBytes) {
      // Created but its header never made it: nothing acknowledged inside.
      st.torn_tail_bytes += size;
      ::close(fd);
      ::unlink(path.c_str());
      dir_dirty_ = true;
      return Status::Ok();
    }
    RETURN_IF_ERROR(ReadAt(fd, hdr.data(), hdr.size(), 0));
    auto rb = DecodeFileHeader(hdr);
    if (!rb.ok()) {
      ::close(fd);
      return Status(rb.status().code(),
                    path + ": " + std::string(rb.status().message()));
    }
    if (*rb != opt_.row_bytes) {
      ::close(fd);
      return FailedPreconditionError(path + " holds rows of " +
                                     std::to_string(*rb) + " bytes, not " +
                                     std::to_string(opt_.row_bytes));
    }
    uint64_t whole = kFileHeaderBytes +
                     (size - kFileHeaderBytes) / record_bytes_ * record_bytes_;
    if (whole < size) {  // a torn append: cut it off
      st.torn_tail_bytes += size - whole;
      if (::ftruncate(fd, static_cast<off_t>(whole)) != 0) {
        return Errno("ftruncate " + path);
      }
      ::fdatasync(fd);
    }
    f.size = whole;
    files_[n] = f;
    st.files++;
    std::vector<uint8_t> buf;
    const uint64_t chunk =
        std::max<uint64_t>(1, (4 << 20) / record_bytes_) * record_bytes_;
    for (uint64_t off = kFileHeaderBytes; off < whole;) {
      uint64_t n_bytes = std::min(chunk, whole - off);
      buf.resize(n_bytes);
      RETURN_IF_ERROR(ReadAt(fd, buf.data(), n_bytes, off));
      for (uint64_t i = 0; i < n_bytes; i += record_bytes_) {
        auto r = DecodeRecord(std::span(buf).subspan(i, record_bytes_),
                              opt_.row_bytes);
        if (!r.ok()) {
          st.corrupt_records++;
          files_[n].stale++;
          continue;
        }
        st.records++;
        Index(r->key, Loc{n, off + i, r->seq, r->tombstone});
        seq_ = std::max(seq_, r->seq + 1);
      }
      off += n_bytes;
    }
    return Status::Ok();
  }

  // Re-appends the live records of `victims` (not the active file; only
  // the compacting thread removes files, so they stay), a chunk at a time
  // under the lock, then syncs and deletes them.
  Status CompactFiles(const std::vector<uint32_t>& victims) {
    constexpr uint64_t kChunkRecords = 1024;
    std::vector<uint8_t> buf;
    for (uint32_t n : victims) {
      uint64_t size;
      int fd;
      {
        MutexLock l(&mu_);
        size = files_.at(n).size;
        fd = files_.at(n).fd;
      }
      for (uint64_t off = kFileHeaderBytes; off + record_bytes_ <= size;) {
        uint64_t count = std::min(kChunkRecords, (size - off) / record_bytes_);
        buf.resize(count * record_bytes_);
        // The victim is immutable (not active), so it is read unlocked.
        RETURN_IF_ERROR(ReadAt(fd, buf.data(), buf.size(), off));
        MutexLock l(&mu_);
        for (uint64_t i = 0; i < count; ++i) {
          uint64_t at = off + i * record_bytes_;
          auto r = DecodeRecord(
              std::span(buf).subspan(i * record_bytes_, record_bytes_),
              opt_.row_bytes);
          if (!r.ok()) continue;
          auto it = map_.find(r->key);
          if (it == map_.end() || it->second.file != n ||
              it->second.offset != at) {
            continue;  // stale
          }
          // Same sequence number: if we crash before the old file is gone,
          // recovery sees two identical versions.
          RETURN_IF_ERROR(AppendLocked(r->key, r->seq, r->tombstone, r->row));
        }
        // Get reads records from the files: none may stay in the buffer
        // when the lock goes.
        RETURN_IF_ERROR(FlushBufferLocked());
        off += count * record_bytes_;
      }
    }
    MutexLock l(&mu_);
    RETURN_IF_ERROR(FlushBufferLocked());
    // The rewritten records are durable before the old files go.
    RETURN_IF_ERROR(SyncLocked());
    for (uint32_t n : victims) {
      File f = files_.at(n);
      if (f.live != 0) continue;  // cannot happen; never delete live data
      ::close(f.fd);
      if (::unlink(Path(n).c_str()) != 0) return Errno("unlink " + Path(n));
      files_.erase(n);
      compactions_++;
    }
    dir_dirty_ = true;
    return SyncLocked();
  }

  // Points `key` at `loc` if it is newer; keeps the live/stale counts.
  // `into`: loc's file when the caller has it (one map lookup less per
  // record on the append path).
  void Index(uint64_t key, const Loc& loc, File* into = nullptr)
      MEMBOX_REQUIRES(mu_) {
    File& to = into != nullptr ? *into : files_[loc.file];
    auto [it, inserted] = map_.try_emplace(key, loc);
    if (inserted) {
      to.live++;
      return;
    }
    if (loc.seq >= it->second.seq) {
      if (it->second.file == loc.file) {
        to.stale++;  // one live record replaces another in the same file
      } else {
        File& old = files_[it->second.file];
        old.live--;
        old.stale++;
        to.live++;
      }
      it->second = loc;
    } else {
      to.stale++;
    }
  }

  Status NewActiveFile() MEMBOX_REQUIRES(mu_) {
    uint32_t n = next_file_++;
    std::string path = Path(n);
    int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) return Errno("create " + path);
    auto hdr = EncodeFileHeader(opt_.row_bytes);
    RETURN_IF_ERROR(WriteAt(fd, hdr.data(), hdr.size(), 0));
    File f;
    f.number = n;
    f.fd = fd;
    f.size = hdr.size();
    f.dirty = true;
    files_[n] = f;
    active_ = n;
    active_file_ = &files_.at(n);
    dir_dirty_ = true;
    bytes_written_ += hdr.size();
    return Status::Ok();
  }

  Status AppendLocked(uint64_t key, uint64_t seq, bool tombstone,
                      std::span<const uint8_t> row) MEMBOX_REQUIRES(mu_) {
    File* f = active_file_;  // (std::map nodes stay put; the active file
                             // is never compacted away)
    if (f->size + buffer_.size() + record_bytes_ > opt_.file_bytes &&
        f->size + buffer_.size() > kFileHeaderBytes) {
      RETURN_IF_ERROR(FlushBufferLocked());
      RETURN_IF_ERROR(NewActiveFile());
      f = active_file_;
    }
    uint64_t off = f->size + buffer_.size();
    EncodeRecord(key, seq, tombstone, row, &buffer_);
    Index(key, Loc{active_, off, seq, tombstone}, f);
    return Status::Ok();
  }

  Status FlushBufferLocked() MEMBOX_REQUIRES(mu_) {
    if (buffer_.empty()) return Status::Ok();
    File& f = files_.at(active_);
    RETURN_IF_ERROR(WriteAt(f.fd, buffer_.data(), buffer_.size(), f.size));
    f.size += buffer_.size();
    f.dirty = true;
    bytes_written_ += buffer_.size();
    buffer_.clear();
    return Status::Ok();
  }

  Status SyncLocked() MEMBOX_REQUIRES(mu_) {
    RETURN_IF_ERROR(FlushBufferLocked());
    for (auto& [n, f] : files_) {
      if (!f.dirty) continue;
      if (::fdatasync(f.fd) != 0) return Errno("fdatasync " + Path(n));
      f.dirty = false;
    }
    if (dir_dirty_) {
      RETURN_IF_ERROR(SyncDirectory(opt_.dir));
      dir_dirty_ = false;
    }
    return Status::Ok();
  }

  SsdOptions opt_;
  size_t record_bytes_ = 0;
  mutable Mutex mu_;
  std::map<uint32_t, File> files_ MEMBOX_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, Loc> map_ MEMBOX_GUARDED_BY(mu_);
  uint32_t active_ MEMBOX_GUARDED_BY(mu_) = 0;
  File* active_file_ MEMBOX_GUARDED_BY(mu_) = nullptr;  // files_[active_]
  uint32_t next_file_ MEMBOX_GUARDED_BY(mu_) = 1;
  uint64_t seq_ MEMBOX_GUARDED_BY(mu_) = 1;
  bool dir_dirty_ MEMBOX_GUARDED_BY(mu_) = false;
  bool compacting_ MEMBOX_GUARDED_BY(mu_) = false;
  std::vector<uint8_t> buffer_ MEMBOX_GUARDED_BY(mu_);
  uint64_t bytes_written_ = 0, row_bytes_updated_ = 0, compactions_ = 0;
};

}  // namespace

Result<std::unique_ptr<SsdStore>> SsdStore::Open(const SsdOptions& options,
                                                 RecoveryStats* recovery) {
  auto s = std::make_unique<SsdStoreImpl>(options);
  RETURN_IF_ERROR(s->Open(recovery));
  return std::unique_ptr<SsdStore>(std::move(s));
}

}  // namespace membox::embedding
