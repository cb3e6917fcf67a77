// Records and file headers of the SSD tier (docs/formats/ssd_tier.md).
// Files on disk are untrusted input after a crash or a disk error: the
// decoders check magic, sizes and checksums; fuzz/ssd_record_fuzzer.cc
// drives them. Thread-safety: pure functions.
#ifndef MEMBOX_SRC_EMBEDDING_SSD_RECORD_H_
#define MEMBOX_SRC_EMBEDDING_SSD_RECORD_H_

#include <cstdint>
#include <span>
#include <vector>

#include "membox/base/status.h"

namespace membox::embedding {

constexpr size_t kFileHeaderBytes = 16;
constexpr size_t kRecordHeaderBytes = 32;
constexpr uint32_t kMaxRowBytes = 1 << 20;

struct RecordView {
  uint64_t key = 0;
  uint64_t seq = 0;
  bool tombstone = false;
  std::span<const uint8_t> row;
};

std::vector<uint8_t> EncodeFileHeader(uint32_t row_bytes);
// The row size the file was written with.
Result<uint32_t> DecodeFileHeader(std::span<const uint8_t> in);

// Appends one record (kRecordHeaderBytes + row.size() bytes) to `out`.
void EncodeRecord(uint64_t key, uint64_t seq, bool tombstone,
                  std::span<const uint8_t> row, std::vector<uint8_t>* out);
// `in` must be exactly one record of `row_bytes`.
Result<RecordView> DecodeRecord(std::span<const uint8_t> in,
                                uint32_t row_bytes);

}  // namespace membox::embedding

#endif  // MEMBOX_SRC_EMBEDDING_SSD_RECORD_H_
