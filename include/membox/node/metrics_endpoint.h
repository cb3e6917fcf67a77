// MetricsEndpoint: an HTTP listener that serves one page, GET /metrics, in
// the Prometheus text format, for `membox serve --metrics-listen`. The page
// comes from a callback run per scrape.
//
// The port faces the network like every other one a node opens, but it
// serves counters only (no keys, no data, no secrets) and accepts no
// input: any method but GET / HEAD gets 405, any other path 404, and
// request bodies are refused. GNU libmicrohttpd does the HTTP; it is held
// to a small connection budget (64 in all, 8 per client address), 16 KiB
// of memory per connection and an idle timeout, so floods and slow clients
// cost bounded resources and expire. A request must also arrive whole within
// `request_deadline` of the connection's start (or of its previous answer):
// the idle timeout alone is reset by every byte, so 64 connections that
// trickle a byte now and then used to lock every scrape out. A watchdog
// shuts such connections down. With a `bearer_token`, a scrape without
// "Authorization: Bearer <token>" gets 401.
//
// Threading: libmicrohttpd's own polling thread calls `render`; it must be
// safe to call from there while the node runs. Start/Stop from one thread;
// Stop returns after the last `render` call has returned.
#ifndef MEMBOX_NODE_METRICS_ENDPOINT_H_
#define MEMBOX_NODE_METRICS_ENDPOINT_H_

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "membox/base/status.h"

namespace membox::node {

struct MetricsEndpointOptions {
  std::string listen;  // "host:port" or "[v6]:port"; port 0 picks one
  std::chrono::seconds idle_timeout{10};
  unsigned max_connections = 64;
  unsigned max_per_address = 8;
  std::chrono::milliseconds request_deadline{5000};
  std::string bearer_token;  // empty: no token asked for
};

class MetricsEndpoint {
 public:
  static Result<std::unique_ptr<MetricsEndpoint>> Start(
      const MetricsEndpointOptions& options,
      std::function<std::string()> render);
  ~MetricsEndpoint();
  MetricsEndpoint(const MetricsEndpoint&) = delete;
  MetricsEndpoint& operator=(const MetricsEndpoint&) = delete;

  // "host:port" with the real port.
  std::string endpoint() const { return endpoint_; }
  void Stop();

 private:
  MetricsEndpoint() = default;
  struct Daemon;
  std::unique_ptr<Daemon> daemon_;  // holds the render callback too
  std::string endpoint_;
};

}  // namespace membox::node

#endif  // MEMBOX_NODE_METRICS_ENDPOINT_H_
