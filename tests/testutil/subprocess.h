// Starting real processes from tests: a child with its stdout piped back,
// line-oriented reads with a timeout, kill -9 and exit-status collection.
// Thread-safety: one thread per Subprocess.
#ifndef MEMBOX_TESTS_TESTUTIL_SUBPROCESS_H_
#define MEMBOX_TESTS_TESTUTIL_SUBPROCESS_H_

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include <sys/types.h>

namespace membox::testing {

class Subprocess {
 public:
  // Starts argv[0] with the arguments; stdout is piped, stderr inherited.
  static std::optional<Subprocess> Start(const std::vector<std::string>& argv);
  Subprocess(Subprocess&& o) noexcept;
  Subprocess& operator=(Subprocess&&) = delete;
  Subprocess(const Subprocess&) = delete;
  ~Subprocess();  // kills the child if it still runs

  // Next line of stdout without the newline; nullopt on EOF or timeout.
  std::optional<std::string> ReadLine(std::chrono::milliseconds timeout);
  // Reads lines until one starts with `prefix`; returns the rest of it.
  std::optional<std::string> WaitFor(const std::string& prefix,
                                     std::chrono::milliseconds timeout);
  void Kill(int sig = 9);
  // Exit code (or 128 + signal); nullopt when still running after timeout.
  std::optional<int> Wait(std::chrono::milliseconds timeout);
  pid_t pid() const { return pid_; }

 private:
  Subprocess() = default;
  pid_t pid_ = -1;
  int out_fd_ = -1;
  std::string buf_;
  std::optional<int> status_;
};

}  // namespace membox::testing

#endif  // MEMBOX_TESTS_TESTUTIL_SUBPROCESS_H_
