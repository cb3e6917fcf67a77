// Workers connected to each other, every pair directly: the direct path
// of the torch backend's all-to-all (the exchange DLRM's embeddings and
// expert-parallel layers make), which the memory nodes would only relay.
//
// A pair's bytes of at most `inline_bytes` travel inside its one kPiece
// notice (latency: one message, no ACK). Larger ones move in pieces: each
// worker gives every peer a receive buffer of `max_bytes / world` bytes (at
// least 64 KiB) and keeps a send buffer per peer; each piece is a one-sided
// write into the peer's buffer (mapped memory on one host, RDMA/TCP across
// hosts) followed by a kPiece notice. Where the peer's buffer is mapped, a
// pair above 32 KiB that fits one buffer is written too, not inline (one
// copy instead of three), with an empty kPiece notice. The receiver copies
// the piece out and ACKs it; the sender reads that ACK before it next
// writes into that buffer (in this call or a later one). Every notice carries
// the pair's byte count for the call and every pair sends at least one per
// call, so sizes that disagree are found at once.
//
// Setup is two-phase like RingAllreduce: Create() listens, endpoint() is
// what others need, Connect() takes every worker's endpoint in rank order.
//
// Failure: a dead peer or a timeout gives kUnavailable / kDeadlineExceeded
// naming the peer; sizes that disagree give kInvalidArgument naming both
// workers. After any failure the mesh closes its channels (its peers fail
// at once rather than at their deadline) and refuses later calls
// (kFailedPrecondition with the first error): the receive buffers are
// then unspecified.
// Thread-safety: one call at a time per Mesh object; Connect first.
#ifndef MEMBOX_COLLECTIVE_MESH_H_
#define MEMBOX_COLLECTIVE_MESH_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "membox/base/status.h"
#include "membox/collective/direct_options.h"

namespace membox::collective {

using MeshOptions = DirectOptions;

class Mesh {
 public:
  static Result<std::unique_ptr<Mesh>> Create(const MeshOptions& options);
  virtual ~Mesh() = default;
  virtual std::string endpoint() const = 0;
  // Connects with every other worker; `endpoints[i]` is worker i's
  // endpoint().
  virtual Status Connect(const std::vector<std::string>& endpoints) = 0;
  // All-to-all of bytes: `sends[q]` goes to worker q, and `recvs[q]`
  // receives worker q's `sends[rank]` (sizes may differ between pairs; a
  // pair's two sizes must be equal). `sends[rank]` is copied into
  // `recvs[rank]`. Every worker sends and receives in parallel with all its
  // peers, each pair's bytes crossing once.
  virtual Status AllToAll(const std::vector<std::span<const uint8_t>>& sends,
                          const std::vector<std::span<uint8_t>>& recvs) = 0;
};

}  // namespace membox::collective

#endif  // MEMBOX_COLLECTIVE_MESH_H_
