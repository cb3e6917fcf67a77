// Worker-side ring AllReduce (the "GPU synchronisation" half of seed 000's
// dual synchronisation, §III.F): p workers sum a buffer in place by
// reduce-scatter + all-gather over p chunks (or only all-gather bytes: the
// direct path of the torch backend's all_gather), each step a one-sided write
// of one chunk into the next worker's receive buffer (mapped memory on one
// host, RDMA/TCP across hosts) followed by a control notice.
//
// Setup is two-phase because the endpoints must be exchanged by the
// launcher (MPI, the parameter service, a host file): Create() listens,
// endpoint() is what others need, Connect() takes every worker's endpoint
// in rank order.
//
// Flow control: a worker writes into its successor's receive buffer only
// after the successor acknowledged the previous step, so a step never
// overwrites data that is still being read. Allreduce() returns when this
// worker's buffer holds the sum and its successor has consumed everything
// it was sent (the next call may start at once).
//
// Failure: a dead neighbour or a timeout gives kUnavailable /
// kDeadlineExceeded naming the neighbour; the buffer is then unspecified.
// A pipelined call (RingOptions::segment_bytes) that fails also closes the
// connections to both neighbours: every later call fails at once.
// Threading: one call at a time per RingAllreduce object; a pipelined call
// runs a sender thread of its own, joined before it returns.
#ifndef MEMBOX_COLLECTIVE_RING_ALLREDUCE_H_
#define MEMBOX_COLLECTIVE_RING_ALLREDUCE_H_

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "membox/base/dtype.h"
#include "membox/base/status.h"

namespace membox::collective {

struct RingOptions {
  int rank = 0;
  int world = 1;
  std::string listen = "0.0.0.0:0";
  std::string transports = "auto";
  // Shared secret of the ring: peers prove it when they connect (the
  // workers' listeners face the network too).
  std::string secret;
  size_t max_bytes = 64 << 20;  // largest buffer Allreduce will be given
  // Pipelining (Allreduce, Allgather, ReduceScatter): a step's chunk of at
  // least twice this many bytes goes in segments of about this size (at
  // most 16), each forwarded by a sender thread as soon as it arrived, with
  // no barrier between steps: for links, where a step's adds and notices
  // would leave the link idle. 0: one piece per step, on the calling
  // thread (memory speed, one host). Must be equal on every worker.
  size_t segment_bytes = 0;
  std::chrono::milliseconds timeout{60000};
};

class RingAllreduce {
 public:
  static Result<std::unique_ptr<RingAllreduce>> Create(
      const RingOptions& options);
  virtual ~RingAllreduce() = default;
  virtual std::string endpoint() const = 0;
  // Connects to the neighbours; `endpoints[i]` is worker i's endpoint().
  virtual Status Connect(const std::vector<std::string>& endpoints) = 0;
  // data[i] <- sum over workers of data[i], `count` elements of `dtype`
  // (float32, float64, float16, bfloat16: the accumulate kernels' types;
  // a 16-bit sum is rounded at each of the p - 1 adds, as Gloo's is); `count` *
  // its size <= max_bytes and equal on every worker. kInvalidArgument for
  // another dtype or too many bytes.
  virtual Status Allreduce(void* data, size_t count, DType dtype) = 0;
  Status Allreduce(float* data, size_t count) {
    return Allreduce(data, count, DType::kFloat32);
  }
  // In-place all-gather of bytes: `data` holds world chunks of
  // `chunk_bytes` each, this worker's own at rank * chunk_bytes; on return
  // every chunk holds its worker's bytes. Each worker sends and receives
  // (world - 1) * chunk_bytes, in pieces of at most max_bytes / world (any
  // chunk size works). `chunk_bytes` must be equal on every worker.
  virtual Status Allgather(void* data, size_t chunk_bytes) = 0;
  // In-place reduce-scatter: `data` holds world chunks of `count` elements
  // of `dtype` (Allreduce's types); on return chunk `rank` holds the sum
  // over workers of every worker's chunk `rank` (the other chunks hold
  // partial sums). Each worker sends and receives (world - 1) * count
  // elements. `count` must be equal on every worker.
  virtual Status ReduceScatter(void* data, size_t count, DType dtype) = 0;
  Status ReduceScatter(float* data, size_t count) {
    return ReduceScatter(data, count, DType::kFloat32);
  }
  // `bytes` of `data` from worker `root` to every worker, down the ring as
  // a chain (root, root+1, ...), pipelined in pieces of at most
  // max_bytes / world: each link carries the bytes once. `bytes` and `root`
  // must be equal on every worker.
  virtual Status Broadcast(void* data, size_t bytes, int root) = 0;
};

}  // namespace membox::collective

#endif  // MEMBOX_COLLECTIVE_RING_ALLREDUCE_H_
