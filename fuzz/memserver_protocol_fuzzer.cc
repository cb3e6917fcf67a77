// Fuzzes the memory server's body decoders. The first byte is the
// envelope's method (the request's op), the rest a request body; the whole
// input is also tried as a response body. Accepted input re-encodes to the
// same bytes.
#include <cstdlib>
#include <cstring>

#include "membox/service/envelope.h"

#include "src/memserver/protocol.h"

namespace proto = membox::memserver::proto;
constexpr size_t kHeader = membox::service::kHeaderBytes;

static void Same(const std::vector<uint8_t>& again, const uint8_t* data,
                 size_t size) {
  if (again.size() != size + kHeader ||
      std::memcmp(again.data() + kHeader, data, size) != 0)
    std::abort();
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size >= 1) {
    auto q = proto::DecodeRequest(data[0], {data + 1, size - 1});
    if (q.ok()) Same(proto::EncodeRequest(*q), data + 1, size - 1);
  }
  auto a = proto::DecodeResponse({data, size});
  if (a.ok()) Same(proto::EncodeResponse(*a), data, size);
  return 0;
}
