// Every rank of an MPI benchmark job routes the same way: rank 0's profiled
// routing table, broadcast. Profiles taken at the same time through shared
// links differ by noise, and workers routing one key differently make the
// proxies fall back to their ring. Header-only: for bench targets that link
// MPI and membox_ps. Collective: every rank calls it, after MPI_Init.
//
// The other ranks wait for rank 0's profile asleep (MPI_Ibcast polled every
// millisecond), not in MPI_Bcast: Open MPI busy-polls there, and on a host
// with fewer cores than processes (one host, 4 workers and 2 proxies on 2
// cores) three spinning ranks took the cores the profile was measuring, so
// equal proxies measured unequal and rank 0's table often did not stripe.
#ifndef MEMBOX_BENCH_COMMON_MPI_ROUTING_H_
#define MEMBOX_BENCH_COMMON_MPI_ROUTING_H_

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include <mpi.h>

#include "membox/ps/routing.h"

namespace membox::bench {

// Waits for `req` asleep, polling every millisecond (Open MPI busy-polls in
// its blocking calls).
inline void WaitAsleep(MPI_Request* req) {
  for (int done = 0;;) {
    MPI_Test(req, &done, MPI_STATUS_IGNORE);
    if (done) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// A barrier whose waiters sleep. Call before rank 0 profiles: every rank has
// then connected, so no other worker's connection set-up lands on the
// proxies while they are measured.
inline void BarrierAsleep() {
  MPI_Request req;
  MPI_Ibarrier(MPI_COMM_WORLD, &req);
  WaitAsleep(&req);
}

// Every rank's `endpoint` (at most 127 bytes), in rank order: how the
// workers' own collectives (rings, meshes) find each other under MPI.
inline std::vector<std::string> AllgatherEndpoints(
    const std::string& endpoint) {
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  char mine[128] = {0};
  std::snprintf(mine, sizeof mine, "%s", endpoint.c_str());
  std::vector<char> all(128 * static_cast<size_t>(world));
  MPI_Allgather(mine, 128, MPI_CHAR, all.data(), 128, MPI_CHAR, MPI_COMM_WORLD);
  std::vector<std::string> eps;
  for (int i = 0; i < world; ++i) eps.emplace_back(&all[128 * i]);
  return eps;
}

inline void BroadcastRouting(ps::RoutingTable* t) {
  uint64_t v[6] = {t->threshold,       t->lat_proxy,        t->bw_proxy,
                   t->partition_bytes, t->stripe ? 1u : 0u, t->pipeline_bytes};
  MPI_Request req;
  MPI_Ibcast(v, 6, MPI_UINT64_T, 0, MPI_COMM_WORLD, &req);
  WaitAsleep(&req);
  t->threshold = v[0];
  t->lat_proxy = static_cast<uint32_t>(v[1]);
  t->bw_proxy = static_cast<uint32_t>(v[2]);
  t->partition_bytes = v[3];
  t->stripe = v[4] != 0;
  t->pipeline_bytes = v[5];
}

}  // namespace membox::bench

#endif  // MEMBOX_BENCH_COMMON_MPI_ROUTING_H_
