// The `membox` command: one binary, one subcommand per job, each in its own
// file (tools/commands.h lists them):
//   membox serve | status | launch | cluster | bench ... | credential ... |
//   secret | version
// main parses the command line, sets up logging and runs the subcommand
// that was given.
#include <cstdio>
#include <string>

#include <CLI/CLI.hpp>

#include "membox/base/environment.h"
#include "membox/base/logging.h"

#include "tools/commands.h"

int main(int argc, char** argv) {
  using membox::tools::Commands;
  CLI::App app{"membox: parameter communication through disaggregated memory"};
  app.require_subcommand(1);
  std::string log_level;
  app.add_option("--log-level", log_level,
                 "trace, debug, info, warn, error, off");

  Commands commands;
  auto add = [&commands](Commands more) {
    for (auto& c : more) commands.push_back(std::move(c));
  };
  auto* version = app.add_subcommand("version", "print the version");
  add({{version, [] {
          std::printf("membox 0.1.0\n");
          return 0;
        }}});
  add(membox::tools::AddCredentialCommands(&app));
  add(membox::tools::AddServeCommand(&app, &log_level));
  add(membox::tools::AddStatusCommand(&app));
  auto* bench = app.add_subcommand("bench", "run a benchmark");
  bench->require_subcommand(1);
  add(membox::tools::AddPythonCommands(&app, bench));
  add(membox::tools::AddBenchCommands(&app, bench));

  CLI11_PARSE(app, argc, argv);
  membox::InitLogging("membox");
  membox::ApplyProcessEnvironment();
  if (!log_level.empty()) {
    if (membox::Status s = membox::SetLogLevel(log_level); !s.ok()) {
      std::fprintf(stderr, "membox: --log-level: %s\n", s.ToString().c_str());
      return 2;
    }
  }
  for (const auto& c : commands) {
    if (c.cli->parsed()) return c.run();
  }
  return 0;
}
