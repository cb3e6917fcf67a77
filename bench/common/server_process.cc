#include "bench/common/server_process.h"

#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>

#include <unistd.h>

#include "membox/base/config.h"

namespace membox::bench {

Result<ServerProcess> ServerProcess::Start(uint64_t pool_bytes,
                                           const std::string& transports,
                                           int sync_cores) {
  ServerProcess s;
  std::random_device rd;
  s.secret_ = "bench-" + std::to_string(rd()) + std::to_string(rd());
  s.secret_file_ = "/tmp/membox-bench-secret-" + std::to_string(getpid());
  {
    std::ofstream out(s.secret_file_);
    out << s.secret_ << "\n";
    if (!out) return InternalError("cannot write " + s.secret_file_);
  }
  s.proc_ = Subprocess::Start(
      {"/proc/self/exe", "--log-level", "warn", "serve", "--listen",
       "127.0.0.1:0", "--exit-with-parent", "--pool-size",
       std::to_string(pool_bytes), "--secret-file", s.secret_file_,
       "--transports", transports, "--sync-cores", std::to_string(sync_cores)});
  if (!s.proc_) return InternalError("cannot start membox serve");
  auto ep =
      s.proc_->WaitFor("membox serve: listening on ", std::chrono::seconds(60));
  if (!ep) return UnavailableError("membox serve did not start");
  s.endpoint_ = *ep;
  return s;
}

ServerProcess::ServerProcess(ServerProcess&& o) noexcept
    : proc_(std::move(o.proc_)),
      endpoint_(std::move(o.endpoint_)),
      secret_file_(std::move(o.secret_file_)),
      secret_(std::move(o.secret_)) {
  o.proc_.reset();
  o.secret_file_.clear();
}

ServerProcess::~ServerProcess() {
  if (proc_) {
    proc_->Kill(15);
    if (!proc_->Wait(std::chrono::seconds(20))) proc_->Kill(9);
  }
  if (!secret_file_.empty()) std::remove(secret_file_.c_str());
}

}  // namespace membox::bench
