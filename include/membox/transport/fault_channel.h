// A Channel decorator that injects latency, bandwidth limits and faults from
// a FaultPolicy (Mooncake TENT's fault proxy; COARSE emulated its CCI links
// the same way: time = fixed cost + bytes / bandwidth).
//
// Latency model: the wrapped operation runs at once; its completion is
// reported to the caller at
//   max(now, link_busy_until) + bytes / bandwidth + fixed_latency,
// and link_busy_until advances by bytes / bandwidth, so concurrent transfers
// share the emulated link's bandwidth. Control messages are delivered
// fixed_latency later, in order, without blocking the sender.
//
// Faults, each drawn independently per operation from a seeded generator:
//   fail_submit      Memcpy returns kUnavailable and starts nothing;
//   fail_completion  the operation runs but completes with kUnavailable;
//   drop_completion  the completion is never reported (Wait times out with
//                    kDeadlineExceeded; the handle's destructor then gives
//                    up after drop_grace and reports kAborted);
//   corrupt          the completion reports kDataLoss, and a read's first
//                    byte in the local buffer is flipped.
//
// Thread-safety: as Channel. The wrapper owns one timer thread.
#ifndef MEMBOX_TRANSPORT_FAULT_CHANNEL_H_
#define MEMBOX_TRANSPORT_FAULT_CHANNEL_H_

#include <chrono>
#include <cstdint>
#include <memory>

#include "membox/transport/channel.h"

namespace membox::transport {

struct FaultPolicy {
  std::chrono::nanoseconds fixed_latency{0};
  double bandwidth_bytes_per_s = 0;  // 0: no bandwidth limit
  double fail_submit = 0;
  double fail_completion = 0;
  double drop_completion = 0;
  double corrupt = 0;
  // A dropped completion is reported as kAborted after this long, so that
  // nothing waits forever on an emulated loss.
  std::chrono::nanoseconds drop_grace = std::chrono::seconds(5);
  uint64_t seed = 1;
};

std::shared_ptr<Channel> WrapWithFaults(std::shared_ptr<Channel> inner,
                                        const FaultPolicy& policy);

}  // namespace membox::transport

#endif  // MEMBOX_TRANSPORT_FAULT_CHANNEL_H_
