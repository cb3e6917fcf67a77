// Hierarchical AllReduce (seed 004 §C.3): workers are grouped into nodes of
// `local_size` consecutive ranks. Each node first reduces to its leader
// (local rank 0) along a binary tree; the leaders then exchange in pairs in
// log2(nodes) steps (recursive doubling: partner = node XOR 2^k, both sum);
// finally each leader broadcasts the result down its tree. On real clusters
// this keeps the slow inter-node links to log2(nodes) full-buffer exchanges
// per leader while the fast intra-node links do the rest.
//
// Setup is two-phase like RingAllreduce (Create, endpoint(), Connect with
// every worker's endpoint). The number of nodes must be a power of two.
// Data moves by one-sided writes into the peer's receive buffer followed by
// a READY notice; the receiver's ACK frees the buffer for the next step.
//
// Failure: a dead peer or a timeout gives kUnavailable / kDeadlineExceeded
// naming it. Thread-safety: one Allreduce at a time per object.
#ifndef MEMBOX_COLLECTIVE_HIERARCHICAL_ALLREDUCE_H_
#define MEMBOX_COLLECTIVE_HIERARCHICAL_ALLREDUCE_H_

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "membox/base/status.h"

namespace membox::collective {

struct HierarchicalOptions {
  int rank = 0;
  int world = 1;
  int local_size = 1;  // workers per node; world % local_size == 0
  std::string listen = "0.0.0.0:0";
  std::string transports = "auto";
  // Shared secret of the ring: peers prove it when they connect (the
  // workers' listeners face the network too).
  std::string secret;
  size_t max_bytes = 64 << 20;
  std::chrono::milliseconds timeout{60000};
};

class HierarchicalAllreduce {
 public:
  static Result<std::unique_ptr<HierarchicalAllreduce>> Create(
      const HierarchicalOptions& options);
  virtual ~HierarchicalAllreduce() = default;
  virtual std::string endpoint() const = 0;
  virtual Status Connect(const std::vector<std::string>& endpoints) = 0;
  // data[i] <- sum over workers; equal `count` on every worker.
  virtual Status Allreduce(float* data, size_t count) = 0;
};

}  // namespace membox::collective

#endif  // MEMBOX_COLLECTIVE_HIERARCHICAL_ALLREDUCE_H_
