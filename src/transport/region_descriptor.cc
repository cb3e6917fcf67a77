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
constexpr uint16_t kVersion = 1;
constexpr size_t kFixedSize = 4 + 2 + 2 + 8 * 5 + 4;
}  // namespace

std::vector<uint8_t> RegionDescriptor::Serialize() const {
  wire::Writer w;
  w.U32(kMagic);
  w.U16(kVersion);
  w.U16(0);
  w.U64(address);
  w.U64(length);
  w.U64(region_id);
  w.U64(token);
  w.U64(device_id);
  w.U32(static_cast<uint32_t>(packed_rkey.size()));
  w.Bytes(packed_rkey.data(), packed_rkey.size());
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
  if (version != kVersion) {
    return InvalidArgumentError("region descriptor version " +
                                std::to_string(version) + " unsupported");
  }
  (void)r.U64(&d.address);
  (void)r.U64(&d.length);
  (void)r.U64(&d.region_id);
  (void)r.U64(&d.token);
  (void)r.U64(&d.device_id);
  (void)r.U32(&rkey_len);
  if (rkey_len > kMaxPackedRkey) {
    return InvalidArgumentError("region descriptor remote key too large: " +
                                std::to_string(rkey_len));
  }
  if (!r.Bytes(&d.packed_rkey, rkey_len) || !r.U32(&crc)) {
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
  return d;
}

}  // namespace membox::transport
