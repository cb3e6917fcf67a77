// Fuzzes the credential decoders (base/credential.h): the public id a peer
// names in its handshake and the credential line read from a file. Any
// input is refused or is canonical (encodes back to exactly itself).
#include <cstdlib>
#include <string>

#include "membox/base/credential.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string in(reinterpret_cast<const char*>(data), size);
  auto p = membox::ParsePublicId(in);
  if (p.ok()) {
    if (p->public_id() != in || p->cluster) std::abort();
    if (!membox::ValidatePrincipalName(p->name).ok()) std::abort();
  }
  auto c = membox::Credential::Parse(in);
  if (c.ok()) {
    if (c->key.size() != 32) std::abort();
    auto again = membox::Credential::Parse(c->Encode());
    if (!again.ok() || again->key != c->key ||
        again->principal.public_id() != c->principal.public_id()) {
      std::abort();
    }
  }
  return 0;
}
