// Fuzzes the service envelope's decoder (every message of the memory
// server, proxy and embedding server passes it first): accepted headers
// re-encode to the same bytes, and an error reply's status is well formed.
#include <cstdlib>
#include <cstring>

#include "membox/service/envelope.h"

namespace service = membox::service;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const uint8_t> body;
  auto h = service::Decode({data, size}, &body);
  if (!h.ok()) return 0;
  std::vector<uint8_t> again = service::NewMessage();
  service::WriteHeader(*h, &again);
  if (std::memcmp(again.data(), data, service::kHeaderBytes) != 0) std::abort();
  if (body.size() != size - service::kHeaderBytes) std::abort();
  membox::Status s = service::ReplyStatus(*h, body, "node");
  if (s.ok() != (h->code == membox::StatusCode::kOk)) std::abort();
  return 0;
}
