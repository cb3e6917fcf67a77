#include "membox/service/envelope.h"

#include <algorithm>
#include <cstring>
#include <string>

namespace membox::service {

std::vector<uint8_t> NewMessage(size_t body_capacity) {
  std::vector<uint8_t> m;
  m.reserve(kHeaderBytes + body_capacity);
  m.resize(kHeaderBytes);
  return m;
}

void WriteHeader(const Header& h, std::vector<uint8_t>* msg) {
  if (msg->size() < kHeaderBytes) msg->insert(msg->begin(), kHeaderBytes, 0);
  uint8_t* p = msg->data();
  p[0] = kEnvelopeVersion;
  p[1] = static_cast<uint8_t>(h.kind);
  std::memcpy(p + 2, &h.method, 2);
  uint32_t code = static_cast<uint32_t>(h.code);
  std::memcpy(p + 4, &code, 4);
  std::memcpy(p + 8, &h.id, 8);
}

std::vector<uint8_t> ErrorReply(uint16_t method, uint64_t id, const Status& s) {
  std::string_view text = s.message();
  text = text.substr(0, kMaxErrorMessage);
  std::vector<uint8_t> m = NewMessage(text.size());
  m.insert(m.end(), text.begin(), text.end());
  Header h;
  h.kind = Kind::kReply;
  h.method = method;
  h.id = id;
  h.code = s.ok() ? StatusCode::kUnknown : s.code();
  WriteHeader(h, &m);
  return m;
}

Result<Header> Decode(std::span<const uint8_t> in,
                      std::span<const uint8_t>* body) {
  if (in.size() < kHeaderBytes) {
    return InvalidArgumentError("service message of " +
                                std::to_string(in.size()) +
                                " bytes is shorter than its header");
  }
  if (in[0] != kEnvelopeVersion) {
    return InvalidArgumentError("service envelope version " +
                                std::to_string(in[0]) + " (this is " +
                                std::to_string(kEnvelopeVersion) + ")");
  }
  Header h;
  uint8_t kind = in[1];
  if (kind < 1 || kind > 3) {
    return InvalidArgumentError("unknown service message kind " +
                                std::to_string(kind));
  }
  h.kind = static_cast<Kind>(kind);
  uint32_t code = 0;
  std::memcpy(&h.method, in.data() + 2, 2);
  std::memcpy(&code, in.data() + 4, 4);
  std::memcpy(&h.id, in.data() + 8, 8);
  if (code > static_cast<uint32_t>(StatusCode::kUnauthenticated)) {
    return InvalidArgumentError("unknown status code " + std::to_string(code));
  }
  h.code = static_cast<StatusCode>(code);
  if (h.kind != Kind::kReply && h.code != StatusCode::kOk) {
    return InvalidArgumentError("a request or notice carries a status code");
  }
  // Id 0 marks what nobody answers: a request needs another, a notice has
  // it (a reply to a notice would fail the sender's link).
  if (h.kind == Kind::kRequest && h.id == 0) {
    return InvalidArgumentError("a request with id 0 (0 is for notices)");
  }
  if (h.kind == Kind::kNotice && h.id != 0) {
    return InvalidArgumentError("a notice with id " + std::to_string(h.id) +
                                " (notices carry 0)");
  }
  auto rest = in.subspan(kHeaderBytes);
  if (h.kind == Kind::kReply && h.code != StatusCode::kOk &&
      rest.size() > kMaxErrorMessage) {
    return InvalidArgumentError("error reply message of " +
                                std::to_string(rest.size()) + " bytes");
  }
  if (body) *body = rest;
  return h;
}

Status ReplyStatus(const Header& h, std::span<const uint8_t> body,
                   const std::string& context) {
  if (h.code == StatusCode::kOk) return Status::Ok();
  std::string text(body.begin(), body.end());
  return Status(h.code, context.empty() ? text : context + ": " + text);
}

}  // namespace membox::service
