// The authenticated connection handshake every membox channel starts with
// (docs/formats/handshake.md, docs/design/network_face.md).
//
// Mutual challenge-response over a plain TCP connection, before any byte
// reaches UCX or a service. The client proves first:
//   1. client -> server  ClientHello      magic, version, client nonce (32 B)
//   2. server -> client  ServerChallenge  magic, version, server nonce
//   3. client -> server  ClientProof      HMAC(K, "membox/3 client" | nc |
//                                         ns | body), body = the channel hello
//                                         and the credential's public id
//   4. server -> client  ServerVerdict    status code + message; on success
//                                         the data path, the server's channel
//                                         hello and HMAC(K, "membox/3 server"
//                                         | nc | ns | client proof | path |
//                                         hello), which the client checks
//                                         before it uses anything else
// K is the cluster secret, or the key of the principal's credential that
// the server derives from the cluster secret and the public id
// (base/credential.h) (HMAC-SHA-256, OpenSSL). No key ever travels;
// nonces are fresh per connection, so a recorded exchange cannot be
// replayed; both proofs are compared in constant time. A peer that does not
// know K receives only a random nonce and a refusal: nothing computed from
// K to test a guessed secret against (version 2 sent the server's proof
// first). An eavesdropper sees both proofs; that is why daemons refuse
// secrets under 32 bytes (docs/formats/handshake.md). Every frame is
// length-prefixed (u32) with a per-step maximum, and every decoder rejects
// short, oversize and trailing input (fuzz/handshake_fuzzer.cc).
//
// Thread-safety: pure functions.
#ifndef MEMBOX_SRC_TRANSPORT_NET_HANDSHAKE_H_
#define MEMBOX_SRC_TRANSPORT_NET_HANDSHAKE_H_

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "membox/base/status.h"

#include "src/transport/am_messages.h"

namespace membox::transport::net {

constexpr uint32_t kHandshakeMagic = 0x3142584d;  // "MXB1" little endian
// 2: UCX control messages carry a sequence number (wire_protocol.md); a
// peer of version 1 is refused at the hello instead of failing later.
// 3: the client proves first; 128-bit region tokens.
constexpr uint16_t kHandshakeVersion = 3;
constexpr size_t kNonceBytes = 32;
constexpr size_t kProofBytes = 32;  // HMAC-SHA-256
// The largest frame of each step (the hello carries a UCX worker address).
constexpr size_t kMaxHelloFrame = 128;  // ClientHello, ServerChallenge 38 B
constexpr size_t kMaxProofFrame = 128 * 1024;

using Nonce = std::array<uint8_t, kNonceBytes>;
using Proof = std::array<uint8_t, kProofBytes>;

// Channel capabilities the client offers; the server picks the data path.
enum HelloFlags : uint32_t {
  kFlagTcpOnly = 1,  // this side was told to use TCP only
  kFlagRdma = 2,     // this side has RDMA devices UCX can use
};

struct ClientHello {
  Nonce nonce{};
};
struct ServerChallenge {
  Nonce nonce{};
};
struct ClientProof {
  Proof proof{};
  uint32_t flags = 0;
  msg::Hello hello;  // channel id, lane, name, host, UCX worker address
  // The public id of the credential the proof is made with
  // (base/credential.h); empty: the cluster secret itself.
  std::string credential;
};
// Data path the server chose for the channel.
enum class DataPath : uint8_t { kUcx = 1, kTcp = 2 };
struct ServerVerdict {
  uint32_t code = 0;  // StatusCode; 0 = accepted
  std::string message;
  DataPath path = DataPath::kTcp;
  msg::Hello hello;  // the server's side (when accepted)
  Proof proof{};     // ServerProofFor (when accepted)
};

std::vector<uint8_t> EncodeClientHello(const ClientHello& m);
Result<ClientHello> DecodeClientHello(std::span<const uint8_t> in);
std::vector<uint8_t> EncodeServerChallenge(const ServerChallenge& m);
Result<ServerChallenge> DecodeServerChallenge(std::span<const uint8_t> in);
std::vector<uint8_t> EncodeClientProof(const ClientProof& m);
Result<ClientProof> DecodeClientProof(std::span<const uint8_t> in);
std::vector<uint8_t> EncodeServerVerdict(const ServerVerdict& m);
Result<ServerVerdict> DecodeServerVerdict(std::span<const uint8_t> in);

// Fresh random nonce from the OS (RAND_bytes).
Nonce NewNonce();
// The client's proof also covers the hello it sends (flags + encoded hello).
Proof ClientProofFor(const std::string& secret, const Nonce& client,
                     const Nonce& server, const ClientProof& m);
// The server's proof, sent only to a client whose proof was right, covers
// that proof and the accepted verdict's data path and hello.
Proof ServerProofFor(const std::string& secret, const Nonce& client,
                     const Nonce& server, const Proof& client_proof,
                     const ServerVerdict& v);
// Constant-time comparison.
bool ProofEquals(const Proof& a, const Proof& b);

}  // namespace membox::transport::net

#endif  // MEMBOX_SRC_TRANSPORT_NET_HANDSHAKE_H_
