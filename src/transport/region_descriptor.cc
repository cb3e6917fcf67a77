#include <algorithm>
#include <climits>

#include "membox/base/wire.h"
#include "membox/transport/mem_region.h"

namespace membox::transport {

const char* MemoryTypeName(MemoryType t) {
  switch (t) {
    case MemoryType::kHost:
      return "host";
    case MemoryType::kCuda:
      return "CUDA";
  }
  return "unknown";
}

namespace {
constexpr uint32_t kMagic = 0x4452424D;  // "MBRD"
// 3 / 4: 128-bit access tokens (1 / 2 carried 64 bits and are refused).
constexpr uint16_t kVersion = 3;  // no shared file
constexpr uint16_t kVersionShared = 4;
constexpr size_t kFixedSize = 4 + 2 + 2 + 8 * 6 + 4;
constexpr size_t kSharedSize = 4 + 4 + 8 + 4 + 16;
}  // namespace

std::vector<uint8_t> RegionDescriptor::Serialize() const {
  wire::Writer w;
  w.U32(kMagic);
  w.U16(shared_file ? kVersionShared : kVersion);
  w.U16(0);
  w.U64(address);
  w.U64(length);
  w.U64(region_id);
  w.U64(token.hi);
  w.U64(token.lo);
  w.U64(device_id);
  w.U32(static_cast<uint32_t>(packed_rkey.size()));
  w.Bytes(packed_rkey.data(), packed_rkey.size());
  if (shared_file) {
    w.U32(shared_file->pid);
    w.U32(static_cast<uint32_t>(shared_file->fd));
    w.U64(shared_file->offset);
    w.U32(static_cast<uint32_t>(shared_file->proof_fd));
    w.Bytes(shared_file->proof.data(), shared_file->proof.size());
  }
  uint32_t crc = wire::Crc32(w.buffer().data(), w.buffer().size());
  w.U32(crc);
  return std::move(w.buffer());
}

Result<RegionDescriptor> RegionDescriptor::Deserialize(
    std::span<const uint8_t> bytes) {
  if (bytes.size() < kFixedSize + 4) {
    return InvalidArgumentError("region descriptor truncated: " +
                                std::to_string(bytes.size()) + " bytes");
  }
  wire::Reader r(bytes);
  uint32_t magic = 0, rkey_len = 0, crc = 0;
  uint16_t version = 0, reserved = 0;
  RegionDescriptor d;
  (void)r.U32(&magic);
  (void)r.U16(&version);
  (void)r.U16(&reserved);
  if (magic != kMagic)
    return InvalidArgumentError("not a region descriptor (bad magic)");
  if (version != kVersion && version != kVersionShared) {
    return InvalidArgumentError("region descriptor version " +
                                std::to_string(version) + " unsupported");
  }
  (void)r.U64(&d.address);
  (void)r.U64(&d.length);
  (void)r.U64(&d.region_id);
  (void)r.U64(&d.token.hi);
  (void)r.U64(&d.token.lo);
  (void)r.U64(&d.device_id);
  (void)r.U32(&rkey_len);
  if (rkey_len > kMaxPackedRkey) {
    return InvalidArgumentError("region descriptor remote key too large: " +
                                std::to_string(rkey_len));
  }
  if (!r.Bytes(&d.packed_rkey, rkey_len)) {
    return InvalidArgumentError("region descriptor truncated");
  }
  if (version == kVersionShared) {
    SharedFile f;
    uint32_t fd = 0, proof_fd = 0;
    std::vector<uint8_t> proof;
    if (r.remaining() < kSharedSize + 4 || !r.U32(&f.pid) || !r.U32(&fd) ||
        !r.U64(&f.offset) || !r.U32(&proof_fd) ||
        !r.Bytes(&proof, f.proof.size())) {
      return InvalidArgumentError("region descriptor shared file truncated");
    }
    if (f.pid == 0 || fd > uint32_t{INT32_MAX} ||
        proof_fd > uint32_t{INT32_MAX}) {
      return InvalidArgumentError(
          "region descriptor names no process or an invalid descriptor");
    }
    f.fd = static_cast<int32_t>(fd);
    f.proof_fd = static_cast<int32_t>(proof_fd);
    std::copy(proof.begin(), proof.end(), f.proof.begin());
    d.shared_file = f;
  }
  if (!r.U32(&crc)) {
    return InvalidArgumentError("region descriptor truncated");
  }
  if (r.remaining() != 0) {
    return InvalidArgumentError("region descriptor has trailing bytes");
  }
  if (wire::Crc32(bytes.data(), r.consumed() - 4) != crc) {
    return DataLossError("region descriptor checksum mismatch");
  }
  if (d.length == 0)
    return InvalidArgumentError("region descriptor of length 0");
  if (d.address + d.length < d.address) {
    return InvalidArgumentError("region descriptor range overflows");
  }
  if (d.shared_file && d.shared_file->offset + d.length < d.length) {
    return InvalidArgumentError("region descriptor file range overflows");
  }
  return d;
}

}  // namespace membox::transport
