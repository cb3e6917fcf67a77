#include "membox/memserver/segment_key.h"

#include <cstdio>

#include "membox/base/hmac.h"

namespace membox::memserver {

SegmentKey SegmentKey::Random() {
  Token128 t;
  do {
    t = Token128::Random();
  } while (t.empty());
  return SegmentKey(t.hi, t.lo);
}

Result<SegmentKey> SegmentKey::Parse(std::string_view text) {
  if (text.size() != 32) {
    return InvalidArgumentError("a segment key is 32 hex digits, got '" +
                                std::string(text.substr(0, 64)) + "'");
  }
  uint64_t words[2] = {0, 0};
  for (size_t i = 0; i < 32; ++i) {
    const char c = text[i];
    uint64_t v;
    if (c >= '0' && c <= '9') {
      v = static_cast<uint64_t>(c - '0');
    } else if (c >= 'a' && c <= 'f') {
      v = static_cast<uint64_t>(c - 'a' + 10);
    } else if (c >= 'A' && c <= 'F') {
      v = static_cast<uint64_t>(c - 'A' + 10);
    } else {
      return InvalidArgumentError("a segment key is 32 hex digits, got '" +
                                  std::string(text) + "'");
    }
    words[i / 16] = (words[i / 16] << 4) | v;
  }
  return SegmentKey(words[0], words[1]);
}

std::string SegmentKey::ToString() const {
  char buf[33];
  std::snprintf(buf, sizeof(buf), "%016llx%016llx",
                static_cast<unsigned long long>(hi),
                static_cast<unsigned long long>(lo));
  return std::string(buf, 32);
}

}  // namespace membox::memserver
