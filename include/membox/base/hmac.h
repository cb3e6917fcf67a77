// Message authentication for every layer: HMAC-SHA-256 (OpenSSL libcrypto),
// constant-time comparison and OS-random bytes. Used by the transport's
// connection handshake and by services that prove a second credential over
// an authenticated channel (the memory server's admin listing).
// Thread-safety: pure functions.
#ifndef MEMBOX_BASE_HMAC_H_
#define MEMBOX_BASE_HMAC_H_

#include <array>
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
// `n` bytes from the OS's random generator.
std::vector<uint8_t> RandomBytes(size_t n);

// "membox/1 admin" challenge-response: proof that the caller knows the admin
// secret for a server-chosen challenge.
Digest AdminProof(const std::string& admin_secret,
                  std::span<const uint8_t> challenge);

}  // namespace membox

#endif  // MEMBOX_BASE_HMAC_H_
