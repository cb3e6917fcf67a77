// Fuzzes the memory server's request and response decoders: accepted input
// re-encodes to the same bytes.
#include <cstdlib>
#include <cstring>

#include "src/memserver/protocol.h"

namespace proto = membox::memserver::proto;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto q = proto::DecodeRequest({data, size});
  if (q.ok()) {
    auto again = proto::EncodeRequest(*q);
    if (again.size() != size || std::memcmp(again.data(), data, size) != 0)
      std::abort();
  }
  auto a = proto::DecodeResponse({data, size});
  if (a.ok()) {
    auto again = proto::EncodeResponse(*a);
    if (again.size() != size || std::memcmp(again.data(), data, size) != 0)
      std::abort();
  }
  return 0;
}
