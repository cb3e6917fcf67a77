#include "src/transport/am_messages.h"

#include <algorithm>

#include "membox/base/wire.h"

namespace membox::transport::msg {
namespace {

// U16-prefixed, capped at kMaxString (the transport handshake format).
void PutShortStr(wire::Writer& w, const std::string& s) {
  size_t n = std::min(s.size(), kMaxString);
  w.U16(static_cast<uint16_t>(n));
  w.Bytes(s.data(), n);
}

bool GetShortStr(wire::Reader& r, std::string* s) {
  uint16_t n = 0;
  std::vector<uint8_t> b;
  if (!r.U16(&n) || n > kMaxString || !r.Bytes(&b, n)) return false;
  s->assign(b.begin(), b.end());
  return true;
}

Status Malformed(const char* what) {
  return InvalidArgumentError(std::string("malformed ") + what + " message");
}

Status Done(const wire::Reader& r, const char* what) {
  return r.remaining() == 0 ? Status::Ok() : Malformed(what);
}

}  // namespace

std::vector<uint8_t> EncodeHello(const Hello& m, bool with_lane) {
  wire::Writer w;
  w.U64(m.channel_id);
  if (with_lane) w.U32(m.lane);
  PutShortStr(w, m.name);
  PutShortStr(w, m.host);
  w.U32(static_cast<uint32_t>(m.address.size()));
  w.Bytes(m.address.data(), m.address.size());
  return std::move(w.buffer());
}

Result<Hello> DecodeHello(std::span<const uint8_t> in, bool with_lane) {
  wire::Reader r(in);
  Hello m;
  uint32_t alen = 0;
  if (!r.U64(&m.channel_id) || m.channel_id == 0) return Malformed("hello");
  if (with_lane && !r.U32(&m.lane)) return Malformed("hello");
  if (!GetShortStr(r, &m.name) || !GetShortStr(r, &m.host) || !r.U32(&alen) ||
      alen == 0 || alen > kMaxAddress || !r.Bytes(&m.address, alen)) {
    return Malformed("hello");
  }
  RETURN_IF_ERROR(Done(r, "hello"));
  return m;
}

std::vector<uint8_t> EncodeValidateRequest(const ValidateRequest& m) {
  wire::Writer w;
  w.U64(m.request);
  w.U64(m.region_id);
  w.U64(m.token.hi);
  w.U64(m.token.lo);
  w.U64(m.address);
  w.U64(m.length);
  w.U32(m.rkey_crc);
  return std::move(w.buffer());
}

Result<ValidateRequest> DecodeValidateRequest(std::span<const uint8_t> in) {
  wire::Reader r(in);
  ValidateRequest m;
  if (!r.U64(&m.request) || !r.U64(&m.region_id) || !r.U64(&m.token.hi) ||
      !r.U64(&m.token.lo) || !r.U64(&m.address) || !r.U64(&m.length) ||
      !r.U32(&m.rkey_crc) || m.request == 0) {
    return Malformed("validate");
  }
  RETURN_IF_ERROR(Done(r, "validate"));
  return m;
}

std::vector<uint8_t> EncodeReply(const Reply& m) {
  wire::Writer w;
  w.U64(m.request);
  w.U32(m.code);
  PutShortStr(w, m.message);
  return std::move(w.buffer());
}

Result<Reply> DecodeReply(std::span<const uint8_t> in) {
  wire::Reader r(in);
  Reply m;
  if (!r.U64(&m.request) || !r.U32(&m.code) || !GetShortStr(r, &m.message) ||
      m.request == 0) {
    return Malformed("reply");
  }
  RETURN_IF_ERROR(Done(r, "reply"));
  return m;
}

std::vector<uint8_t> EncodeAccess(const Access& m, bool with_request) {
  wire::Writer w;
  if (with_request) w.U64(m.request);
  w.U64(m.address);
  w.U64(m.region_id);
  w.U64(m.token.hi);
  w.U64(m.token.lo);
  w.U64(m.length);
  return std::move(w.buffer());
}

Result<Access> DecodeAccess(std::span<const uint8_t> in, bool with_request) {
  wire::Reader r(in);
  Access m;
  if (with_request && (!r.U64(&m.request) || m.request == 0))
    return Malformed("access");
  if (!r.U64(&m.address) || !r.U64(&m.region_id) || !r.U64(&m.token.hi) ||
      !r.U64(&m.token.lo) || !r.U64(&m.length)) {
    return Malformed("access");
  }
  RETURN_IF_ERROR(Done(r, "access"));
  return m;
}

std::vector<uint8_t> EncodeId(uint64_t id) {
  wire::Writer w;
  w.U64(id);
  return std::move(w.buffer());
}

Result<uint64_t> DecodeId(std::span<const uint8_t> in) {
  wire::Reader r(in);
  uint64_t id = 0;
  if (!r.U64(&id) || id == 0) return Malformed("flush");
  RETURN_IF_ERROR(Done(r, "flush"));
  return id;
}

std::vector<uint8_t> EncodeError(const Error& m) {
  wire::Writer w;
  w.U32(m.code);
  PutShortStr(w, m.message);
  return std::move(w.buffer());
}

Result<Error> DecodeError(std::span<const uint8_t> in) {
  wire::Reader r(in);
  Error m;
  if (!r.U32(&m.code) || !GetShortStr(r, &m.message)) return Malformed("error");
  RETURN_IF_ERROR(Done(r, "error"));
  return m;
}

Status StatusFromWire(uint32_t code, const std::string& message) {
  if (code == 0) return Status::Ok();
  if (code > static_cast<uint32_t>(StatusCode::kUnauthenticated)) {
    return InternalError("peer sent an unknown status code: " + message);
  }
  return Status(static_cast<StatusCode>(code), "peer: " + message);
}

}  // namespace membox::transport::msg
