#include "src/ps/local_sum.h"

#include <atomic>
#include <cstring>
#include <vector>

#include "src/ps/reduce.h"

namespace membox::ps {

Result<LocalSumDone> SumPushes(
    SyncCores& cores, DType dtype, uint8_t* dst,
    const transport::MemRegion& dst_region, uint64_t bytes,
    std::span<const PushInput> pushes, double scale,
    const std::function<Result<transport::MemRegion*>(uint64_t)>& staging) {
  LocalSumDone done;
  if (pushes.empty()) {
    std::memset(dst, 0, bytes);
    return done;  // zeros need no scaling
  }
  bool all_in_memory = true;
  for (const PushInput& p : pushes) all_in_memory &= p.data != nullptr;
  if (all_in_memory) {
    // One pass: the outputs get the result from the cache as each block is
    // done (no second pass over the shard per worker afterwards).
    std::vector<const void*> srcs;
    std::vector<void*> outs;
    for (const PushInput& p : pushes) {
      srcs.push_back(p.data);
      if (p.output) outs.push_back(p.output);
    }
    SumInto(cores, dtype, dst, srcs, bytes, scale, outs);
    if (!outs.empty()) {
      // The workers read their outputs once told: publish the stores.
      std::atomic_thread_fence(std::memory_order_release);
    }
    done.outputs_written = true;
    done.outputs = outs.size();
    return done;
  }
  const size_t count = bytes / DTypeSize(dtype);
  bool first = true;
  for (const PushInput& p : pushes) {
    uint8_t* into = dst;
    const transport::MemRegion* into_region = &dst_region;
    if (!first) {
      ASSIGN_OR_RETURN(transport::MemRegion * st, staging(bytes));
      into = static_cast<uint8_t*>(st->data());
      into_region = st;
    }
    const uint8_t* src = static_cast<const uint8_t*>(p.data);
    if (!src) {
      ASSIGN_OR_RETURN(src, p.read(into, *into_region));
    }
    if (first) {
      if (src != dst) std::memcpy(dst, src, bytes);
      first = false;
    } else {
      cores.Run(dtype, dst, src, count, 1.0);
    }
  }
  if (scale != 1.0) ScaleInPlace(cores, dtype, dst, count, scale);
  return done;
}

}  // namespace membox::ps
