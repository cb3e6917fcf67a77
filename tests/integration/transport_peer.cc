// A separate process speaking the transport, started by the multi-process
// and network-namespace tests. Modes:
//   recv <transports> <listen> <bytes> <rounds>   receive static tensors and
//       check that round r is filled with the byte r; exit 0 when all arrived
//   send <transports> <endpoint> <bytes> <rounds>  send static tensors
// Prints "READY <endpoint>" (recv) once listening; errors go to stderr with a
// non-zero exit code.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "membox/base/config.h"
#include "membox/base/logging.h"
#include "membox/transport/device.h"
#include "membox/transport/tensor_transfer.h"

using namespace membox;
using namespace membox::transport;
using namespace std::chrono_literals;

namespace {

int Fail(const Status& s, const char* what) {
  std::fprintf(stderr, "transport_peer: %s: %s\n", what, s.ToString().c_str());
  return 1;
}

int Recv(const std::string& transports, const std::string& listen, size_t bytes,
         int rounds) {
  DeviceOptions o;
  o.listen_address = listen;
  o.transports = transports;
  o.name = "peer-recv";
  auto dev = Device::Create(o);
  if (!dev.ok()) return Fail(dev.status(), "device");
  std::printf("READY %s\n", (*dev)->listen_endpoint().c_str());
  std::fflush(stdout);
  auto ch = (*dev)->Accept(60s);
  if (!ch.ok()) return Fail(ch.status(), "accept");
  auto r = StaticTensorReceiver::Create(**dev, *ch, bytes, 30s);
  if (!r.ok()) return Fail(r.status(), "receiver");
  for (int i = 0; i < rounds; ++i) {
    Status s = (*r)->Wait(60s);
    if (!s.ok()) return Fail(s, "wait");
    auto* d = static_cast<uint8_t*>((*r)->data());
    for (size_t k = 0; k < bytes; k += 4093) {
      if (d[k] != static_cast<uint8_t>(i)) {
        std::fprintf(stderr, "transport_peer: round %d byte %zu is %d\n", i, k,
                     d[k]);
        return 3;
      }
    }
    if (d[bytes - 1] != static_cast<uint8_t>(i)) return 3;
    s = (*r)->Release();
    if (!s.ok()) return Fail(s, "release");
    std::printf("GOT %d\n", i);
    std::fflush(stdout);
  }
  std::printf("DONE %s\n", ProtocolName((*ch)->protocol()));
  return 0;
}

int Send(const std::string& transports, const std::string& endpoint,
         size_t bytes, int rounds) {
  DeviceOptions o;
  o.transports = transports;
  o.name = "peer-send";
  auto dev = Device::Create(o);
  if (!dev.ok()) return Fail(dev.status(), "device");
  auto ch = (*dev)->GetChannel(endpoint, 0);
  if (!ch.ok()) return Fail(ch.status(), "connect");
  auto s = StaticTensorSender::Create(**dev, *ch, 30s);
  if (!s.ok()) return Fail(s.status(), "sender");
  auto region = (*dev)->AllocateMemRegion(bytes);
  if (!region.ok()) return Fail(region.status(), "region");
  for (int i = 0; i < rounds; ++i) {
    std::memset((*region)->data(), i, bytes);
    Status st = (*s)->Send((*region)->data(), **region, bytes, 60s);
    if (!st.ok()) return Fail(st, "send");
    std::printf("SENT %d\n", i);
    std::fflush(stdout);
  }
  Status st = (*s)->WaitReleased(60s);
  if (!st.ok()) return Fail(st, "final release");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  InitLogging("transport-peer");
  if (argc != 6) {
    std::fprintf(
        stderr,
        "usage: transport_peer recv|send TRANSPORTS ADDR BYTES ROUNDS\n");
    return 2;
  }
  std::string mode = argv[1];
  auto bytes = ParseByteSize(argv[4]);
  int rounds = std::atoi(argv[5]);
  if (!bytes.ok() || *bytes == 0 || rounds <= 0) {
    std::fprintf(stderr, "transport_peer: bad BYTES or ROUNDS\n");
    return 2;
  }
  if (mode == "recv") return Recv(argv[2], argv[3], *bytes, rounds);
  if (mode == "send") return Send(argv[2], argv[3], *bytes, rounds);
  std::fprintf(stderr, "transport_peer: unknown mode '%s'\n", mode.c_str());
  return 2;
}
