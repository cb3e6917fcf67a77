// What the workers' direct collectives with a buffer per peer (Mesh,
// PointToPoint) are made with: one struct, so both are set up, checked and
// bound alike.
#ifndef MEMBOX_COLLECTIVE_DIRECT_OPTIONS_H_
#define MEMBOX_COLLECTIVE_DIRECT_OPTIONS_H_

#include <chrono>
#include <cstddef>
#include <string>

namespace membox::collective {

struct DirectOptions {
  int rank = 0;
  int world = 1;
  std::string listen = "0.0.0.0:0";
  std::string transports = "auto";
  // Shared secret: peers prove it when they connect.
  std::string secret;
  // Buffer budget: each peer's receive buffer (and each send buffer) is
  // max_bytes / world, at least 64 KiB. A call may move any number of
  // bytes.
  size_t max_bytes = 16 << 20;
  // Bytes up to this many go inside their notice instead of through the
  // buffer (equal on every worker; at most 1 MiB less a header, the
  // control path's limit).
  size_t inline_bytes = 512 << 10;
  // How long a call waits for a peer: its notice, its ACK, its connection.
  std::chrono::milliseconds timeout{60000};
};

}  // namespace membox::collective

#endif  // MEMBOX_COLLECTIVE_DIRECT_OPTIONS_H_
