// Fuzzes the parameter-synchronisation message decoder: accepted input
// re-encodes to the same bytes.
#include <cstdlib>
#include <cstring>

#include "membox/service/envelope.h"

#include "src/ps/protocol.h"

namespace proto = membox::ps::proto;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // The first byte is the envelope's method (the body's type).
  if (size < 1) return 0;
  auto m = proto::Decode(data[0], {data + 1, size - 1});
  if (m.ok()) {
    auto again = proto::Encode(*m);
    constexpr size_t h = membox::service::kHeaderBytes;
    if (again.size() != size - 1 + h ||
        std::memcmp(again.data() + h, data + 1, size - 1) != 0)
      std::abort();
  }
  return 0;
}
