// Starts `membox serve` as a child process for a benchmark (the way users
// start it: flags and a secret file), and stops it with SIGTERM.
#ifndef MEMBOX_BENCH_COMMON_SERVER_PROCESS_H_
#define MEMBOX_BENCH_COMMON_SERVER_PROCESS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "membox/base/status.h"
#include "membox/base/subprocess.h"

namespace membox::bench {

class ServerProcess {
 public:
  static Result<ServerProcess> Start(uint64_t pool_bytes,
                                     const std::string& transports,
                                     int sync_cores = 2);
  // A memory node whose parameter proxy listens on `ps_listen` with the
  // ring `ps_peers` (empty: a single proxy) as proxy `ps_rank`; `secret`
  // empty picks a random one; `replicate` false runs it with
  // --ps-replicate off (one copy of each shard). Waits until the proxy is
  // up.
  static Result<ServerProcess> StartWithProxy(
      const std::string& transports, int sync_cores,
      const std::string& ps_listen, const std::vector<std::string>& ps_peers,
      int ps_rank, const std::string& secret = "", bool replicate = true);
  // Free TCP port on 127.0.0.1 (for endpoints that must be known up front).
  static int FreePort();
  // `nodes` memory nodes whose proxies form one ring on 127.0.0.1, with one
  // secret. A port taken between choosing and listening (another process's
  // ephemeral port) makes it retry with fresh ports, up to 3 times.
  // `endpoints` receives the proxies' endpoints in ring order.
  static Result<std::vector<ServerProcess>> StartProxyCluster(
      int nodes, int sync_cores, std::vector<std::string>* endpoints,
      bool replicate = true);
  // A memory node running only the embedding server, its tables in `dir`
  // with `budget` bytes of memory tier each; embedding_endpoint() is set.
  // `backup`: another node's embedding endpoint that keeps a copy of its
  // rows (--emb-backup; then `listen` is usually a fixed address).
  // `extra`: more `membox serve` flags.
  static Result<ServerProcess> StartEmbeddingNode(
      const std::string& dir, uint64_t budget, const std::string& secret,
      bool push_log = true, const std::string& listen = "127.0.0.1:0",
      const std::string& backup = "", const std::string& name = "",
      const std::vector<std::string>& extra = {});
  ServerProcess(ServerProcess&& o) noexcept;
  ServerProcess& operator=(ServerProcess&&) = delete;
  ~ServerProcess();
  const std::string& endpoint() const { return endpoint_; }
  const std::string& secret_file() const { return secret_file_; }
  const std::string& secret() const { return secret_; }
  const std::string& proxy_endpoint() const { return proxy_endpoint_; }
  const std::string& embedding_endpoint() const { return embedding_endpoint_; }

 private:
  ServerProcess() = default;
  // Writes the secret to /tmp/membox-bench-secret-<pid><file_suffix>, starts
  // `membox serve` with the flags every benchmark node shares plus `args`,
  // and waits until the memory node listens (endpoint_ set).
  Status Spawn(const std::string& secret, const std::string& file_suffix,
               const std::vector<std::string>& args);
  // Waits for the `membox serve: <what> on ` line and returns its endpoint.
  Result<std::string> AwaitService(const std::string& what);
  std::optional<Subprocess> proc_;
  std::string endpoint_, proxy_endpoint_, embedding_endpoint_, secret_file_,
      secret_;
};

}  // namespace membox::bench

#endif  // MEMBOX_BENCH_COMMON_SERVER_PROCESS_H_
