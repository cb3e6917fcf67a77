// `membox bench transfer` (seed 002 Fig. 8): one tensor sent and consumed
// between two processes, 1 KiB ... 1 GiB, membox zero-copy vs membox with a
// sender-side copy vs membox over TCP vs gRPC over TCP, with a same-run memcpy
// bound and a single-stream iperf3 reference. See docs/results/transfer.md.
#ifndef MEMBOX_BENCH_TRANSFER_TRANSFER_BENCH_H_
#define MEMBOX_BENCH_TRANSFER_TRANSFER_BENCH_H_

#include <cstdint>
#include <string>

#include "bench/common/report.h"

namespace membox::bench {

struct TransferOptions {
  CommonFlags common;
  uint64_t min_size = 1 << 10;
  uint64_t max_size = 1ull << 30;
  bool with_grpc = true;
  bool with_iperf = true;
  bool rtt_only = false;  // only the service-layer round-trip rows
};

// The driver: spawns the receiver processes and runs the sweep. Returns a
// process exit code.
int RunTransferBench(const TransferOptions& options);

// The receiver process (`membox bench-peer transfer ...`): `mode` is "auto",
// "tcp" (membox device with those transports) or "grpc".
int RunTransferPeer(const std::string& mode);

}  // namespace membox::bench

#endif  // MEMBOX_BENCH_TRANSFER_TRANSFER_BENCH_H_
