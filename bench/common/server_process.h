// Starts `membox serve` as a child process for a benchmark (the way users
// start it: flags and a secret file), and stops it with SIGTERM.
#ifndef MEMBOX_BENCH_COMMON_SERVER_PROCESS_H_
#define MEMBOX_BENCH_COMMON_SERVER_PROCESS_H_

#include <cstdint>
#include <optional>
#include <string>

#include "membox/base/status.h"
#include "membox/base/subprocess.h"

namespace membox::bench {

class ServerProcess {
 public:
  static Result<ServerProcess> Start(uint64_t pool_bytes,
                                     const std::string& transports,
                                     int sync_cores = 2);
  ServerProcess(ServerProcess&& o) noexcept;
  ServerProcess& operator=(ServerProcess&&) = delete;
  ~ServerProcess();
  const std::string& endpoint() const { return endpoint_; }
  const std::string& secret_file() const { return secret_file_; }
  const std::string& secret() const { return secret_; }

 private:
  ServerProcess() = default;
  std::optional<Subprocess> proc_;
  std::string endpoint_, secret_file_, secret_;
};

}  // namespace membox::bench

#endif  // MEMBOX_BENCH_COMMON_SERVER_PROCESS_H_
