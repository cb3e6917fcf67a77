// The C++ benchmarks under `membox bench` (transfer, memserver, async-sgd,
// allreduce, train, collective, embedding) and the hidden `membox
// bench-peer` their other processes run. Empty in a build without
// MEMBOX_BUILD_BENCH.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "membox/base/config.h"

#include "tools/commands.h"

#ifdef MEMBOX_WITH_BENCH
#include "bench/allreduce/allreduce_bench.h"
#include "bench/async_sgd/async_sgd_bench.h"
#include "bench/embedding/embedding_bench.h"
#include "bench/memserver/memserver_bench.h"
#include "bench/train/train_bench.h"
#include "bench/transfer/transfer_bench.h"
#endif

namespace membox::tools {

#ifndef MEMBOX_WITH_BENCH
Commands AddBenchCommands(CLI::App*, CLI::App*) { return {}; }
#else
namespace {

void AddCommonFlags(CLI::App* cmd, bench::CommonFlags* f) {
  cmd->add_flag("--quick", f->quick, "reduced sweep (under a minute here)");
  cmd->add_option("--csv", f->csv, "write the records as CSV");
  cmd->add_option("--plot", f->plot, "write a PNG plot");
  cmd->add_option("--json", f->json, "write the records as a JSON list");
}

// Every benchmark's flags, owned by the commands' closures.
struct BenchFlags {
  bench::TransferOptions topt;
  std::string min_size = "1KiB", max_size = "1GiB";
  bool no_grpc = false, no_iperf = false;
  bench::MemserverBenchOptions mopt;
  bench::AsyncSgdOptions aopt;
  bench::AllreduceOptions ropt;
  int ar_repeats = 0;
  bool no_gloo = false;
  bench::TrainOptions tropt;
  bool tr_no_gloo = false;
  bench::CollectiveBenchOptions copt;
  bench::EmbeddingBenchOptions eopt;
  std::string peer_bench, peer_mode;
  std::vector<std::string> peer_args;
};

// `membox bench-peer BENCH MODE ARGS...`: the other side of a benchmark.
int RunPeer(const BenchFlags& f) {
  const std::string& peer_bench = f.peer_bench;
  const std::string& peer_mode = f.peer_mode;
  const std::vector<std::string>& peer_args = f.peer_args;
  if (peer_bench == "transfer")
    return membox::bench::RunTransferPeer(peer_mode);
  if (peer_bench == "async-sgd") {
    std::vector<std::string> args = {peer_mode};
    args.insert(args.end(), peer_args.begin(), peer_args.end());
    return membox::bench::RunAsyncSgdWorker(args);
  }
  if (peer_bench == "train") return membox::bench::RunTrainWorker(peer_args);
  if (peer_bench == "collective") {
    return membox::bench::RunCollectiveWorker(peer_args);
  }
  if (peer_bench == "allreduce") {
    return membox::bench::RunAllreduceWorker(peer_args);
  }
  if (peer_bench == "memserver") {
    std::vector<std::string> args = {peer_mode};
    args.insert(args.end(), peer_args.begin(), peer_args.end());
    return membox::bench::RunMemserverPeer(args);
  }
  std::fprintf(stderr, "error: unknown benchmark '%s'\n", peer_bench.c_str());
  return 2;
}

}  // namespace

Commands AddBenchCommands(CLI::App* app, CLI::App* bench) {
  auto f = std::make_shared<BenchFlags>();
  auto& topt = f->topt;
  auto& min_size = f->min_size;
  auto& max_size = f->max_size;
  auto& no_grpc = f->no_grpc;
  auto& no_iperf = f->no_iperf;
  auto& mopt = f->mopt;
  auto& aopt = f->aopt;
  auto& ropt = f->ropt;
  auto& ar_repeats = f->ar_repeats;
  auto& no_gloo = f->no_gloo;
  auto& tropt = f->tropt;
  auto& tr_no_gloo = f->tr_no_gloo;
  auto& copt = f->copt;
  auto& eopt = f->eopt;
  auto& peer_bench = f->peer_bench;
  auto& peer_mode = f->peer_mode;
  auto& peer_args = f->peer_args;
  auto* transfer = bench->add_subcommand(
      "transfer",
      "seed 002 Fig. 8: tensor send/receive, membox vs gRPC vs memcpy");
  AddCommonFlags(transfer, &topt.common);
  transfer->add_option("--min-size", min_size,
                       "smallest tensor (default 1KiB)");
  transfer->add_option("--max-size", max_size, "largest tensor (default 1GiB)");
  transfer->add_flag("--no-grpc", no_grpc, "skip the gRPC baseline");
  transfer->add_flag("--no-iperf", no_iperf, "skip the iperf3 reference");
  transfer->add_flag("--rtt-only", topt.rtt_only,
                     "only the service layer's request/reply round trips");

  auto* msbench = bench->add_subcommand(
      "memserver",
      "seed 003 Fig. 5: memory-node bandwidth with 2..32 client processes");
  AddCommonFlags(msbench, &mopt.common);
  msbench->add_option("--transports", mopt.transports,
                      "UCX transports: auto or tcp");

  auto* sgd = bench->add_subcommand("async-sgd",
                                    "seed 003 Figs. 6-9: asynchronous SGD "
                                    "emulation, membox vs an MPI server");
  AddCommonFlags(sgd, &aopt.common);
  sgd->add_option("--workers", aopt.workers,
                  "worker counts (default 2,4,6,8,12,18,24,32)")
      ->delimiter(',');
  sgd->add_option("--iterations", aopt.iterations,
                  "measured iterations per run");
  sgd->add_option("--models", aopt.models,
                  "models of seed 003 Table 2 (default: all six; --quick: "
                  "inception_v1,vgg16)")
      ->delimiter(',');

  auto* arbench = bench->add_subcommand(
      "allreduce",
      "PushPull (sum across p workers) vs MPI_Allreduce vs Gloo, with the "
      "p n / all-core streaming copy bound");
  AddCommonFlags(arbench, &ropt.common);
  arbench->add_option("--workers", ropt.workers, "worker counts (2,4,8)")
      ->delimiter(',');
  arbench->add_option("--nodes", ropt.nodes, "memory-node counts (1,2)")
      ->delimiter(',');
  arbench->add_option("--sizes", ropt.sizes, "tensor bytes (4KiB..512MiB)")
      ->delimiter(',');
  arbench->add_option("--iterations", ropt.iterations,
                      "iterations per size (default by size)");
  arbench->add_option("--partition-bytes", ropt.partition_bytes,
                      "shard size S' (default 4 MiB)");
  arbench->add_option("--repeats", ar_repeats,
                      "every variant N times, interleaved; medians and "
                      "spread recorded (default 3, quick 1)");
  arbench->add_flag("--no-gloo", no_gloo, "skip the Gloo baseline");

  auto* trbench = bench->add_subcommand(
      "train",
      "seed 000 Figs. 16-17: emulated data-parallel training, membox vs "
      "DENSE, MPI and Gloo AllReduce, with ablations");
  AddCommonFlags(trbench, &tropt.common);
  trbench->add_option("--models", tropt.models, "resnet50,vgg16,bert-large")
      ->delimiter(',');
  trbench->add_option("--workers", tropt.workers, "workers (default 4)");
  trbench->add_option("--iterations", tropt.iterations,
                      "iterations per run, the first a warm-up");
  trbench->add_option("--compute-scale", tropt.compute_scale,
                      "multiply the models' compute times");
  trbench->add_flag("--no-gloo", tr_no_gloo, "skip the Gloo baseline");

  auto* colbench = bench->add_subcommand(
      "collective",
      "seed 004 C.3: hierarchical AllReduce vs the ring between workers");
  AddCommonFlags(colbench, &copt.common);
  colbench->add_option("--workers", copt.workers, "worker processes (8)");
  colbench->add_option("--local", copt.local, "workers per node (2)");

  auto* embench = bench->add_subcommand(
      "embedding",
      "seed 004: sparse store tiers on a Zipf stream, membox SSD tier vs "
      "RocksDB, prefetch on vs off");
  AddCommonFlags(embench, &eopt.common);
  embench->add_option("--keys", eopt.keys, "table rows (default 10^7)");
  embench->add_option("--steps", eopt.steps, "batches");
  embench->add_option("--batch", eopt.batch, "lookups per batch");
  embench->add_option("--dir", eopt.dir, "where the SSD tier's files go");
  embench->add_option("--budget-fraction", eopt.budget_fraction,
                      "memory budget / table size (default 0.02)");

  auto* peer = app->add_subcommand(
      "bench-peer", "internal: the receiving side of a benchmark");
  peer->group("");  // hidden
  peer->add_option("bench", peer_bench)->required();
  peer->add_option("mode", peer_mode)->required();
  peer->add_option("args", peer_args);

  Commands out;
  out.push_back({transfer, [f] {
                   auto mn = ParseByteSize(f->min_size);
                   auto mx = ParseByteSize(f->max_size);
                   if (!mn.ok() || !mx.ok() || *mn == 0 || *mn > *mx) {
                     std::fprintf(stderr, "error: bad --min-size/--max-size\n");
                     return 2;
                   }
                   f->topt.min_size = *mn;
                   f->topt.max_size = *mx;
                   f->topt.with_grpc = !f->no_grpc;
                   f->topt.with_iperf = !f->no_iperf;
                   return membox::bench::RunTransferBench(f->topt);
                 }});
  out.push_back(
      {msbench, [f] { return membox::bench::RunMemserverBench(f->mopt); }});
  out.push_back(
      {sgd, [f] { return membox::bench::RunAsyncSgdBench(f->aopt); }});
  out.push_back(
      {embench, [f] { return membox::bench::RunEmbeddingBench(f->eopt); }});
  out.push_back(
      {colbench, [f] { return membox::bench::RunCollectiveBench(f->copt); }});
  out.push_back({trbench, [f] {
                   f->tropt.with_gloo = !f->tr_no_gloo;
                   return membox::bench::RunTrainBench(f->tropt);
                 }});
  out.push_back({arbench, [f] {
                   f->ropt.with_gloo = !f->no_gloo;
                   f->ropt.repeats = f->ar_repeats > 0
                                         ? f->ar_repeats
                                         : (f->ropt.common.quick ? 1 : 3);
                   return membox::bench::RunAllreduceBench(f->ropt);
                 }});
  out.push_back({peer, [f] { return RunPeer(*f); }});
  return out;
}
#endif  // MEMBOX_WITH_BENCH

}  // namespace membox::tools
