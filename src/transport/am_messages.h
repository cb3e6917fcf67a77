// Encoders and validating decoders of the transport's active-message headers
// (docs/formats/wire_protocol.md). Every header crosses a process boundary,
// so every Decode* checks lengths, string and blob bounds, and rejects
// trailing bytes; fuzz/am_messages_fuzzer.cc drives them with random input.
// Thread-safety: pure functions.
#ifndef MEMBOX_SRC_TRANSPORT_AM_MESSAGES_H_
#define MEMBOX_SRC_TRANSPORT_AM_MESSAGES_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "membox/base/hmac.h"
#include "membox/base/status.h"

namespace membox::transport::msg {

constexpr size_t kMaxString = 4096;
constexpr size_t kMaxAddress = 65536;

struct Hello {              // kAmHello (with lane) and kAmHelloAck (without)
  uint64_t channel_id = 0;  // the sender's id for this channel, never 0
  uint32_t lane = 0;
  std::string name;
  std::string host;
  std::vector<uint8_t> address;  // UCX worker address, 1..kMaxAddress bytes
};
std::vector<uint8_t> EncodeHello(const Hello& m, bool with_lane);
Result<Hello> DecodeHello(std::span<const uint8_t> in, bool with_lane);

struct ValidateRequest {  // kAmValidateReq
  uint64_t request = 0;
  uint64_t region_id = 0;
  Token128 token;
  uint64_t address = 0;
  uint64_t length = 0;
  uint32_t rkey_crc = 0;
};
std::vector<uint8_t> EncodeValidateRequest(const ValidateRequest& m);
Result<ValidateRequest> DecodeValidateRequest(std::span<const uint8_t> in);

struct Reply {  // kAmValidateResp, kAmReadResp: request id and a status
  uint64_t request = 0;
  uint32_t code = 0;  // StatusCode; 0 is OK
  std::string message;
};
std::vector<uint8_t> EncodeReply(const Reply& m);
Result<Reply> DecodeReply(std::span<const uint8_t> in);

struct Access {  // kAmWrite (request unused) and kAmReadReq
  uint64_t request = 0;
  uint64_t address = 0;
  uint64_t region_id = 0;
  Token128 token;
  uint64_t length = 0;
};
std::vector<uint8_t> EncodeAccess(const Access& m, bool with_request);
Result<Access> DecodeAccess(std::span<const uint8_t> in, bool with_request);

// kAmFlushReq / kAmFlushResp: one request id.
std::vector<uint8_t> EncodeId(uint64_t id);
Result<uint64_t> DecodeId(std::span<const uint8_t> in);

struct Error {  // kAmError
  uint32_t code = 0;
  std::string message;
};
std::vector<uint8_t> EncodeError(const Error& m);
Result<Error> DecodeError(std::span<const uint8_t> in);

// Maps a wire status code to a Status ("peer: message"); unknown codes
// become kInternal.
Status StatusFromWire(uint32_t code, const std::string& message);

}  // namespace membox::transport::msg

#endif  // MEMBOX_SRC_TRANSPORT_AM_MESSAGES_H_
