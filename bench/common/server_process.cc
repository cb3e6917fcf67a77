#include "bench/common/server_process.h"

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "membox/base/config.h"

namespace membox::bench {
namespace {

Status WriteSecretFile(const std::string& path, const std::string& secret) {
  {
    std::ofstream out(path);
    out << secret << "\n";
    if (!out) return InternalError("cannot write " + path);
  }
  // membox serve refuses a secret file others may read.
  std::error_code ec;
  std::filesystem::permissions(
      path,
      std::filesystem::perms::owner_read | std::filesystem::perms::owner_write,
      ec);
  if (ec) return InternalError("cannot chmod " + path + ": " + ec.message());
  return Status::Ok();
}

std::string RandomSecret() {
  std::random_device rd;
  std::string s = "bench-";
  while (s.size() < 40) s += std::to_string(rd());
  return s;
}

}  // namespace

Status ServerProcess::Spawn(const std::string& secret,
                            const std::string& file_suffix,
                            const std::vector<std::string>& args) {
  secret_ = secret;
  secret_file_ =
      "/tmp/membox-bench-secret-" + std::to_string(getpid()) + file_suffix;
  RETURN_IF_ERROR(WriteSecretFile(secret_file_, secret_));
  std::vector<std::string> argv = {"/proc/self/exe",
                                   "--log-level",
                                   "warn",
                                   "serve",
                                   "--listen",
                                   "127.0.0.1:0",
                                   "--exit-with-parent",
                                   "--secret-file",
                                   secret_file_};
  argv.insert(argv.end(), args.begin(), args.end());
  proc_ = Subprocess::Start(argv);
  if (!proc_) return InternalError("cannot start membox serve");
  auto ep =
      proc_->WaitFor("membox serve: listening on ", std::chrono::seconds(60));
  if (!ep) return UnavailableError("membox serve did not start");
  endpoint_ = *ep;
  return Status::Ok();
}

Result<std::string> ServerProcess::AwaitService(const std::string& what) {
  auto ep = proc_->WaitFor("membox serve: " + what + " on ",
                           std::chrono::seconds(60));
  if (!ep) return UnavailableError("the " + what + " did not start");
  return *ep;
}

Result<ServerProcess> ServerProcess::Start(uint64_t pool_bytes,
                                           const std::string& transports,
                                           int sync_cores) {
  ServerProcess s;
  RETURN_IF_ERROR(s.Spawn(
      RandomSecret(), "",
      {"--pool-size", std::to_string(pool_bytes), "--transports", transports,
       "--sync-cores", std::to_string(sync_cores), "--ps-listen", "off"}));
  return s;
}

int ServerProcess::FreePort() { return PickFreeLocalPort(); }

Result<ServerProcess> ServerProcess::StartEmbeddingNode(
    const std::string& dir, uint64_t budget, const std::string& secret,
    bool push_log, const std::string& listen, const std::string& backup,
    const std::string& name, const std::vector<std::string>& extra) {
  ServerProcess s;
  static int n = 0;
  std::vector<std::string> args = {"--pool-size",
                                   "16MiB",
                                   "--ps-listen",
                                   "off",
                                   "--emb-listen",
                                   listen,
                                   "--emb-dir",
                                   dir,
                                   "--emb-budget",
                                   std::to_string(budget),
                                   "--emb-flush-interval-ms",
                                   "0",
                                   "--emb-push-log",
                                   push_log ? "on" : "off"};
  if (!backup.empty()) {
    args.insert(args.end(), {"--emb-backup", backup, "--emb-name", name});
  }
  args.insert(args.end(), extra.begin(), extra.end());
  RETURN_IF_ERROR(s.Spawn(secret, "-emb-" + std::to_string(n++), args));
  ASSIGN_OR_RETURN(s.embedding_endpoint_, s.AwaitService("embedding server"));
  return s;
}

Result<ServerProcess> ServerProcess::StartWithProxy(
    const std::string& transports, int sync_cores, const std::string& ps_listen,
    const std::vector<std::string>& ps_peers, int ps_rank,
    const std::string& secret, bool replicate) {
  ServerProcess s;
  std::vector<std::string> args = {"--pool-size",  "64MiB",
                                   "--transports", transports,
                                   "--sync-cores", std::to_string(sync_cores),
                                   "--ps-listen",  ps_listen,
                                   "--ps-rank",    std::to_string(ps_rank)};
  if (!ps_peers.empty()) {
    args.push_back("--ps-peers");
    args.push_back(fmt::format("{}", fmt::join(ps_peers, ",")));
    args.push_back("--ps-replicate");
    args.push_back(replicate ? "on" : "off");
  }
  RETURN_IF_ERROR(s.Spawn(secret.empty() ? RandomSecret() : secret,
                          fmt::format("-{}", ps_rank), args));
  ASSIGN_OR_RETURN(s.proxy_endpoint_, s.AwaitService("parameter proxy"));
  return s;
}

Result<std::vector<ServerProcess>> ServerProcess::StartProxyCluster(
    int nodes, int sync_cores, std::vector<std::string>* endpoints,
    bool replicate) {
  Status last;
  for (int attempt = 0; attempt < 3; ++attempt) {
    std::vector<std::string> peers;
    for (int i = 0; i < nodes; ++i) {
      peers.push_back("127.0.0.1:" + std::to_string(FreePort()));
    }
    std::string secret = RandomSecret();
    std::vector<ServerProcess> servers;
    for (int i = 0; i < nodes; ++i) {
      auto s = StartWithProxy("auto", sync_cores, peers[i],
                              nodes > 1 ? peers : std::vector<std::string>{}, i,
                              secret, replicate);
      if (!s.ok()) {
        last = s.status();
        break;
      }
      servers.push_back(std::move(*s));
    }
    if (static_cast<int>(servers.size()) == nodes) {
      *endpoints = peers;
      return servers;
    }
  }
  return last;
}

ServerProcess::ServerProcess(ServerProcess&& o) noexcept
    : proc_(std::move(o.proc_)),
      endpoint_(std::move(o.endpoint_)),
      proxy_endpoint_(std::move(o.proxy_endpoint_)),
      embedding_endpoint_(std::move(o.embedding_endpoint_)),
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
