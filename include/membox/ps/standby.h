// A standby memory node's watch (`membox serve --standby`; docs/design/
// ps.md, "Standby nodes"): it waits, holding nothing, for one of a job's
// parameter proxies to die, and then takes its place on its own host, with no
// operator and no launcher on the dead node's host.
//
// AwaitVacancy polls the job's proxies. One it cannot reach is a
// candidate: it asks every proxy it reaches to let it take that place
// (kClaim). A proxy that lost the candidate grants it; one with no link
// to the candidate cannot tell, and records the claim -- when this watch
// had reached the candidate and lost it, such a proxy tries to reach it
// too, and grants the next claim if it cannot (so a death is noticed even
// when the job's nodes never linked to each other); one still linked
// to it, or that granted the place to another standby first, refuses.
// With at least one grant and no refusal, the place is this standby's: the
// caller then starts its proxy as that rank at `endpoint`, joining
// (ProxyOptions::join), and the survivors take its hello as the
// replacement. Refused, it lets go of the claims it got and watches on; a
// refusal no later poll can change (the job keeps one copy of each shard,
// or this standby's credential is not a node's) ends the wait.
//
// Ownership: makes its own transport device and links, closed before it
// returns. Threading: blocks the calling thread; `stop` is called on it
// between polls. Completion: returns the place (a rank among `peers`), or
// the error that ended the wait (CANCELLED when `stop` said so).
#ifndef MEMBOX_PS_STANDBY_H_
#define MEMBOX_PS_STANDBY_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "membox/base/status.h"

namespace membox::ps {

struct StandbyOptions {
  // The job's proxies in ring order (their --ps-peers); two or more.
  std::vector<std::string> peers;
  // Where this standby's proxy will listen, as the peers and the workers
  // reach it (host:port; not a wildcard address, not port 0).
  std::string endpoint;
  std::string secret;  // a principal with the node right
  std::string transports = "auto";
  std::chrono::milliseconds poll{100};
  // Called between polls: true ends the wait (CANCELLED).
  std::function<bool()> stop;
};

// Checks `o` (INVALID_ARGUMENT naming the field), then waits as above.
Result<uint32_t> AwaitVacancy(const StandbyOptions& o);

}  // namespace membox::ps

#endif  // MEMBOX_PS_STANDBY_H_
