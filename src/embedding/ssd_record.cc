#include "src/embedding/ssd_record.h"

#include <cstring>

#include "membox/base/wire.h"

namespace membox::embedding {
namespace {

constexpr char kFileMagic[8] = {'M', 'B', 'X', 'S', 'S', 'D', '0', '1'};
constexpr uint32_t kRecordMagic = 0x5245424D;  // "MBER"

uint32_t Get32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
uint64_t Get64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

}  // namespace

std::vector<uint8_t> EncodeFileHeader(uint32_t row_bytes) {
  std::vector<uint8_t> h(kFileHeaderBytes, 0);
  std::memcpy(h.data(), kFileMagic, 8);
  std::memcpy(h.data() + 8, &row_bytes, 4);
  uint32_t crc = wire::Crc32(h.data(), 12);
  std::memcpy(h.data() + 12, &crc, 4);
  return h;
}

Result<uint32_t> DecodeFileHeader(std::span<const uint8_t> in) {
  if (in.size() < kFileHeaderBytes ||
      std::memcmp(in.data(), kFileMagic, 8) != 0) {
    return DataLossError("not a membox parameter file (bad magic)");
  }
  if (wire::Crc32(in.data(), 12) != Get32(in.data() + 12)) {
    return DataLossError("parameter file header checksum mismatch");
  }
  uint32_t row = Get32(in.data() + 8);
  if (row == 0 || row > kMaxRowBytes) {
    return DataLossError("parameter file header: implausible row size");
  }
  return row;
}

void EncodeRecord(uint64_t key, uint64_t seq, bool tombstone,
                  std::span<const uint8_t> row, std::vector<uint8_t>* out) {
  size_t at = out->size();
  out->resize(at + kRecordHeaderBytes + row.size());
  uint8_t* p = out->data() + at;
  uint32_t flags = tombstone ? 1 : 0;
  uint32_t n = static_cast<uint32_t>(row.size());
  std::memcpy(p, &kRecordMagic, 4);
  std::memcpy(p + 8, &key, 8);
  std::memcpy(p + 16, &seq, 8);
  std::memcpy(p + 24, &flags, 4);
  std::memcpy(p + 28, &n, 4);
  if (!row.empty()) std::memcpy(p + kRecordHeaderBytes, row.data(), row.size());
  uint32_t crc = wire::Crc32(p + 8, kRecordHeaderBytes - 8 + row.size());
  std::memcpy(p + 4, &crc, 4);
}

Result<RecordView> DecodeRecord(std::span<const uint8_t> in,
                                uint32_t row_bytes) {
  if (in.size() != kRecordHeaderBytes + row_bytes) {
    return InvalidArgumentError("record size mismatch");
  }
  const uint8_t* p = in.data();
  if (Get32(p) != kRecordMagic) return DataLossError("record: bad magic");
  if (wire::Crc32(p + 8, in.size() - 8) != Get32(p + 4)) {
    return DataLossError("record: checksum mismatch");
  }
  uint32_t flags = Get32(p + 24), n = Get32(p + 28);
  if (flags > 1 || n != row_bytes) {
    return DataLossError("record: bad flags or row size");
  }
  RecordView r;
  r.key = Get64(p + 8);
  r.seq = Get64(p + 16);
  r.tombstone = flags == 1;
  r.row = in.subspan(kRecordHeaderBytes, row_bytes);
  return r;
}

}  // namespace membox::embedding
