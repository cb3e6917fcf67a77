#include "membox/node/memory_node.h"

#include "membox/base/logging.h"

namespace membox::node {

Result<std::unique_ptr<MemoryNode>> MemoryNode::Start(MemoryNodeOptions o) {
  std::unique_ptr<MemoryNode> n(new MemoryNode());
  o.memory.secret = o.secret;
  o.memory.transports = o.transports;
  auto m = memserver::Server::Start(o.memory);
  if (!m.ok()) return m.status().WithContext("memory server");
  n->memory_ = std::move(*m);
  if (o.proxy) {
    o.proxy->secret = o.secret;
    o.proxy->transports = o.transports;
    auto p = ps::Proxy::Start(*o.proxy);
    if (!p.ok()) {
      n->Stop();
      return p.status().WithContext("parameter proxy");
    }
    n->proxy_ = std::move(*p);
  }
  if (o.embedding) {
    o.embedding->secret = o.secret;
    o.embedding->transports = o.transports;
    auto e = embedding::EmbeddingServer::Start(*o.embedding);
    if (!e.ok()) {
      n->Stop();
      return e.status().WithContext("embedding server");
    }
    n->embedding_ = std::move(*e);
  }
  return n;
}

MemoryNode::~MemoryNode() { Stop(); }

std::string MemoryNode::Describe() const {
  std::string s = "memory node " + memory_->endpoint();
  if (proxy_) s += ", parameter proxy " + proxy_->endpoint();
  if (embedding_) s += ", embedding server " + embedding_->endpoint();
  return s;
}

void MemoryNode::Stop() {
  if (stopped_) return;
  stopped_ = true;
  if (embedding_) embedding_->Stop();  // flushes: every update durable
  if (proxy_) proxy_->Stop();
  if (memory_) memory_->Stop();
}

}  // namespace membox::node
