// The environment's settings of a parameter client, for the edges: the
// `membox` tools, the bench drivers and the Python binding call this once
// and hand the client explicit options. The client itself (param_client.h)
// reads no environment variable.
//
//   MEMBOX_RESTART=1            options.restarted (set by `membox launch
//                               --max-restarts` on a restarted worker set)
//   MEMBOX_PROXY_DELAYS_MS=a,b  options.links: one added latency per proxy,
//                               in milliseconds (set by `membox cluster`
//                               where the kernel has no netem); only where
//                               options.links is empty
//   MEMBOX_HANG_REPORT_S=S      options.hang_report (0: never)
//   MEMBOX_FAILOVER_S=S         options.failover (0: off)
//   MEMBOX_COMBINE=0|1          options.combine
//   MEMBOX_HOLD_PUSHES=across-hosts|always|never  options.hold_pushes
//
// Unset or empty variables leave the options as they are; a malformed one
// is an error naming it and saying what it takes. Not thread-safe against
// concurrent setenv (as getenv is not).
#ifndef MEMBOX_PS_CLIENT_ENVIRONMENT_H_
#define MEMBOX_PS_CLIENT_ENVIRONMENT_H_

#include "membox/base/status.h"
#include "membox/ps/param_client.h"

namespace membox::ps {

Status ApplyClientEnvironment(ParamClientOptions* options);

}  // namespace membox::ps

#endif  // MEMBOX_PS_CLIENT_ENVIRONMENT_H_
