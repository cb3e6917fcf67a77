// MemoryNode: one memory node of a membox cluster -- what `membox serve`
// runs, as a library type (for embedding a node in another program, and for
// tests that start nodes the way operators do).
//
// A node always runs the memory server (seed 003: pool, segments,
// accumulate); optionally the parameter proxy (seed 000: push / pull,
// rounds, the ring between nodes) and the embedding server (seed 004: the
// sparse store's memory and SSD tiers). Each service has its own listener
// (service::Server), all with the node's one secret and transports.
//
// With `metrics_listen`, the node also serves every service's metrics in
// the Prometheus text format over HTTP (metrics_endpoint.h).
//
// Start starts them in that order and, when one fails, stops the ones
// already running before it returns the error (naming the service). Stop
// stops them in reverse: the embedding server first (its final flush makes
// every acknowledged update durable), then the proxy, then the memory
// server.
//
// Threading: Start / Stop from one thread; the accessors from any.
#ifndef MEMBOX_NODE_MEMORY_NODE_H_
#define MEMBOX_NODE_MEMORY_NODE_H_

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "membox/base/credential.h"
#include "membox/base/status.h"
#include "membox/embedding/server.h"
#include "membox/memserver/server.h"
#include "membox/node/metrics_endpoint.h"
#include "membox/ps/proxy.h"

namespace membox::node {

struct MemoryNodeOptions {
  // The node's secret and transports go to every service (the services'
  // own secret / transports fields are overwritten).
  std::string secret;
  std::string transports = "auto";
  // Admits principals on every service (revocation; base/credential.h).
  std::function<Status(const Principal&)> admit;
  memserver::ServerOptions memory;
  std::optional<ps::ProxyOptions> proxy;                       // unset: none
  std::optional<embedding::EmbeddingServerOptions> embedding;  // unset: none
  // "host:port": serve Prometheus metrics of every service at
  // http://host:port/metrics (metrics_endpoint.h). Empty: no such port.
  std::string metrics_listen;
  // With it, a scrape must send "Authorization: Bearer <token>".
  std::string metrics_token;
};

class MemoryNode {
 public:
  static Result<std::unique_ptr<MemoryNode>> Start(MemoryNodeOptions options);
  ~MemoryNode();
  MemoryNode(const MemoryNode&) = delete;
  MemoryNode& operator=(const MemoryNode&) = delete;

  memserver::Server& memory() { return *memory_; }
  ps::Proxy* proxy() { return proxy_.get(); }  // may be null
  embedding::EmbeddingServer* embedding() { return embedding_.get(); }

  // "memory node h:p, parameter proxy h:p, embedding server h:p[, metrics
  // http://h:p/metrics]".
  std::string Describe() const;
  // Every service's metrics, in the Prometheus text format (what the
  // metrics endpoint serves). Any thread.
  std::string MetricsText() const;
  // "host:port" of the metrics endpoint; empty when none.
  std::string metrics_endpoint() const {
    return metrics_ ? metrics_->endpoint() : "";
  }

  // Idempotent.
  void Stop();

 private:
  MemoryNode() = default;
  std::unique_ptr<memserver::Server> memory_;
  std::unique_ptr<ps::Proxy> proxy_;
  std::unique_ptr<embedding::EmbeddingServer> embedding_;
  std::unique_ptr<MetricsEndpoint> metrics_;  // stopped first
  bool stopped_ = false;
};

}  // namespace membox::node

#endif  // MEMBOX_NODE_MEMORY_NODE_H_
