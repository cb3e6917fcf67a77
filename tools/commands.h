// The subcommands of the `membox` command, one file each (main in
// membox_main.cc). Each Add*Command registers its subcommand(s) on the
// parser with the flags it owns and returns what to run when one was given
// on the command line; main runs the one that was parsed, after logging is
// set up, on its own thread, and exits with what it returns.
//
// Environment variables are read here, at the edge, and handed to the
// libraries as explicit options (docs/design/layers.md).
#ifndef MEMBOX_TOOLS_COMMANDS_H_
#define MEMBOX_TOOLS_COMMANDS_H_

#include <functional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "membox/base/status.h"

namespace membox::tools {

struct Command {
  CLI::App* cli;             // the subcommand as the parser knows it
  std::function<int()> run;  // its exit status
};
using Commands = std::vector<Command>;

// `membox credential issue|revoke`, `membox secret`.
Commands AddCredentialCommands(CLI::App* app);
// `membox serve`; `log_level` is main's --log-level (set after parsing).
Commands AddServeCommand(CLI::App* app, const std::string* log_level);
// `membox status`.
Commands AddStatusCommand(CLI::App* app);
// The commands that are Python modules: `membox launch`, `membox cluster`,
// `membox bench gpu|cluster|ps|ctr|offload` (`bench` is the bench group).
Commands AddPythonCommands(CLI::App* app, CLI::App* bench);
// The C++ benchmarks under `bench` and the hidden `membox bench-peer`
// (none in a build without MEMBOX_BUILD_BENCH).
Commands AddBenchCommands(CLI::App* app, CLI::App* bench);

// Shared by serve and status:
// "auto": the memory server's port + `offset` on the same host (+1 the
// parameter proxy, +2 the embedding server); "off" or an address: itself.
Result<std::string> ServiceListen(const std::string& ps_listen,
                                  const std::string& listen, int offset);
// The admin secret of `--admin-secret-file` (empty when not given); false
// after printing why the file cannot be used.
bool ReadAdminSecret(const std::string& file, const char* command,
                     std::string* out);

}  // namespace membox::tools

#endif  // MEMBOX_TOOLS_COMMANDS_H_
