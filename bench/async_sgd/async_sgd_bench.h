// `membox bench async-sgd` (seed 003 §IV.C-F, Figs. 6-9): the paper's
// emulation of asynchronous SGD with one parameter server and 2 ... 32
// workers, for the six CNNs of its Table 2 (parameter bytes, compute time per
// iteration), sequential and overlapped scenarios. membox: write-sync the
// gradient, accumulate it into the global weights on the memory node,
// read-sync the weights. Baseline: an MPI parameter server on rank 0,
// pipelined over the same 4 chunks and applying updates on every core
// (non-blocking receives from every worker, MPI_Waitany, MPI_Isend of each
// answered chunk). Both are launched the same way, with mpirun.
// docs/results/async_sgd.md.
#ifndef MEMBOX_BENCH_ASYNC_SGD_ASYNC_SGD_BENCH_H_
#define MEMBOX_BENCH_ASYNC_SGD_ASYNC_SGD_BENCH_H_

#include <string>
#include <vector>

#include "bench/common/report.h"

namespace membox::bench {

struct AsyncSgdOptions {
  CommonFlags common;
  uint64_t memory_budget = 12ull << 30;  // configurations above it are skipped
  std::vector<int> workers;              // empty: 2, 4, 6, 8, 12, 18, 24, 32
  int iterations = 0;                    // 0: 5 (3 with --quick)
  std::vector<std::string> models;       // empty: all (2 with --quick)
};

int RunAsyncSgdBench(const AsyncSgdOptions& options);
// One MPI rank (started by mpirun): args are system (mpi|membox), scenario
// (sequential|overlapped), parameter bytes, compute ms, iterations, and for
// membox the memory node and secret file.
int RunAsyncSgdWorker(const std::vector<std::string>& args);

}  // namespace membox::bench

#endif  // MEMBOX_BENCH_ASYNC_SGD_ASYNC_SGD_BENCH_H_
