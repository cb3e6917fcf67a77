// The envelope of every service message (docs/formats/service_envelope.md):
// a fixed 16-byte header -- version, kind, method, status code, request id --
// followed by the service's body. Requests and replies of the memory server,
// the parameter proxy and the embedding server all travel in it, so request
// ids, error codes and error messages are coded and checked in one place.
//
// A service encodes a message by appending its body to NewMessage()'s
// buffer (header room reserved at the front); Server / Client fill the
// header in place, so a 1 MiB body is never copied to be framed.
//
// Error replies carry the error message as their body (at most
// kMaxErrorMessage bytes).
//
// Thread-safety: pure functions.
#ifndef MEMBOX_SERVICE_ENVELOPE_H_
#define MEMBOX_SERVICE_ENVELOPE_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "membox/base/status.h"

namespace membox::service {

enum class Kind : uint8_t {
  kRequest = 1,  // client -> server, answered by exactly one kReply
  kReply = 2,    // server -> client, same method and id as the request
  kNotice = 3,   // either way, no reply (id 0)
};

constexpr uint8_t kEnvelopeVersion = 1;
constexpr size_t kHeaderBytes = 16;
constexpr size_t kMaxErrorMessage = 4096;

struct Header {
  Kind kind = Kind::kRequest;
  uint16_t method = 0;
  StatusCode code = StatusCode::kOk;  // kReply only; kOk otherwise
  uint64_t id = 0;
};

// A buffer with room for the header; append the body after it.
std::vector<uint8_t> NewMessage(size_t body_capacity = 0);

// Writes `h` into the first kHeaderBytes of `msg` (a NewMessage buffer).
void WriteHeader(const Header& h, std::vector<uint8_t>* msg);

// An error reply: header plus the (truncated) message of `s` (not ok).
std::vector<uint8_t> ErrorReply(uint16_t method, uint64_t id, const Status& s);

// Checks the header of a received message: length, version, kind, a known
// status code (kOk for requests and notices), a reply's error body size.
// `body` (optional) receives the bytes after the header.
Result<Header> Decode(std::span<const uint8_t> in,
                      std::span<const uint8_t>* body = nullptr);

// The status an error reply carries: its code with `context` + ": " + the
// message of its body.
Status ReplyStatus(const Header& h, std::span<const uint8_t> body,
                   const std::string& context);

}  // namespace membox::service

#endif  // MEMBOX_SERVICE_ENVELOPE_H_
