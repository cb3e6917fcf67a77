// Memory regions: the unit of memory the transport can move data into or out
// of (seed 002 §3.1, Table 1 "AllocateMemRegion").
//
// A MemRegion is local memory registered with the transport, either
//   * allocated by the device (Device::AllocateMemRegion): on one host the
//     memory is shared-memory backed, so a peer can map it and use plain
//     loads and stores (the CXL-style path, see RemoteMemRegion::mapped()); or
//   * a registration of memory the caller already owns
//     (Device::RegisterMemRegion): zero-copy for existing tensors; peers on the
//     same host reach it through cross-memory attach, remote peers through
//     the network. That memory may be GPU memory (MemoryType::kCuda) where
//     the transport's UCX build supports CUDA: such a region is reached only
//     by UCX's one-sided operations (never by membox's TCP path, active
//     messages or load/store mapping, which need host memory); elsewhere
//     registering it fails with kFailedPrecondition, and GPU tensors are
//     staged through registered host memory instead (membox.torch does).
//
// Export() produces a RegionDescriptor: address, length, the region's random
// access token and the transport's packed remote key. The descriptor is what
// travels to another process (normally through a Channel control message);
// the peer imports it with Channel::Import() before using it.
//
// Ownership: the Device owns the registration machinery, so a MemRegion must
// be destroyed before its Device. A region must outlive every remote use of
// it: destroying it while a peer still writes is the caller's bug (the peer's
// writes land in memory that is no longer registered; on the mapped path they
// land in a detached shared segment and are lost).
//
// Thread-safety: all const methods may be called from any thread.
#ifndef MEMBOX_TRANSPORT_MEM_REGION_H_
#define MEMBOX_TRANSPORT_MEM_REGION_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "membox/base/hmac.h"
#include "membox/base/status.h"

namespace membox::transport {

// Registered memory that is also a shared-memory file of the owner (a
// framework's buffer moved into shared memory, e.g. torch's share_memory_()):
// a peer on the same host maps the file and loads and stores the memory
// like device-allocated memory. The peer reaches the file through
// /proc/<pid>/fd/<fd>; `proof` is a random value the owner's device keeps
// in its own shared-memory file `proof_fd`, which the peer reads there and
// compares, so a descriptor naming another process is refused (only that
// process can hold the value). Untrusted until the importer has checked it
// (UcxChannel::Import; docs/design/transport.md).
struct SharedFile {
  uint32_t pid = 0;
  int32_t fd = -1;
  uint64_t offset = 0;  // of the region's first byte in the file
  int32_t proof_fd = -1;
  std::array<uint8_t, 16> proof{};
};

// What a peer needs to reach a region. Crosses process boundaries: decode it
// only with Deserialize(), which validates every field.
struct RegionDescriptor {
  uint64_t address = 0;    // virtual address in the owner's process
  uint64_t length = 0;     // bytes
  uint64_t region_id = 0;  // owner-local id, unique per device
  Token128 token;          // capability (128 CSPRNG bits); checked by the owner
  uint64_t device_id = 0;  // random id of the owning device (not a secret)
  std::vector<uint8_t> packed_rkey;       // transport remote key (opaque)
  std::optional<SharedFile> shared_file;  // same-host mapping (v2 only)

  // Wire format: docs/formats/region_descriptor.md.
  std::vector<uint8_t> Serialize() const;
  // Rejects wrong magic/version, truncated or oversized input, a zero
  // length, address + length overflow and a bad checksum.
  static Result<RegionDescriptor> Deserialize(std::span<const uint8_t> bytes);

  static constexpr size_t kMaxPackedRkey = 4096;
};

// Where a region's memory lives.
enum class MemoryType : uint8_t {
  kHost = 0,  // CPU memory (pageable or page-locked)
  kCuda = 1,  // NVIDIA GPU memory (cudaMalloc)
};
const char* MemoryTypeName(MemoryType t);

class MemRegion {
 public:
  virtual ~MemRegion() = default;
  MemRegion(const MemRegion&) = delete;
  MemRegion& operator=(const MemRegion&) = delete;

  void* data() const { return data_; }
  size_t size() const { return size_; }
  uint64_t id() const { return id_; }
  // True when the transport allocated the memory (shareable by mapping).
  bool device_allocated() const { return device_allocated_; }
  MemoryType memory_type() const { return memory_type_; }
  // True when [p, p + n) lies inside the region.
  bool Contains(const void* p, size_t n) const {
    auto b = reinterpret_cast<uintptr_t>(data_);
    auto q = reinterpret_cast<uintptr_t>(p);
    return q >= b && n <= size_ && q - b <= size_ - n;
  }

  virtual RegionDescriptor Export() const = 0;

  // Exports [offset, offset + length) as a region of its own: a new id and a
  // new random access token over the same registration (the pool is
  // registered once; each sub-range gets its own key). The owner checks every
  // import and every active-message access against the sub-range.
  // RevokeRange() makes later imports and accesses of it fail; a same-host
  // peer that already mapped the memory keeps its mapping (load/store cannot
  // be revoked), so revoke only after the peer detached.
  virtual Result<RegionDescriptor> ExportRange(uint64_t offset,
                                               uint64_t length) = 0;
  virtual void RevokeRange(uint64_t range_id) = 0;

 protected:
  MemRegion(void* data, size_t size, uint64_t id, bool device_allocated,
            MemoryType memory_type = MemoryType::kHost)
      : data_(data),
        size_(size),
        id_(id),
        device_allocated_(device_allocated),
        memory_type_(memory_type) {}

 private:
  void* data_;
  size_t size_;
  uint64_t id_;
  bool device_allocated_;
  MemoryType memory_type_;
};

}  // namespace membox::transport

#endif  // MEMBOX_TRANSPORT_MEM_REGION_H_
