// Fuzzes the connection handshake's decoders (the first bytes any network
// peer can send a membox daemon) and checks that whatever decodes
// re-encodes to the same bytes. The first byte picks the decoder.
#include <cstdlib>
#include <cstring>

#include "src/transport/net/handshake.h"

namespace net = membox::transport::net;

namespace {
template <typename M, typename Dec, typename Enc>
void RoundTrip(std::span<const uint8_t> in, Dec dec, Enc enc) {
  auto m = dec(in);
  if (!m.ok()) return;
  std::vector<uint8_t> again = enc(*m);
  if (again.size() != in.size() ||
      std::memcmp(again.data(), in.data(), in.size()) != 0) {
    std::abort();
  }
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  std::span<const uint8_t> in(data + 1, size - 1);
  switch (data[0] % 4) {
    case 0:
      RoundTrip<net::ClientHello>(in, net::DecodeClientHello,
                                  net::EncodeClientHello);
      break;
    case 1:
      RoundTrip<net::ServerChallenge>(in, net::DecodeServerChallenge,
                                      net::EncodeServerChallenge);
      break;
    case 2: {
      auto m = net::DecodeClientProof(in);
      // A decoded proof is checked like the server does; it must not match
      // a proof under a secret the fuzzer cannot know.
      if (m.ok()) {
        net::Nonce a{}, b{};
        if (net::ProofEquals(
                m->proof,
                net::ClientProofFor("fuzz-secret-not-in-input", a, b, *m))) {
          std::abort();
        }
      }
      break;
    }
    case 3:
      (void)net::DecodeServerVerdict(in);
      break;
  }
  return 0;
}
