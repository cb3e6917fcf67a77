#include "membox/base/hmac.h"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <openssl/rand.h>
#include <sys/random.h>

namespace membox {

Digest HmacSha256(const std::string& key,
                  std::initializer_list<std::span<const uint8_t>> parts) {
  Digest out{};
  // An empty key is legal for HMAC; EVP_MAC_init wants a non-null pointer
  // to set one (null means "keep the previous key").
  static const uint8_t kEmpty = 0;
  const auto* k =
      key.empty() ? &kEmpty : reinterpret_cast<const uint8_t*>(key.data());
  static EVP_MAC* mac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
  EVP_MAC_CTX* ctx = mac ? EVP_MAC_CTX_new(mac) : nullptr;
  char digest[] = "SHA256";
  OSSL_PARAM params[] = {
      OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0),
      OSSL_PARAM_construct_end()};
  size_t len = 0;
  bool ok = ctx != nullptr && EVP_MAC_init(ctx, k, key.size(), params) == 1;
  for (auto p : parts) {
    if (ok && !p.empty()) ok = EVP_MAC_update(ctx, p.data(), p.size()) == 1;
  }
  if (ok) ok = EVP_MAC_final(ctx, out.data(), &len, out.size()) == 1;
  EVP_MAC_CTX_free(ctx);
  // A failing libcrypto must never yield a digest an attacker can predict.
  if (!ok || len != out.size()) std::abort();
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
    // OpenSSL's generator failed: the kernel's, or nothing at all.
    size_t got = 0;
    while (got < n) {
      ssize_t r = getrandom(out.data() + got, n - got, 0);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        std::fprintf(stderr, "membox: no random source (getrandom: %s)\n",
                     std::strerror(errno));
        std::abort();
      }
      got += static_cast<size_t>(r);
    }
  }
  return out;
}

uint64_t RandomU64() {
  std::vector<uint8_t> b = RandomBytes(8);
  uint64_t v = 0;
  std::memcpy(&v, b.data(), 8);
  return v;
}

Token128 Token128::Random() {
  std::vector<uint8_t> b = RandomBytes(16);
  Token128 t;
  std::memcpy(&t.hi, b.data(), 8);
  std::memcpy(&t.lo, b.data() + 8, 8);
  return t;
}

Digest AdminProof(const std::string& admin_secret,
                  std::span<const uint8_t> challenge) {
  static const char kLabel[] = "membox/1 admin";
  return HmacSha256(admin_secret, {std::span<const uint8_t>(
                                       reinterpret_cast<const uint8_t*>(kLabel),
                                       sizeof(kLabel) - 1),
                                   challenge});
}

}  // namespace membox
