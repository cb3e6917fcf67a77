#include "membox/base/hmac.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <random>

namespace membox {

Digest HmacSha256(const std::string& key,
                  std::initializer_list<std::span<const uint8_t>> parts) {
  Digest out{};
  static const uint8_t kEmpty = 0;
  const void* k = key.empty() ? static_cast<const void*>(&kEmpty)
                              : static_cast<const void*>(key.data());
  HMAC_CTX* ctx = HMAC_CTX_new();
  unsigned int len = 0;
  if (ctx != nullptr &&
      HMAC_Init_ex(ctx, k, static_cast<int>(key.size()), EVP_sha256(),
                   nullptr) == 1) {
    for (auto p : parts) {
      if (!p.empty()) HMAC_Update(ctx, p.data(), p.size());
    }
    HMAC_Final(ctx, out.data(), &len);
  }
  HMAC_CTX_free(ctx);
  return out;
}

bool ConstantTimeEquals(std::span<const uint8_t> a,
                        std::span<const uint8_t> b) {
  if (a.size() != b.size()) return false;
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

std::vector<uint8_t> RandomBytes(size_t n) {
  std::vector<uint8_t> out(n);
  if (n > 0 && RAND_bytes(out.data(), static_cast<int>(n)) != 1) {
    std::random_device rd;  // the OS generator, if OpenSSL's failed
    for (auto& b : out) b = static_cast<uint8_t>(rd());
  }
  return out;
}

Digest AdminProof(const std::string& admin_secret,
                  std::span<const uint8_t> challenge) {
  static const char kLabel[] = "membox/1 admin";
  return HmacSha256(admin_secret,
                    {std::span<const uint8_t>(
                         reinterpret_cast<const uint8_t*>(kLabel),
                         sizeof(kLabel) - 1),
                     challenge});
}

}  // namespace membox
