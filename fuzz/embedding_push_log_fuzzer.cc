// Fuzzes the push log decoder (the log is read after a crash: torn writes,
// disk errors): it never crashes, and every record it accepts re-encodes
// to the bytes it came from.
#include <cstdlib>
#include <cstring>

#include "src/embedding/push_log.h"

using namespace membox::embedding;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<PushLogRecord> records;
  uint64_t cut = 0;
  int version = 0;
  if (!PushLog::Parse({data, size}, &records, &cut, &version).ok()) return 0;
  size_t pos = 8;
  for (const auto& r : records) {
    auto again = PushLog::Encode(r, version);
    if (pos + again.size() > size ||
        std::memcmp(again.data(), data + pos, again.size()) != 0) {
      std::abort();
    }
    pos += again.size();
  }
  if (pos + cut != size) std::abort();
  return 0;
}
