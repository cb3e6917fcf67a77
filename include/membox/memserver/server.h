// The memory node (seed 003 "Soft Memory Box" server, §III.F-G): one memory
// pool registered once with the transport and managed by a buddy allocator;
// shared segments created by a master and attached by others with the same
// key and size; server-side accumulate on a pool of sync cores.
//
// Architecture (Fig. 3): the transport's progress thread is the message
// receiver -- it pushes every request into the request ring; a pool of
// handler threads takes requests from the ring, runs them and replies. The
// connection manager accepts channels; a reaper thread releases clients that
// disconnect or miss heartbeats (their attachments, and -- when
// release_master_segments is set -- the segments they created).
//
// Security: a client must present the server's secret before any other
// request; each segment is exported with its own random access key (see
// transport MemRegion::ExportRange), handed only to clients that attached it.
//
// Thread-safety: Start/Stop from one thread; Stats() from any thread.
#ifndef MEMBOX_MEMSERVER_SERVER_H_
#define MEMBOX_MEMSERVER_SERVER_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "membox/base/credential.h"
#include "membox/base/metrics.h"
#include "membox/base/status.h"

namespace membox::memserver {

struct ServerOptions {
  std::string listen = "0.0.0.0:7300";
  std::string transports = "auto";
  uint64_t pool_bytes = 1ull << 30;
  uint64_t min_block = 4096;         // power of two
  uint64_t max_block = 32ull << 30;  // power of two
  std::string secret;                // required, >= 8 bytes
  // Admits (or refuses, e.g. revoked) principals; transport DeviceOptions.
  std::function<Status(const Principal&)> admit;
  int sync_cores = 2;
  int handler_threads = 2;
  std::chrono::milliseconds heartbeat_timeout{5000};
  // Segments of a master that died: freed at once with
  // release_master_segments; otherwise kept for `orphan_grace` so a
  // restarted master (same client name) can attach and adopt them, then
  // deleted (their memory returns once the last attachment goes). 0 keeps
  // orphans until the daemon stops.
  bool release_master_segments = false;
  std::chrono::milliseconds orphan_grace{60000};
  // Per client, bytes of segments created; 0: half the pool (one client
  // cannot take all of it by default).
  uint64_t quota_bytes = 0;
  uint32_t quota_segments = 1024;  // per client, created + attached
  // Credential for the full `membox status` listing (every client and
  // segment); without it a client sees its own. Empty: no full listing
  // over the network.
  std::string admin_secret;
};

struct ServerStats {
  uint64_t pool_bytes = 0;
  uint64_t allocated_bytes = 0;
  uint64_t free_bytes = 0;
  uint64_t largest_free_block = 0;
  double external_fragmentation = 0;
  double internal_fragmentation = 0;
  uint64_t segments = 0;
  uint64_t clients = 0;
  uint64_t bytes_accumulated = 0;
  uint64_t accumulates = 0;
  uint64_t requests = 0;
  uint64_t rejected_requests = 0;
  uint64_t clients_released = 0;
  // One-sided traffic as reported by clients with their heartbeats.
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
};

class Server {
 public:
  static Result<std::unique_ptr<Server>> Start(const ServerOptions& options);
  virtual ~Server() = default;
  // "host:port" clients connect to.
  virtual std::string endpoint() const = 0;
  virtual ServerStats Stats() const = 0;
  // Human-readable status (what `membox status` prints).
  virtual std::string StatusText() const = 0;
  // Names the node's other services, once all run: {name (one word, e.g.
  // "parameter_proxy"), endpoint}. The status text then has a line
  // "services N" and a line "service NAME ENDPOINT" for each, which
  // `membox status --services` asks; a service not named is not running.
  // Before the call, no "services" line: the node is still starting. Any
  // thread.
  virtual void SetServices(
      std::vector<std::pair<std::string, std::string>> services) = 0;
  // Prometheus metrics: pool use, segments, clients, accumulates, one-sided
  // traffic, and the service layer's request metrics. Any thread.
  virtual void Metrics(MetricsWriter& w) const = 0;
  // Stops accepting, releases every client, frees the pool. Idempotent.
  virtual void Stop() = 0;
};

}  // namespace membox::memserver

#endif  // MEMBOX_MEMSERVER_SERVER_H_
