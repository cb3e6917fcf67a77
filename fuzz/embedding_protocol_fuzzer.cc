// Fuzzes the embedding service's message decoder: accepted input
// re-encodes to the same bytes.
#include <cstdlib>
#include <cstring>

#include "src/embedding/protocol.h"

namespace proto = membox::embedding::proto;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto m = proto::Decode({data, size});
  if (m.ok()) {
    auto again = proto::Encode(*m);
    if (again.size() != size || std::memcmp(again.data(), data, size) != 0)
      std::abort();
  }
  return 0;
}
