#include "src/transport/shared_file.h"

#include <cerrno>
#include <cstring>
#include <string>

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

namespace membox::transport {
namespace {

// Closes on scope exit.
struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) close(fd);
  }
};

std::string ProcFd(uint32_t pid, int32_t fd) {
  return "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
}

Result<int> OpenPeerFile(uint32_t pid, int32_t fd, int flags) {
  std::string path = ProcFd(pid, fd);
  // Look before opening: a descriptor naming a device or a pipe is refused
  // without the open (which has effects on some devices).
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) {
    return UnavailableError("cannot look at " + path + ": " +
                            std::strerror(errno));
  }
  if (!S_ISREG(st.st_mode)) {
    return PermissionDeniedError(path + " is not a regular file");
  }
  int f = open(path.c_str(), flags | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (f < 0) {
    return UnavailableError("cannot open " + path + ": " +
                            std::strerror(errno));
  }
  return f;
}

}  // namespace

SharedMapping& SharedMapping::operator=(SharedMapping&& o) noexcept {
  if (this != &o) {
    Reset();
    base_ = o.base_;
    length_ = o.length_;
    data_ = o.data_;
    o.base_ = o.data_ = nullptr;
    o.length_ = 0;
  }
  return *this;
}

void SharedMapping::Reset() {
  if (base_ != nullptr) munmap(base_, length_);
  base_ = data_ = nullptr;
  length_ = 0;
}

Result<SharedMapping> MapSharedFile(const RegionDescriptor& desc) {
  if (!desc.shared_file) {
    return InvalidArgumentError("region " + std::to_string(desc.region_id) +
                                " has no shared file");
  }
  const SharedFile& sf = *desc.shared_file;
  if (sf.pid == 0 || sf.fd < 0 || sf.proof_fd < 0) {
    return InvalidArgumentError("shared file names no process or descriptor");
  }
  // The proof first: nothing of the named process is opened for writing
  // unless it is the process that exported the region.
  ASSIGN_OR_RETURN(int pf, OpenPeerFile(sf.pid, sf.proof_fd, O_RDONLY));
  FdCloser proof_closer{pf};
  struct stat st {};
  if (fstat(pf, &st) != 0 || !S_ISREG(st.st_mode)) {
    return PermissionDeniedError("the shared-file proof is not a file");
  }
  uint8_t seen[sizeof(sf.proof)] = {};
  if (pread(pf, seen, sizeof(seen), 0) != static_cast<ssize_t>(sizeof(seen))) {
    return PermissionDeniedError("cannot read the shared-file proof");
  }
  uint8_t diff = 0;  // constant time
  for (size_t i = 0; i < sizeof(seen); ++i) diff |= seen[i] ^ sf.proof[i];
  if (diff != 0) {
    return PermissionDeniedError(
        "shared file of process " + std::to_string(sf.pid) +
        " refused: its proof does not match the descriptor's (not the "
        "process that exported it)");
  }

  ASSIGN_OR_RETURN(int f, OpenPeerFile(sf.pid, sf.fd, O_RDWR));
  FdCloser closer{f};
  struct statfs fs {};
  if (fstat(f, &st) != 0 || !S_ISREG(st.st_mode) || fstatfs(f, &fs) != 0 ||
      (fs.f_type != TMPFS_MAGIC && fs.f_type != HUGETLBFS_MAGIC) ||
      st.st_nlink != 0) {
    return PermissionDeniedError(
        "shared file refused: not an unlinked shared-memory file");
  }
  const uint64_t end = sf.offset + desc.length;
  if (end < sf.offset || static_cast<uint64_t>(st.st_size) < end) {
    return OutOfRangeError("shared file of " + std::to_string(st.st_size) +
                           " bytes is shorter than the region's range");
  }
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t start = sf.offset - sf.offset % page;
  const uint64_t length = end - start;
  void* base = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, f,
                    static_cast<off_t>(start));
  if (base == MAP_FAILED) {
    return UnavailableError(std::string("cannot map the shared file: ") +
                            std::strerror(errno));
  }
  return SharedMapping(base, length,
                       static_cast<uint8_t*>(base) + (sf.offset - start));
}

}  // namespace membox::transport
