// Starts benchmark ranks under mpirun: `ranks` copies of this binary's
// hidden "bench-peer" command, all on this machine, the same way for the MPI
// baselines and for membox's workers (so both pay the same launch and
// placement). Open MPI's shared-memory BTL (vader) is chosen explicitly; the
// ranks are not bound to cores (2-core machines run up to 33 ranks).
//
// Ownership: the caller owns the returned process (reads its output, waits).
#ifndef MEMBOX_BENCH_COMMON_MPI_LAUNCH_H_
#define MEMBOX_BENCH_COMMON_MPI_LAUNCH_H_

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "membox/base/subprocess.h"

namespace membox::bench {

// argv: mpirun ... -np `ranks` <self> bench-peer `peer_args`...
std::vector<std::string> MpiRunArgv(int ranks,
                                    const std::vector<std::string>& peer_args);

// Starts MpiRunArgv(); nullopt when mpirun cannot be started.
std::optional<Subprocess> StartMpiRanks(
    int ranks, const std::vector<std::string>& peer_args);

// Reads the ranks' output until `expect` "RESULT ..." lines arrived (each
// returned without the "RESULT " prefix), the output ends, or no line comes
// for `idle`. Lines mentioning an error are echoed to stderr.
std::vector<std::string> ReadResultLines(Subprocess& ranks, size_t expect,
                                         std::chrono::nanoseconds idle);

}  // namespace membox::bench

#endif  // MEMBOX_BENCH_COMMON_MPI_LAUNCH_H_
