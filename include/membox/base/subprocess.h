// Starting real processes (benchmark peers, daemons under test): a child with
// stdin and stdout piped, line-oriented reads with a timeout, kill and
// exit-status collection. The destructor kills a child that still runs.
// Thread-safety: one thread per Subprocess.
#ifndef MEMBOX_BASE_SUBPROCESS_H_
#define MEMBOX_BASE_SUBPROCESS_H_

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include <sys/types.h>

namespace membox {

// The running executable's path (/proc/self/exe), for starting copies of
// this program as peers.
std::string SelfExePath();
// A TCP port on 127.0.0.1 that was free a moment ago, for endpoints that
// must be known before the process that listens on them starts (tests).
// Taken below the kernel's ephemeral range where it can, so that no
// outgoing connection takes it before the listener binds it.
int PickFreeLocalPort();

class Subprocess {
 public:
  // Starts argv[0] (searched in PATH) with the arguments; stdin and stdout
  // are piped, stderr inherited.
  static std::optional<Subprocess> Start(const std::vector<std::string>& argv);
  Subprocess(Subprocess&& o) noexcept;
  Subprocess& operator=(
      Subprocess&& o) noexcept;  // kills a running child first
  Subprocess(const Subprocess&) = delete;
  ~Subprocess();  // kills the child if it still runs

  // Next line of stdout without the newline; nullopt on EOF or timeout.
  std::optional<std::string> ReadLine(std::chrono::milliseconds timeout);
  // Reads lines until one starts with `prefix`; returns the rest of it.
  std::optional<std::string> WaitFor(const std::string& prefix,
                                     std::chrono::milliseconds timeout);
  // Writes `line` and a newline to the child's stdin; false if it is gone.
  bool WriteLine(const std::string& line);
  void CloseStdin();
  void Kill(int sig = 9);
  // Exit code (or 128 + signal); nullopt when still running after timeout.
  std::optional<int> Wait(std::chrono::milliseconds timeout);
  pid_t pid() const { return pid_; }

 private:
  Subprocess() = default;
  pid_t pid_ = -1;
  int out_fd_ = -1;
  int in_fd_ = -1;
  std::string buf_;
  std::optional<int> status_;
};

}  // namespace membox

#endif  // MEMBOX_BASE_SUBPROCESS_H_
