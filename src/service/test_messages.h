// Test-only helpers of the service layer's tests (service_test,
// link_test): a request whose body is a string, and a body as a string.
#ifndef MEMBOX_SRC_SERVICE_TEST_MESSAGES_H_
#define MEMBOX_SRC_SERVICE_TEST_MESSAGES_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "membox/service/envelope.h"

namespace membox::service::testing {

// A NewMessage buffer with `body` appended.
inline std::vector<uint8_t> Msg(const std::string& body) {
  std::vector<uint8_t> m = NewMessage(body.size());
  m.insert(m.end(), body.begin(), body.end());
  return m;
}

inline std::string Str(std::span<const uint8_t> b) {
  return {b.begin(), b.end()};
}

}  // namespace membox::service::testing

#endif  // MEMBOX_SRC_SERVICE_TEST_MESSAGES_H_
