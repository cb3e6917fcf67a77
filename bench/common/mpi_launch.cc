#include "bench/common/mpi_launch.h"

#include <cstdio>

namespace membox::bench {

std::vector<std::string> MpiRunArgv(int ranks,
                                    const std::vector<std::string>& peer_args) {
  std::vector<std::string> argv = {
      "mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
      "-np", std::to_string(ranks),
      // MPI at its best on a machine with
      // fewer cores than ranks and servers:
      // waiting ranks yield the core instead
      // of spinning on it (issue 47).
      "--mca", "mpi_yield_when_idle", "1", "--mca", "btl", "self,vader",
      SelfExePath(), "bench-peer"};
  argv.insert(argv.end(), peer_args.begin(), peer_args.end());
  return argv;
}

std::optional<Subprocess> StartMpiRanks(
    int ranks, const std::vector<std::string>& peer_args) {
  return Subprocess::Start(MpiRunArgv(ranks, peer_args));
}

std::vector<std::string> ReadResultLines(Subprocess& ranks, size_t expect,
                                         std::chrono::nanoseconds idle) {
  std::vector<std::string> out;
  while (out.size() < expect) {
    auto line = ranks.ReadLine(
        std::chrono::duration_cast<std::chrono::milliseconds>(idle));
    if (!line) break;
    if (line->rfind("RESULT ", 0) == 0) {
      out.push_back(line->substr(7));
    } else if (line->find("rror") != std::string::npos) {
      std::fprintf(stderr, "  %s\n", line->c_str());
    }
  }
  return out;
}

}  // namespace membox::bench
