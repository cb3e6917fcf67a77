// Test helpers for starting `membox serve` the way users start it: a
// separate process (MEMBOX_BIN, set by CMake) with flags and a secret file
// in a scratch directory, stopped with SIGTERM at the end of the test.
//
// Ownership: ServeScratch owns its directory (removed by the destructor);
// the caller owns the processes StartServe returns (their destructor kills
// a child that still runs; StopServes asks them to exit cleanly first).
// Thread-safety: test-thread only.
#ifndef MEMBOX_TESTS_INTEGRATION_SERVE_PROCESS_H_
#define MEMBOX_TESTS_INTEGRATION_SERVE_PROCESS_H_

#include <chrono>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <unistd.h>

#include "membox/base/subprocess.h"

namespace membox::testing {

// TempDir()/membox-<name>-<pid>, emptied, holding a file "secret" with
// `secret` (what `--secret-file` reads).
class ServeScratch {
 public:
  ServeScratch(const std::string& name, const std::string& secret)
      : dir_(std::filesystem::path(::testing::TempDir()) /
             ("membox-" + name + "-" + std::to_string(getpid()))) {
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    secret_file_ = (dir_ / "secret").string();
    std::ofstream(secret_file_) << secret << "\n";
    // membox serve refuses a secret file others may read.
    std::filesystem::permissions(secret_file_,
                                 std::filesystem::perms::owner_read |
                                     std::filesystem::perms::owner_write);
  }
  ~ServeScratch() {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  ServeScratch(const ServeScratch&) = delete;
  ServeScratch& operator=(const ServeScratch&) = delete;

  const std::filesystem::path& dir() const { return dir_; }
  const std::string& secret_file() const { return secret_file_; }

 private:
  std::filesystem::path dir_;
  std::string secret_file_;
};

// Starts `membox serve <flags>` and waits up to `timeout` for a line of its
// output that starts with `ready` (e.g. "membox serve: listening on ");
// `rest` (may be null) receives the remainder of that line. nullopt when it
// did not start or never printed the line (the process is then killed).
inline std::optional<Subprocess> StartServe(
    const std::vector<std::string>& flags, const std::string& ready,
    std::chrono::seconds timeout, std::string* rest = nullptr) {
  std::vector<std::string> argv = {MEMBOX_BIN, "serve"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  auto p = Subprocess::Start(argv);
  if (!p) return std::nullopt;
  auto line = p->WaitFor(ready, timeout);
  if (!line) return std::nullopt;
  if (rest) *rest = *line;
  return p;
}

// SIGTERM to every process still held, then waits for each (TearDown).
inline void StopServes(std::vector<std::optional<Subprocess>>& procs) {
  for (auto& p : procs) {
    if (p) p->Kill(15);
  }
  for (auto& p : procs) {
    if (p) p->Wait(std::chrono::seconds(10));
    p.reset();
  }
}

}  // namespace membox::testing

#endif  // MEMBOX_TESTS_INTEGRATION_SERVE_PROCESS_H_
