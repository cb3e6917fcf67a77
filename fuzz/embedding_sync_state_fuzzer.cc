// Fuzzes the sync state decoder (a table's SYNCSTATE file, read at a
// node's start: torn writes, disk errors): it never crashes, and every
// state it accepts re-encodes to the bytes it came from.
#include <cstdlib>
#include <cstring>

#include "src/embedding/sync_state.h"

using namespace membox::embedding;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto s = ParseSyncState({data, size});
  if (!s.ok()) return 0;
  auto again = EncodeSyncState(*s);
  if (again.size() != size || std::memcmp(again.data(), data, size) != 0) {
    std::abort();
  }
  return 0;
}
