// Message authentication for every layer: HMAC-SHA-256 (OpenSSL libcrypto),
// constant-time comparison and OS-random bytes. Used by the transport's
// connection handshake and by services that prove a second credential over
// an authenticated channel (the memory server's admin listing).
// Thread-safety: pure functions.
#ifndef MEMBOX_BASE_HMAC_H_
#define MEMBOX_BASE_HMAC_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace membox {

using Digest = std::array<uint8_t, 32>;

// HMAC-SHA-256 of the concatenation of `parts` under `key` (any length,
// empty included).
Digest HmacSha256(const std::string& key,
                  std::initializer_list<std::span<const uint8_t>> parts);
// Compares in time independent of where the inputs differ; false when the
// lengths differ.
bool ConstantTimeEquals(std::span<const uint8_t> a, std::span<const uint8_t> b);
// `n` bytes from a CSPRNG (OpenSSL's RAND_bytes, else getrandom(2)); aborts
// the process rather than return predictable bytes.
std::vector<uint8_t> RandomBytes(size_t n);
// 64 bits from the same CSPRNG (identifiers that must not be guessable).
uint64_t RandomU64();

// A capability: 128 bits drawn from the CSPRNG, never derived from another
// value a peer sees (docs/design/network_face.md, "Capabilities"). Region
// access tokens are Token128s. Equality is constant-time.
struct Token128 {
  uint64_t hi = 0;
  uint64_t lo = 0;
  static Token128 Random();
  bool empty() const { return hi == 0 && lo == 0; }
  friend bool operator==(const Token128& a, const Token128& b) {
    // No early exit on the first differing word.
    return ((a.hi ^ b.hi) | (a.lo ^ b.lo)) == 0;
  }
};

// "membox/1 admin" challenge-response: proof that the caller knows the admin
// secret for a server-chosen challenge.
Digest AdminProof(const std::string& admin_secret,
                  std::span<const uint8_t> challenge);

}  // namespace membox

#endif  // MEMBOX_BASE_HMAC_H_
