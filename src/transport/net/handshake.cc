#include "src/transport/net/handshake.h"

#include <algorithm>
#include <cstring>

#include "membox/base/hmac.h"
#include "membox/base/wire.h"

namespace membox::transport::net {
namespace {

void PutHeader(wire::Writer& w) {
  w.U32(kHandshakeMagic);
  w.U16(kHandshakeVersion);
}

Status GetHeader(wire::Reader& r, const char* what) {
  uint32_t magic = 0;
  uint16_t version = 0;
  if (!r.U32(&magic) || !r.U16(&version)) {
    return InvalidArgumentError(std::string(what) + ": truncated");
  }
  if (magic != kHandshakeMagic) {
    return InvalidArgumentError(std::string(what) +
                                ": not a membox peer (bad magic)");
  }
  if (version != kHandshakeVersion) {
    return InvalidArgumentError(std::string(what) +
                                ": unsupported handshake version " +
                                std::to_string(version));
  }
  return Status::Ok();
}

Status Done(const wire::Reader& r, const char* what) {
  if (r.remaining() != 0) {
    return InvalidArgumentError(std::string(what) + ": trailing bytes");
  }
  return Status::Ok();
}

std::vector<uint8_t> ProofBody(const ClientProof& m) {
  wire::Writer w;
  w.U32(m.flags);
  wire::PutBytes(w, msg::EncodeHello(m.hello, true));
  wire::PutStr(w, m.credential);
  return std::move(w.buffer());
}

// A credential's public id: name (64) + rights + quota + serial.
constexpr size_t kMaxCredentialId = 256;

Proof Hmac(const std::string& secret, std::span<const uint8_t> data) {
  return HmacSha256(secret, {data});
}

}  // namespace

std::vector<uint8_t> EncodeClientHello(const ClientHello& m) {
  wire::Writer w;
  PutHeader(w);
  w.Bytes(m.nonce.data(), m.nonce.size());
  return std::move(w.buffer());
}

Result<ClientHello> DecodeClientHello(std::span<const uint8_t> in) {
  wire::Reader r(in);
  RETURN_IF_ERROR(GetHeader(r, "client hello"));
  ClientHello m;
  if (!r.Copy(m.nonce.data(), m.nonce.size())) {
    return InvalidArgumentError("client hello: truncated nonce");
  }
  RETURN_IF_ERROR(Done(r, "client hello"));
  return m;
}

std::vector<uint8_t> EncodeServerChallenge(const ServerChallenge& m) {
  wire::Writer w;
  PutHeader(w);
  w.Bytes(m.nonce.data(), m.nonce.size());
  return std::move(w.buffer());
}

Result<ServerChallenge> DecodeServerChallenge(std::span<const uint8_t> in) {
  wire::Reader r(in);
  RETURN_IF_ERROR(GetHeader(r, "server challenge"));
  ServerChallenge m;
  if (!r.Copy(m.nonce.data(), m.nonce.size())) {
    return InvalidArgumentError("server challenge: truncated");
  }
  RETURN_IF_ERROR(Done(r, "server challenge"));
  return m;
}

std::vector<uint8_t> EncodeClientProof(const ClientProof& m) {
  wire::Writer w;
  w.Bytes(m.proof.data(), m.proof.size());
  std::vector<uint8_t> body = ProofBody(m);
  w.Bytes(body.data(), body.size());
  return std::move(w.buffer());
}

Result<ClientProof> DecodeClientProof(std::span<const uint8_t> in) {
  wire::Reader r(in);
  ClientProof m;
  std::vector<uint8_t> hello;
  if (!r.Copy(m.proof.data(), m.proof.size()) || !r.U32(&m.flags) ||
      !wire::GetBytes(r, &hello, kMaxProofFrame) ||
      !wire::GetStr(r, &m.credential, kMaxCredentialId)) {
    return InvalidArgumentError("client proof: truncated");
  }
  RETURN_IF_ERROR(Done(r, "client proof"));
  ASSIGN_OR_RETURN(m.hello, msg::DecodeHello(hello, true));
  return m;
}

std::vector<uint8_t> EncodeServerVerdict(const ServerVerdict& m) {
  wire::Writer w;
  w.U32(m.code);
  wire::PutStr(w, m.message);
  if (m.code == 0) {
    w.U8(static_cast<uint8_t>(m.path));
    wire::PutBytes(w, msg::EncodeHello(m.hello, false));
    w.Bytes(m.proof.data(), m.proof.size());
  }
  return std::move(w.buffer());
}

Result<ServerVerdict> DecodeServerVerdict(std::span<const uint8_t> in) {
  wire::Reader r(in);
  ServerVerdict m;
  if (!r.U32(&m.code) || !wire::GetStr(r, &m.message, msg::kMaxString)) {
    return InvalidArgumentError("server verdict: truncated");
  }
  if (m.code != 0) {
    RETURN_IF_ERROR(Done(r, "server verdict"));
    return m;
  }
  uint8_t path = 0;
  std::vector<uint8_t> hello;
  if (!r.U8(&path) || !wire::GetBytes(r, &hello, kMaxProofFrame) ||
      !r.Copy(m.proof.data(), m.proof.size())) {
    return InvalidArgumentError("server verdict: truncated");
  }
  if (path != static_cast<uint8_t>(DataPath::kUcx) &&
      path != static_cast<uint8_t>(DataPath::kTcp)) {
    return InvalidArgumentError("server verdict: unknown data path");
  }
  m.path = static_cast<DataPath>(path);
  RETURN_IF_ERROR(Done(r, "server verdict"));
  ASSIGN_OR_RETURN(m.hello, msg::DecodeHello(hello, false));
  return m;
}

Nonce NewNonce() {
  Nonce n{};
  std::vector<uint8_t> r = RandomBytes(n.size());
  std::copy(r.begin(), r.end(), n.begin());
  return n;
}

Proof ServerProofFor(const std::string& secret, const Nonce& client,
                     const Nonce& server, const Proof& client_proof,
                     const ServerVerdict& v) {
  static const char kLabel[] = "membox/3 server";
  std::vector<uint8_t> data(kLabel, kLabel + sizeof(kLabel) - 1);
  data.insert(data.end(), client.begin(), client.end());
  data.insert(data.end(), server.begin(), server.end());
  data.insert(data.end(), client_proof.begin(), client_proof.end());
  data.push_back(static_cast<uint8_t>(v.path));
  std::vector<uint8_t> hello = msg::EncodeHello(v.hello, false);
  data.insert(data.end(), hello.begin(), hello.end());
  return Hmac(secret, data);
}

Proof ClientProofFor(const std::string& secret, const Nonce& client,
                     const Nonce& server, const ClientProof& m) {
  static const char kLabel[] = "membox/3 client";
  std::vector<uint8_t> data(kLabel, kLabel + sizeof(kLabel) - 1);
  data.insert(data.end(), client.begin(), client.end());
  data.insert(data.end(), server.begin(), server.end());
  std::vector<uint8_t> body = ProofBody(m);
  data.insert(data.end(), body.begin(), body.end());
  return Hmac(secret, data);
}

bool ProofEquals(const Proof& a, const Proof& b) {
  return ConstantTimeEquals(a, b);
}

}  // namespace membox::transport::net
