// Fuzzes the ring AllReduce notice decoder: accepted input re-encodes to the
// same bytes.
#include <cstdlib>
#include <cstring>

#include "src/collective/ring_message.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto m = membox::collective::DecodeRing({data, size});
  if (m.ok()) {
    auto again = membox::collective::EncodeRing(*m);
    if (again.size() != size || std::memcmp(again.data(), data, size) != 0)
      std::abort();
  }
  return 0;
}
