// The parameter client's profiler (seed 000 COARSE §III.E): how long a push
// of each size takes to each proxy, sampled so that equal proxies come out
// equal on a noisy machine, and how much a proxy's inbound and outbound
// copies share a bottleneck. What it measures is handed in as callbacks (a
// transfer to one proxy; a write and a read at once), so the sampling rules
// are tested here without a network; the client supplies transfers over
// its channels and picks the routing table from the samples
// (ps::ChooseRouting).
//
// Ownership: none; the callbacks are called in the caller's thread, one at
// a time. Threading: the functions are reentrant. Completion: synchronous;
// the first error a callback returns is returned.
#ifndef MEMBOX_SRC_PS_CLIENT_PROFILER_H_
#define MEMBOX_SRC_PS_CLIENT_PROFILER_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "membox/base/status.h"
#include "membox/ps/routing.h"

namespace membox::ps::client {

// How one sample is taken. A sample times transfers back to back until it
// moved `sustain_bytes` or took `sustain_time` (at least one transfer):
// long enough that the burst a link lets through unthrottled (tc's tbf
// passes 4 ms of line rate at once here; switches buffer about as much) is
// a small part of it, short enough that a slow far link keeps the profile
// short. It also lasts `min_time` at least (within `sustain_time`): over
// shared memory a 16 MiB transfer takes about a millisecond, as long as one
// wake-up of a proxy that another process's time slice delayed, and
// single-transfer samples of two equal proxies on one 2-core host came out
// 2-3x apart, so the table did not stripe in about one run in three
// (docs/design/ps.md).
struct SampleRules {
  uint64_t sustain_bytes = 2 << 20;
  std::chrono::nanoseconds min_time = std::chrono::milliseconds(10);
  std::chrono::nanoseconds sustain_time = std::chrono::milliseconds(50);
  // The clock samples are timed with (a test's virtual one).
  std::function<std::chrono::steady_clock::time_point()> now = [] {
    return std::chrono::steady_clock::now();
  };
};

// One push's cost to proxy `proxy`: `bytes` to it, visible there, and a
// request / reply.
using Transfer = std::function<Status(uint32_t proxy, uint64_t bytes)>;

// The median time of a transfer of each of `sizes` to each of `proxies`
// proxies over `repeats` samples (after one warm-up sample each),
// interleaved: size by size, each repeat visiting every proxy in turn, so
// that what else the machine or the links do at the time falls on every
// proxy alike. Measured one proxy after the other, equal nodes on one host
// came out unequal often enough to lose the striping (BERT-large in `bench
// train`: 2.5x the iteration). kInvalidArgument without sizes, proxies or
// repeats.
Result<std::vector<ProfileSample>> SampleTransfers(
    uint32_t proxies, const std::vector<uint64_t>& sizes, int repeats,
    const Transfer& transfer, const SampleRules& rules = {});

// Writes `in_bytes` to a proxy and reads `out_bytes` from it at once, and
// waits for both.
using InOutTransfer =
    std::function<Status(uint64_t in_bytes, uint64_t out_bytes)>;

// How much a write to a proxy and a read from it share a bottleneck
// (ps::SharingFromProbe of the write alone, the read alone and half of
// each at once, `bytes` each, medians of `repeats` samples of at least
// `rules.min_time`): over a full-duplex link the two directions are
// independent (0) and pipelining hides a shard's fill; on one host both
// are copies by the same cores (near 1) and shards only add fixed costs.
Result<double> MeasureInOutSharing(uint64_t bytes, int repeats,
                                   const InOutTransfer& transfer,
                                   const SampleRules& rules = {});

// What a table was chosen from, for the log: each proxy's time at the
// smallest size and its bandwidth at the largest, e.g.
// " [proxy 0: 35 us, 2.10 GB/s] [proxy 1: ...]".
std::string DescribeSamples(const std::vector<ProfileSample>& samples);

}  // namespace membox::ps::client

#endif  // MEMBOX_SRC_PS_CLIENT_PROFILER_H_
