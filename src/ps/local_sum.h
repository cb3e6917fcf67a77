// A round's local sum on a memory node: the pushes of one shard's round
// summed in rank order into the shard's scratch buffer, scaled (an
// average's 1/world where this node's sum is the result), and -- where the
// sum is the round's result -- written into the workers' mapped outputs in
// the same pass. The proxy's round engine calls it when a round starts
// (ProxyImpl::LocalSum gathers the pushes; RoundGate said when).
//
// Threading: runs on the caller's thread (the proxy's event loop), the
// arithmetic on the sync cores; a push's `read` runs on the caller's
// thread. Ownership: nothing is kept; the pushes and buffers are the
// caller's.
#ifndef MEMBOX_SRC_PS_LOCAL_SUM_H_
#define MEMBOX_SRC_PS_LOCAL_SUM_H_

#include <cstdint>
#include <functional>
#include <span>

#include "membox/base/accumulate.h"
#include "membox/base/dtype.h"
#include "membox/base/status.h"
#include "membox/transport/mem_region.h"

namespace membox::ps {

// One worker's push to a round.
struct PushInput {
  // Its bytes where this node holds or maps them: a prefetched copy, or the
  // worker's memory mapped here. Null: `read` fetches them.
  const void* data = nullptr;
  // Reads the push into `into` (registered as `into_region`) and returns
  // where its bytes are (`into`, or memory the read found mapped).
  std::function<Result<const uint8_t*>(uint8_t* into,
                                       const transport::MemRegion& into_region)>
      read;
  // Where the sum is the round's result: the worker's mapped output (it
  // gets the result in the summing pass), or null.
  void* output = nullptr;
};

// What the sum did besides the sum.
struct LocalSumDone {
  // Every push was in memory: one fused pass, which also wrote the
  // outputs given (PushInput::output); otherwise none was written.
  bool outputs_written = false;
  size_t outputs = 0;  // how many
};

// dst (registered as dst_region, `bytes` of `dtype`) <- scale * (pushes[0]
// + pushes[1] + ...); zeros when there is no push. Every push in memory:
// one pass on the sync cores. Otherwise one push at a time: the first
// read straight into dst, each other into `staging(bytes)` (a registered
// buffer the caller keeps) and added. A read or staging error stops the
// sum and is returned; dst is then undefined.
Result<LocalSumDone> SumPushes(
    SyncCores& cores, DType dtype, uint8_t* dst,
    const transport::MemRegion& dst_region, uint64_t bytes,
    std::span<const PushInput> pushes, double scale,
    const std::function<Result<transport::MemRegion*>(uint64_t)>& staging);

}  // namespace membox::ps

#endif  // MEMBOX_SRC_PS_LOCAL_SUM_H_
