// The `membox` command: one binary, one subcommand per job.
//   membox bench transfer [--quick] [--csv F] [--plot F.png] [--json F] ...
//   membox version
// Later layers add `serve`, `status`, `launch`.
#include <cstdio>
#include <string>

#include <CLI/CLI.hpp>

#include "membox/base/config.h"
#include "membox/base/logging.h"

#ifdef MEMBOX_WITH_BENCH
#include "bench/transfer/transfer_bench.h"
#endif

namespace {

#ifdef MEMBOX_WITH_BENCH
void AddCommonFlags(CLI::App* cmd, membox::bench::CommonFlags* f) {
  cmd->add_flag("--quick", f->quick, "reduced sweep (under a minute here)");
  cmd->add_option("--csv", f->csv, "write the records as CSV");
  cmd->add_option("--plot", f->plot, "write a PNG plot");
  cmd->add_option("--json", f->json, "write the records as a JSON list");
}
#endif

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"membox: parameter communication through disaggregated memory"};
  app.require_subcommand(1);
  std::string log_level;
  app.add_option("--log-level", log_level,
                 "trace, debug, info, warn, error, off");

  auto* version = app.add_subcommand("version", "print the version");

#ifdef MEMBOX_WITH_BENCH
  auto* bench = app.add_subcommand("bench", "run a benchmark");
  bench->require_subcommand(1);
  membox::bench::TransferOptions topt;
  std::string min_size = "1KiB", max_size = "1GiB";
  auto* transfer = bench->add_subcommand(
      "transfer",
      "seed 002 Fig. 8: tensor send/receive, membox vs gRPC vs memcpy");
  AddCommonFlags(transfer, &topt.common);
  transfer->add_option("--min-size", min_size,
                       "smallest tensor (default 1KiB)");
  transfer->add_option("--max-size", max_size, "largest tensor (default 1GiB)");
  bool no_grpc = false, no_iperf = false;
  transfer->add_flag("--no-grpc", no_grpc, "skip the gRPC baseline");
  transfer->add_flag("--no-iperf", no_iperf, "skip the iperf3 reference");

  auto* peer = app.add_subcommand(
      "bench-peer", "internal: the receiving side of a benchmark");
  peer->group("");  // hidden
  std::string peer_bench, peer_mode;
  peer->add_option("bench", peer_bench)->required();
  peer->add_option("mode", peer_mode)->required();
#endif

  CLI11_PARSE(app, argc, argv);
  membox::InitLogging("membox");
  if (!log_level.empty()) membox::SetLogLevel(log_level);

  if (version->parsed()) {
    std::printf("membox 0.1.0\n");
    return 0;
  }
#ifdef MEMBOX_WITH_BENCH
  if (transfer->parsed()) {
    auto mn = membox::ParseByteSize(min_size);
    auto mx = membox::ParseByteSize(max_size);
    if (!mn.ok() || !mx.ok() || *mn == 0 || *mn > *mx) {
      std::fprintf(stderr, "error: bad --min-size/--max-size\n");
      return 2;
    }
    topt.min_size = *mn;
    topt.max_size = *mx;
    topt.with_grpc = !no_grpc;
    topt.with_iperf = !no_iperf;
    return membox::bench::RunTransferBench(topt);
  }
  if (peer->parsed()) {
    if (peer_bench == "transfer")
      return membox::bench::RunTransferPeer(peer_mode);
    std::fprintf(stderr, "error: unknown benchmark '%s'\n", peer_bench.c_str());
    return 2;
  }
#endif
  return 0;
}
