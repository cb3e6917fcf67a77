// Every rank of an MPI benchmark job routes the same way: rank 0's profiled
// routing table, broadcast. Profiles taken at the same time through shared
// links differ by noise, and workers routing one key differently make the
// proxies fall back to their ring. Header-only: for bench targets that link
// MPI and membox_ps. Collective: every rank calls it, after MPI_Init.
#ifndef MEMBOX_BENCH_COMMON_MPI_ROUTING_H_
#define MEMBOX_BENCH_COMMON_MPI_ROUTING_H_

#include <cstdint>

#include <mpi.h>

#include "membox/ps/routing.h"

namespace membox::bench {

inline void BroadcastRouting(ps::RoutingTable* t) {
  uint64_t v[6] = {t->threshold,       t->lat_proxy,        t->bw_proxy,
                   t->partition_bytes, t->stripe ? 1u : 0u, t->pipeline_bytes};
  MPI_Bcast(v, 6, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  t->threshold = v[0];
  t->lat_proxy = static_cast<uint32_t>(v[1]);
  t->bw_proxy = static_cast<uint32_t>(v[2]);
  t->partition_bytes = v[3];
  t->stripe = v[4] != 0;
  t->pipeline_bytes = v[5];
}

}  // namespace membox::bench

#endif  // MEMBOX_BENCH_COMMON_MPI_ROUTING_H_
