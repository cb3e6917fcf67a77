// `membox bench memserver` (seed 003 Fig. 5): 2 ... 32 client processes, each
// with its own segment on one memory node, read / write / mixed 50-50
// read-sync and write-sync; aggregate GB/s against a same-run 2-thread
// memcpy. Also: segment attach latency, and server-side accumulate of 64 MiB
// fp32 against a same-run 2-thread reduce. docs/results/memserver.md.
#ifndef MEMBOX_BENCH_MEMSERVER_MEMSERVER_BENCH_H_
#define MEMBOX_BENCH_MEMSERVER_MEMSERVER_BENCH_H_

#include <string>
#include <vector>

#include "bench/common/report.h"

namespace membox::bench {

struct MemserverBenchOptions {
  CommonFlags common;
  std::string transports = "auto";
};

int RunMemserverBench(const MemserverBenchOptions& options);
// A client process: args are endpoint, secret file, segment bytes, transports.
int RunMemserverPeer(const std::vector<std::string>& args);

}  // namespace membox::bench

#endif  // MEMBOX_BENCH_MEMSERVER_MEMSERVER_BENCH_H_
