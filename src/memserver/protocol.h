// The memory server's request/response bodies (docs/formats/
// memserver_protocol.md). They travel inside the service envelope
// (service/envelope.h: method = Op, request id, error code and message) as
// transport control messages; every byte comes from another process, so the
// decoders check every length and reject trailing bytes.
// fuzz/memserver_protocol_fuzzer.cc drives them. Thread-safety: pure functions.
#ifndef MEMBOX_SRC_MEMSERVER_PROTOCOL_H_
#define MEMBOX_SRC_MEMSERVER_PROTOCOL_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "membox/base/status.h"
#include "membox/memserver/segment_key.h"

namespace membox::memserver::proto {

enum class Op : uint8_t {
  kRegister = 1,    // name, pid -> client id, heartbeat interval
  kCreate = 2,      // key (empty: assign), size -> segment
  kAttach = 3,      // key, size -> segment
  kDetach = 4,      // key
  kDelete = 5,      // key (master only)
  kAccumulate = 6,  // dst key, src key, dtype, scale, offset, length
  kStatus = 7,      // -> status text
  kHeartbeat = 8,
};
const char* OpName(Op op);

constexpr size_t kMaxName = 256;
constexpr size_t kMaxDescriptor = 8192;
constexpr size_t kMaxText = 1 << 16;
constexpr size_t kMaxProof = 64;

struct Request {
  Op op = Op::kHeartbeat;
  // kRegister (the connection is already authenticated by the transport)
  std::string name;
  uint32_t pid = 0;
  // kCreate / kAttach / kDetach / kDelete; kAccumulate uses key as dst
  SegmentKey key;
  uint64_t size = 0;
  // kAccumulate
  SegmentKey src_key;
  uint8_t dtype = 0;
  double scale = 1.0;
  uint64_t offset = 0;  // byte offset in both segments
  uint64_t length = 0;  // bytes; 0 means to the end of the segment
  // kHeartbeat: the client's cumulative one-sided traffic (the server cannot
  // see one-sided reads and writes itself)
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
  // kStatus: AdminProof(admin secret, the challenge of the kRegister reply)
  // for the full listing; empty for the caller's own view.
  std::vector<uint8_t> admin_proof;
};

// The body of an ok reply (errors travel in the envelope).
struct Response {
  uint64_t client_id = 0;     // kRegister
  uint32_t heartbeat_ms = 0;  // kRegister
  SegmentKey key;             // kCreate / kAttach
  uint64_t size = 0;
  std::vector<uint8_t> descriptor;  // RegionDescriptor of the segment
  std::string text;                 // kStatus
  std::vector<uint8_t> challenge;   // kRegister: for admin proofs
};

// Encoders write after room for the envelope header (service::NewMessage).
std::vector<uint8_t> EncodeRequest(const Request& r);
// `op`: the envelope's method.
Result<Request> DecodeRequest(uint16_t op, std::span<const uint8_t> in);
std::vector<uint8_t> EncodeResponse(const Response& r);
Result<Response> DecodeResponse(std::span<const uint8_t> in);

}  // namespace membox::memserver::proto

#endif  // MEMBOX_SRC_MEMSERVER_PROTOCOL_H_
