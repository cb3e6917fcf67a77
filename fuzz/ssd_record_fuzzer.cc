// Fuzzes the SSD tier's file-header and record decoders (parameter files
// are untrusted after a crash or a disk error): accepted records re-encode
// to the same bytes.
#include <cstdlib>
#include <cstring>

#include "src/embedding/ssd_record.h"

using namespace membox::embedding;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  (void)DecodeFileHeader({data, size});
  if (size < kRecordHeaderBytes) return 0;
  uint32_t row = static_cast<uint32_t>(size - kRecordHeaderBytes);
  auto r = DecodeRecord({data, size}, row);
  if (r.ok()) {
    std::vector<uint8_t> again;
    EncodeRecord(r->key, r->seq, r->tombstone, r->row, &again);
    if (again.size() != size || std::memcmp(again.data(), data, size) != 0)
      std::abort();
  }
  return 0;
}
