// `membox bench allreduce`: synchronous sum across p workers -- membox
// PushPull through 1 or 2 memory nodes vs MPI_Allreduce vs Gloo
// (torch.distributed) -- for 4 KiB ... 512 MiB fp32, p = 2, 4, 8, with the
// memory-bandwidth bound p·n / all-core streaming copy bandwidth measured in
// the same run at each size; every variant `repeats` times, interleaved,
// each record the median with its spread (docs/results/allreduce.md).
#ifndef MEMBOX_BENCH_ALLREDUCE_ALLREDUCE_BENCH_H_
#define MEMBOX_BENCH_ALLREDUCE_ALLREDUCE_BENCH_H_

#include <cstdint>
#include <string>
#include <vector>

#include "bench/common/report.h"

namespace membox::bench {

struct AllreduceOptions {
  CommonFlags common;
  std::vector<int> workers;     // empty: 2, 4, 8 (quick: 2, 4)
  std::vector<uint64_t> sizes;  // empty: 4 KiB ... 512 MiB
  std::vector<int> nodes;       // empty: 1, 2
  int iterations = 0;           // 0: by size
  bool with_gloo = true;
  int repeats = 3;  // interleaved; quick: 1
  uint64_t partition_bytes = 4 << 20;
};

int RunAllreduceBench(const AllreduceOptions& options);

// `membox bench collective`: the workers' own collectives (seed 004 §C.3):
// hierarchical AllReduce (nodes of `local` ranks, pairwise exchanges
// between nodes, trees inside) vs the ring, p worker processes under mpirun.
struct CollectiveBenchOptions {
  CommonFlags common;
  int workers = 0;  // 0: 8 (quick 4)
  int local = 2;    // ranks per "node"
};
int RunCollectiveBench(const CollectiveBenchOptions& options);
// One rank: LOCAL SIZES ITERS.
int RunCollectiveWorker(const std::vector<std::string>& args);
// One MPI rank (started by mpirun): PROXIES|- SECRET_FILE SIZES ITERS
// PARTITION_BYTES. Measures membox PushPull (when proxies are given) and
// MPI_Allreduce; rank 0 prints "RESULT <variant> <bytes> <seconds>".
int RunAllreduceWorker(const std::vector<std::string>& args);

}  // namespace membox::bench

#endif  // MEMBOX_BENCH_ALLREDUCE_ALLREDUCE_BENCH_H_
