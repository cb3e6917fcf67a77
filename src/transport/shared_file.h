// Mapping a same-host peer's shared-memory file (mem_region.h SharedFile):
// the importer's half of RegisterSharedMemRegion.
//
// MapSharedFile checks, before mapping anything, that the descriptor's
// process is the one that sent it -- the 16 random bytes in the proof file
// /proc/<pid>/fd/<proof_fd> must equal the descriptor's -- and that the
// region's file /proc/<pid>/fd/<fd> is an unlinked shared-memory file
// (tmpfs or hugetlbfs, no name left) long enough for the range. A peer
// holding the job's secret can thus make this process map only memory its
// own process shares, never another process's files.
//
// Ownership: a SharedMapping unmaps on destruction; the file's descriptors
// are closed before MapSharedFile returns (the mapping keeps the file).
// Thread-safety: MapSharedFile is reentrant.
#ifndef MEMBOX_SRC_TRANSPORT_SHARED_FILE_H_
#define MEMBOX_SRC_TRANSPORT_SHARED_FILE_H_

#include <cstddef>
#include <cstdint>

#include "membox/base/status.h"
#include "membox/transport/mem_region.h"

namespace membox::transport {

class SharedMapping {
 public:
  SharedMapping() = default;
  SharedMapping(void* base, size_t length, void* data)
      : base_(base), length_(length), data_(data) {}
  SharedMapping(SharedMapping&& o) noexcept { *this = std::move(o); }
  SharedMapping& operator=(SharedMapping&& o) noexcept;
  SharedMapping(const SharedMapping&) = delete;
  SharedMapping& operator=(const SharedMapping&) = delete;
  ~SharedMapping() { Reset(); }

  // The region's first byte in this process (null when empty).
  void* data() const { return data_; }
  void Reset();

 private:
  void* base_ = nullptr;  // page-aligned start of the mapping
  size_t length_ = 0;
  void* data_ = nullptr;
};

// Maps desc's [address, address + length) through its shared file, read and
// write. kInvalidArgument without a shared file; kPermissionDenied when the
// proof does not match or the file is not an unlinked shared-memory file;
// kOutOfRange when it is too short; kUnavailable when /proc cannot open it
// (another host, a process gone, or no permission to look at it).
Result<SharedMapping> MapSharedFile(const RegionDescriptor& desc);

}  // namespace membox::transport

#endif  // MEMBOX_SRC_TRANSPORT_SHARED_FILE_H_
