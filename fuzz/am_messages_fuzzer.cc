// Fuzzes every active-message header decoder; the first byte picks one.
#include <cstdlib>

#include "src/transport/am_messages.h"

namespace msg = membox::transport::msg;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  std::span<const uint8_t> in(data + 1, size - 1);
  switch (data[0] % 8) {
    case 0: {
      auto m = msg::DecodeHello(in, true);
      if (m.ok() &&
          (m->address.empty() || m->address.size() > msg::kMaxAddress))
        std::abort();
      break;
    }
    case 1:
      (void)msg::DecodeHello(in, false);
      break;
    case 2:
      (void)msg::DecodeValidateRequest(in);
      break;
    case 3: {
      auto m = msg::DecodeReply(in);
      if (m.ok()) (void)msg::StatusFromWire(m->code, m->message);
      break;
    }
    case 4:
      (void)msg::DecodeAccess(in, true);
      break;
    case 5:
      (void)msg::DecodeAccess(in, false);
      break;
    case 6:
      (void)msg::DecodeId(in);
      break;
    case 7:
      (void)msg::DecodeError(in);
      break;
  }
  return 0;
}
