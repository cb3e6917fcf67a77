// The `membox` subcommands that are modules of the Python package:
// `launch`, `cluster` and the torch-driven benchmarks. Everything after the
// subcommand goes to the module.
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <unistd.h>

#include "membox/base/subprocess.h"

#include "tools/commands.h"

namespace membox::tools {
namespace {

// `membox launch` is membox/launch.py (Python's subprocess and threads make
// a simpler supervisor than C++ here) and `membox bench gpu` is
// membox/gpu_bench.py (it drives torch): this execs the module with
// MEMBOX_PYTHON (default: the interpreter the extension was built for) and
// this binary as the memory node.
int ExecPythonModule(const std::string& module,
                     const std::vector<std::string>& args) {
  std::string self = membox::SelfExePath();
  // The build tree's binary runs the build tree's package; an installed one
  // (cmake --install, pip install .) the package installed beside it, found
  // by its interpreter without help.
  if (self == MEMBOX_BUILD_TREE_EXE) {
    std::string path = MEMBOX_PYTHON_DIR;
    if (const char* old = std::getenv("PYTHONPATH"); old && *old)
      path += std::string(":") + old;
    setenv("PYTHONPATH", path.c_str(), 1);
  }
  setenv("MEMBOX_BIN", self.c_str(), 1);
  std::string python = MEMBOX_PYTHON_EXECUTABLE;
  if (const char* p = std::getenv("MEMBOX_PYTHON"); p && *p) python = p;
  std::vector<std::string> argv = {python, "-m", module};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> cargv;
  for (auto& a : argv) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  execv(cargv[0], cargv.data());
  std::fprintf(stderr, "membox: cannot run %s: %s\n", python.c_str(),
               std::strerror(errno));
  return 127;
}

// A subcommand whose every argument, --help included, goes to the module.
CLI::App* PassThrough(CLI::App* parent, const std::string& name,
                      const std::string& help) {
  auto* c = parent->add_subcommand(name, help);
  c->prefix_command();
  c->allow_extras();
  c->set_help_flag();  // --help reaches the module (all its options)
  return c;
}

}  // namespace

Commands AddPythonCommands(CLI::App* app, CLI::App* bench) {
  Commands out;
  auto* launch = PassThrough(
      app, "launch",
      "start memory nodes and workers on this machine: membox launch "
      "[--nodes N] [--workers P] [--checkpoint-dir D] [--resume] -- CMD...");
  out.push_back(
      {launch, [launch] {
         std::vector<std::string> args = {"--membox", membox::SelfExePath()};
         for (const auto& a : launch->remaining()) args.push_back(a);
         return ExecPythonModule("membox.launch", args);
       }});
  const struct {
    CLI::App* parent;
    const char* name;
    const char* module;
    const char* help;
  } modules[] = {
      {app, "cluster", "membox.cluster",
       "an emulated cluster on this machine (root): membox cluster "
       "up|run|exec|status|down TOPOLOGY.toml [-- CMD...]"},
      {bench, "gpu", "membox.gpu_bench",
       "CUDA training through membox vs Gloo, and the staging copy rate "
       "(membox/gpu_bench.py; needs a CUDA GPU and torch with CUDA)"},
      {bench, "cluster", "membox.cluster_bench",
       "issue 13 / seed 000 across hosts: PushPull vs MPI and Gloo, 1-4 "
       "memory nodes, emulated training on an emulated cluster (membox/"
       "cluster_bench.py; root)"},
      {bench, "ps", "membox.ps_bench",
       "ParameterServer on hundreds of small tensors: one key per tensor vs "
       "fused buckets, against Gloo DDP (membox/ps_bench.py)"},
      {bench, "ctr", "membox.ctr_bench",
       "wide & deep CTR with tables in the embedding store, against torch's "
       "layers and TorchRec in one process (membox/ctr_bench.py)"},
      {bench, "collectives", "membox.collectives_bench",
       "torch.distributed collectives on the membox backend against Gloo, "
       "nccl-tests style: time, algbw, busbw per op and size "
       "(membox/collectives_bench.py; torch 2.x)"},
      {bench, "failover", "membox.failover_bench",
       "a memory node killed under a running job: the pause and the time "
       "until every shard is on two nodes again, against the state's size "
       "(membox/failover_bench.py)"},
      {bench, "offload", "membox.offload_bench",
       "the model's state in the memory nodes (membox.torch.offload) against "
       "DDP and FSDP2: resident bytes per parameter, step time, largest "
       "batch under a memory budget (membox/offload_bench.py)"},
  };
  for (const auto& m : modules) {
    auto* c = PassThrough(m.parent, m.name, m.help);
    std::string module = m.module;
    out.push_back(
        {c, [c, module] { return ExecPythonModule(module, c->remaining()); }});
  }
  return out;
}

}  // namespace membox::tools
