#include "membox/node/memory_node.h"

#include "membox/base/logging.h"

namespace membox::node {
namespace {

// What every service of the node shares: the secret, the admission rule and
// the transports.
template <typename ServiceOptions>
void ShareNodeSettings(const MemoryNodeOptions& node, ServiceOptions& o) {
  o.secret = node.secret;
  o.admit = node.admit;
  o.transports = node.transports;
}

}  // namespace

Result<std::unique_ptr<MemoryNode>> MemoryNode::Start(MemoryNodeOptions o) {
  std::unique_ptr<MemoryNode> n(new MemoryNode());
  ShareNodeSettings(o, o.memory);
  auto m = memserver::Server::Start(o.memory);
  if (!m.ok()) return m.status().WithContext("memory server");
  n->memory_ = std::move(*m);
  if (o.proxy) {
    ShareNodeSettings(o, *o.proxy);
    auto p = ps::Proxy::Start(*o.proxy);
    if (!p.ok()) {
      n->Stop();
      return p.status().WithContext("parameter proxy");
    }
    n->proxy_ = std::move(*p);
  }
  if (o.embedding) {
    ShareNodeSettings(o, *o.embedding);
    auto e = embedding::EmbeddingServer::Start(*o.embedding);
    if (!e.ok()) {
      n->Stop();
      return e.status().WithContext("embedding server");
    }
    n->embedding_ = std::move(*e);
  }
  std::vector<std::pair<std::string, std::string>> services;
  if (n->proxy_)
    services.emplace_back("parameter_proxy", n->proxy_->endpoint());
  if (n->embedding_) {
    services.emplace_back("embedding_server", n->embedding_->endpoint());
  }
  n->memory_->SetServices(std::move(services));
  if (!o.metrics_listen.empty()) {
    MetricsEndpointOptions mo;
    mo.listen = o.metrics_listen;
    mo.bearer_token = o.metrics_token;
    MemoryNode* raw = n.get();
    auto me = MetricsEndpoint::Start(mo, [raw] { return raw->MetricsText(); });
    if (!me.ok()) {
      n->Stop();
      return me.status();
    }
    n->metrics_ = std::move(*me);
  }
  return n;
}

MemoryNode::~MemoryNode() { Stop(); }

std::string MemoryNode::Describe() const {
  std::string s = "memory node " + memory_->endpoint();
  if (proxy_) s += ", parameter proxy " + proxy_->endpoint();
  if (embedding_) s += ", embedding server " + embedding_->endpoint();
  if (metrics_) s += ", metrics http://" + metrics_->endpoint() + "/metrics";
  return s;
}

std::string MemoryNode::MetricsText() const {
  MetricsWriter w;
  w.Gauge("membox_up", "1 while the memory node serves.", 1);
  w.Gauge("membox_services",
          "Services this node runs (memory always; proxy, embedding).",
          1.0 + (proxy_ ? 1 : 0) + (embedding_ ? 1 : 0));
  if (memory_) memory_->Metrics(w);
  if (proxy_) proxy_->Metrics(w);
  if (embedding_) embedding_->Metrics(w);
  return w.Text();
}

void MemoryNode::Stop() {
  if (stopped_) return;
  stopped_ = true;
  if (metrics_) metrics_->Stop();      // no scrape reaches a stopping service
  if (embedding_) embedding_->Stop();  // flushes: every update durable
  if (proxy_) proxy_->Stop();
  if (memory_) memory_->Stop();
}

}  // namespace membox::node
