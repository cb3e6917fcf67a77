#include "src/memserver/protocol.h"

#include <cmath>
#include <cstring>

#include "membox/base/wire.h"
#include "membox/service/envelope.h"

namespace membox::memserver::proto {
namespace {

using wire::GetBytes;
using wire::GetF64;
using wire::GetStr;
using wire::PutBytes;
using wire::PutF64;
using wire::PutStr;
using wire::Reader;
using wire::Writer;

constexpr uint8_t kRequestMagic = 'Q';
constexpr uint8_t kResponseMagic = 'A';
// 2: inside the service envelope (op = the envelope's method; request id,
// status code and error message travel there). 3: 128-bit segment keys.
constexpr uint8_t kVersion = 3;

void PutKey(Writer& w, const SegmentKey& k) {
  w.U64(k.hi);
  w.U64(k.lo);
}
bool GetKey(Reader& r, SegmentKey* k) { return r.U64(&k->hi) && r.U64(&k->lo); }

Status Bad(const char* what) {
  return InvalidArgumentError(std::string("malformed memory-server ") + what);
}

}  // namespace

const char* OpName(Op op) {
  switch (op) {
    case Op::kRegister:
      return "register";
    case Op::kCreate:
      return "create";
    case Op::kAttach:
      return "attach";
    case Op::kDetach:
      return "detach";
    case Op::kDelete:
      return "delete";
    case Op::kAccumulate:
      return "accumulate";
    case Op::kStatus:
      return "status";
    case Op::kHeartbeat:
      return "heartbeat";
  }
  return "?";
}

std::vector<uint8_t> EncodeRequest(const Request& q) {
  Writer w(service::NewMessage());
  w.U8(kRequestMagic);
  w.U8(kVersion);
  switch (q.op) {
    case Op::kRegister:
      PutStr(w, q.name);
      w.U32(q.pid);
      break;
    case Op::kCreate:
    case Op::kAttach:
      PutKey(w, q.key);
      w.U64(q.size);
      break;
    case Op::kDetach:
    case Op::kDelete:
      PutKey(w, q.key);
      break;
    case Op::kAccumulate:
      PutKey(w, q.key);
      PutKey(w, q.src_key);
      w.U8(q.dtype);
      PutF64(w, q.scale);
      w.U64(q.offset);
      w.U64(q.length);
      break;
    case Op::kHeartbeat:
      w.U64(q.bytes_read);
      w.U64(q.bytes_written);
      break;
    case Op::kStatus:
      PutBytes(w, q.admin_proof);
      break;
  }
  return std::move(w.buffer());
}

Result<Request> DecodeRequest(uint16_t op, std::span<const uint8_t> in) {
  Request q;
  if (op < 1 || op > static_cast<uint8_t>(Op::kHeartbeat)) {
    return Bad("request (unknown operation)");
  }
  q.op = static_cast<Op>(op);
  Reader r(in);
  uint8_t magic = 0, version = 0;
  if (!r.U8(&magic) || magic != kRequestMagic) return Bad("request (magic)");
  if (!r.U8(&version) || version != kVersion) return Bad("request (version)");
  bool ok = true;
  switch (q.op) {
    case Op::kRegister:
      ok = GetStr(r, &q.name, kMaxName) && r.U32(&q.pid);
      break;
    case Op::kCreate:
    case Op::kAttach:
      ok = GetKey(r, &q.key) && r.U64(&q.size);
      break;
    case Op::kDetach:
    case Op::kDelete:
      ok = GetKey(r, &q.key);
      break;
    case Op::kAccumulate:
      ok = GetKey(r, &q.key) && GetKey(r, &q.src_key) && r.U8(&q.dtype) &&
           GetF64(r, &q.scale) && r.U64(&q.offset) && r.U64(&q.length) &&
           std::isfinite(q.scale);
      break;
    case Op::kHeartbeat:
      ok = r.U64(&q.bytes_read) && r.U64(&q.bytes_written);
      break;
    case Op::kStatus:
      ok = GetBytes(r, &q.admin_proof, kMaxProof);
      break;
  }
  if (!ok || r.remaining() != 0) return Bad(OpName(q.op));
  return q;
}

std::vector<uint8_t> EncodeResponse(const Response& a) {
  Writer w(service::NewMessage());
  w.U8(kResponseMagic);
  w.U8(kVersion);
  w.U64(a.client_id);
  w.U32(a.heartbeat_ms);
  PutKey(w, a.key);
  w.U64(a.size);
  w.U32(static_cast<uint32_t>(a.descriptor.size()));
  w.Bytes(a.descriptor.data(), a.descriptor.size());
  PutStr(w, a.text);
  PutBytes(w, a.challenge);
  return std::move(w.buffer());
}

Result<Response> DecodeResponse(std::span<const uint8_t> in) {
  Reader r(in);
  uint8_t magic = 0, version = 0;
  Response a;
  uint32_t dlen = 0;
  if (!r.U8(&magic) || magic != kResponseMagic || !r.U8(&version) ||
      version != kVersion || !r.U64(&a.client_id) || !r.U32(&a.heartbeat_ms) ||
      !GetKey(r, &a.key) || !r.U64(&a.size) || !r.U32(&dlen) ||
      dlen > kMaxDescriptor || !r.Bytes(&a.descriptor, dlen) ||
      !GetStr(r, &a.text, kMaxText) || !GetBytes(r, &a.challenge, kMaxProof) ||
      r.remaining() != 0) {
    return Bad("response");
  }
  return a;
}

}  // namespace membox::memserver::proto
