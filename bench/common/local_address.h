// The address of this host's interface that reaches a given endpoint: where
// a benchmark's worker-to-worker paths (the ring) listen, so that they also
// work across hosts (`membox bench cluster`). No packet is sent.
// Threading: any thread.
#ifndef MEMBOX_BENCH_COMMON_LOCAL_ADDRESS_H_
#define MEMBOX_BENCH_COMMON_LOCAL_ADDRESS_H_

#include <string>

namespace membox::bench {

// `endpoint` is host:port (IPv4); 127.0.0.1 when no route is found.
std::string LocalAddressToward(const std::string& endpoint);

// Whether `address` (as LocalAddressToward gives it) is a loopback one: the
// endpoint is on this host.
bool IsLoopbackAddress(const std::string& address);

}  // namespace membox::bench

#endif  // MEMBOX_BENCH_COMMON_LOCAL_ADDRESS_H_
