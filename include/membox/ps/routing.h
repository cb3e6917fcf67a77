// Tensor routing and partitioning (seed 000 COARSE §III.E).
//
// A routing table has three entries: a size threshold S, the proxy with the
// lowest latency (LatProxy) and the one with the highest bandwidth
// (BwProxy). Requests smaller than S go to LatProxy, the rest to BwProxy.
// Tensors larger than the partition size S' are split into equal shards.
//
// ChooseRouting() builds the table from profiler measurements: transfer time
// per proxy over a range of sizes. LatProxy: the lowest time at the smallest
// size; BwProxy: the highest bandwidth at the largest size; if they differ,
// S is the first measured size at which BwProxy's time is not above
// LatProxy's (linearly interpolated between the two sizes around the
// crossing); S' is the smallest size reaching >= 90 % of BwProxy's best
// bandwidth. Stripe is chosen when there are several proxies and equal
// shards over all of them (time n / (M * slowest bandwidth)) beat sending
// everything to BwProxy (n / best) by `stripe_gain`: with two proxies, when
// the slower has at least 55 % of the faster's bandwidth. (It was "every
// proxy within 70 % of the best": on one host, where the proxies share the
// memory bus, profiles of equal proxies fell below that often enough that
// the default did not stripe in about one run in four, at twice the
// iteration time; striping over a proxy at 60 % still beats one proxy.) The
// pipelining size P is the product of BwProxy's fixed cost per transfer and its
// bandwidth (the intercept and slope of a least squares line through its
// samples; where noise makes the intercept negative, the smallest size's time
// less its streaming time): ChooseShardBytes() cuts what one node gets of a
// key into shards of about sqrt(node bytes * P) (the profiler first scales P
// by PipelineBytesForSharing). Pure functions; thread-safe.
#ifndef MEMBOX_PS_ROUTING_H_
#define MEMBOX_PS_ROUTING_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "membox/base/status.h"

namespace membox::ps {

// The smallest shard a key may be split into (a proxy refuses smaller ones:
// every shard is a registered region of its own, and a tensor in 4-byte
// shards would make a proxy allocate a million of them). Tensors smaller
// than this are one shard.
constexpr uint64_t kMinShardBytes = 4096;

// The most shards ChooseShardBytes() cuts a key into: every shard is a
// registered region on each proxy that holds it (a SysV segment where UCX
// maps memory for shared memory, of which a host has 4096), and a proxy
// does a round's fixed work per shard.
constexpr uint64_t kMaxShardsPerKey = 1024;

// The most shards ChooseShardBytes() cuts one node's part of a key into
// when it sizes them from a measured P. P is one worker's fixed cost per
// transfer on an idle link; in a round a node pays more per shard than
// that -- every worker's push of it, every worker's result write, each a
// wake-up of the node's loop on cores it shares -- and the profile does
// not see it. On the emulated cluster (4 worker and 4 memory hosts at
// 400 Mbit/s, a 64 MiB striped key) sqrt(B * P) gave 86 KiB shards, 190 per
// node: 1591-1622 ms a round, against 1522-1531 ms with 256 KiB (64 per
// node); at 16 MiB shards of 32-256 KiB were all within the noise
// (docs/results/cluster.md).
constexpr uint64_t kMaxShardsPerNode = 64;

struct RoutingTable {
  uint64_t threshold = 0;  // S: sizes < S go to lat_proxy
  uint32_t lat_proxy = 0;
  uint32_t bw_proxy = 0;
  uint64_t partition_bytes = 4 << 20;  // S' (at least kMinShardBytes)
  // Stripe: shard s of a key declared under this table lives on proxy
  // (key + s) % proxies alone -- every worker sends it there, that proxy
  // sums and stores it, no ring between proxies. Spreads the load over
  // memory nodes with equal links (each node moves p n / M bytes each way);
  // fixed per key by its first declaration.
  bool stripe = false;
  // P = alpha * beta of BwProxy (bytes): a shard of P bytes spends as long in
  // fixed costs as in streaming. 0: not measured, shards of S'.
  uint64_t pipeline_bytes = 0;
  uint32_t Route(uint64_t bytes) const {
    return bytes < threshold ? lat_proxy : bw_proxy;
  }
  std::string ToString() const;
};

// The proxy that owns shard `shard` of a striped key: (key + shard) %
// proxies (a single proxy when `proxies` is 0 or 1). Workers send the shard
// there alone; that proxy alone sums and stores it.
uint32_t StripeOwner(uint64_t key, uint32_t shard, uint32_t proxies);

// One worker's routing tables over time, kept the same way by the worker
// and by every proxy it sends them to (kRoute), so both answer "where does
// round r of key k go" with one rule: the latest table that applies to
// that round. A table applies to each key it lists from the round given;
// to a key it does not list (declared after it was installed) from round
// 0 if it is the first table and from round 1 otherwise (round 0 may
// already be under way under an earlier table). When no table applies,
// the first does. Not thread-safe: its owner locks.
class RouteHistory {
 public:
  struct Entry {
    RoutingTable table;
    std::map<uint64_t, uint64_t> from;  // key -> first round it applies to
  };

  void Add(RoutingTable table, std::map<uint64_t, uint64_t> from) {
    entries_.push_back({table, std::move(from)});
  }
  bool empty() const { return entries_.empty(); }
  size_t size() const { return entries_.size(); }
  const std::vector<Entry>& entries() const { return entries_; }
  // The table of round `round` of `key`; nullptr when there is none yet.
  const RoutingTable* For(uint64_t key, uint64_t round) const;

 private:
  std::vector<Entry> entries_;
};

// The shard size of a key of `bytes` bytes (elements of `elem_bytes`) over
// `proxies` proxies. A memory node sends a shard's result only after every
// worker's copy of it has arrived, so its inbound and outbound links overlap
// across shards only: cutting the B bytes one node gets into D shards saves
// about B / D of fill and drain and costs D fixed costs (P each, in bytes of
// streaming); the sum is least at B / D = sqrt(B * P), with B = bytes /
// proxies for a striped key and the whole key otherwise (every node of a
// ring handles all of it, and each ring step is a store and forward too).
// With a measured P a node's part is cut into at most kMaxShardsPerNode
// shards. Without a measured P the shard is S'. (S' does not cap the first: it
// bounds one isolated transfer's fixed cost, which in a stream of shards
// overlaps with the others' data. On a 400 Mbit/s link it is 64 KiB, and shards
// that small kept 89 % of the emulated cluster's two cores busy.) The result is
// at most the tensor (a striped key's: a node's part), at least
// kMinShardBytes (or the tensor) and bytes / kMaxShardsPerKey, and a
// multiple of the element size.
uint64_t ChooseShardBytes(const RoutingTable& t, uint64_t bytes,
                          size_t elem_bytes, uint32_t proxies, bool striped);

// Time of one transfer of `bytes` to proxy `proxy`, in seconds.
struct ProfileSample {
  uint32_t proxy = 0;
  uint64_t bytes = 0;
  double seconds = 0;
};

// `sizes` ascending, every proxy measured at every size. kInvalidArgument
// when the samples do not form that grid.
Result<RoutingTable> ChooseRouting(const std::vector<ProfileSample>& samples,
                                   double full_bandwidth_fraction = 0.9,
                                   double stripe_gain = 1.1);

// Dual synchronisation (§III.F): with p workers, n bytes per iteration, the
// first m bytes (in backward order: the last layers) synchronised by the
// proxies and the rest (the first layers) by the workers' own ring AllReduce:
//   T_train(m) = max(T_FP + T_BP + 2(p-1)/p * (n-m) / BW_worker,
//                    T_FP + 2(p-1)/p * m / BW_proxy)
//                + sharing * overlap(m).
// The paper's model (sharing = 0) takes the two paths to be independent, as
// NVLink and the network are. Across hosts they often are not: a worker's
// one link carries its ring traffic and its pushes. `sharing` in [0, 1] is
// how much of the time the two paths run at once is lost to each other
// (0: independent, 1: one shared bottleneck); overlap(m) is that time: the
// ring runs after backward, the proxies from the start of backward, so they
// overlap for min(ring time, proxy time - T_BP) when positive. A probe of
// both paths at once measures it (`SharingFromProbe`).
// Returns the m in [0, n] that minimises T_train (T is piecewise linear in
// m; its minimum is at an end or a breakpoint) and the predicted time; on
// a tie, the larger m. A split is chosen over the proxies alone (m = n)
// only when predicted at least kDualSyncMinGain faster: near a tie the
// model's sharing term is too coarse to tell, and runs do not settle it
// (ResNet-50 on the emulated cluster, a split predicted 3 % faster: 1.14x
// and 0.97x of the proxies alone in two runs; docs/design/ps.md), so the
// simpler plan, one path, wins the tie.
inline constexpr double kDualSyncMinGain = 0.05;
struct DualSyncPlan {
  uint64_t proxy_bytes = 0;  // m
  double predicted_seconds = 0;
};
DualSyncPlan ChooseDualSync(uint64_t total_bytes, int workers, double t_forward,
                            double t_backward, double bw_proxy,
                            double bw_worker, double sharing = 0);
// The split on layer boundaries: how many of the first layers (bytes per
// layer in `layer_bytes`, in the order the ring takes them) the workers'
// ring synchronises, for a plan over their total. Layers are indivisible:
// of the two prefixes around the plan's n - m ring bytes (the longest
// within it, and that one plus the next layer) the one PredictIteration
// gives the shorter iteration. Rounding down alone left VGG-16's first
// fully connected layer (most of the model) on one memory node: 2.85x the
// iteration of the prefix that includes it (docs/results/cluster.md). A
// plan of the proxies alone (m = n) stays 0 layers.
int ChooseRingLayers(const std::vector<uint64_t>& layer_bytes,
                     const DualSyncPlan& plan, int workers, double t_forward,
                     double t_backward, double bw_proxy, double bw_worker,
                     double sharing = 0);
// Predicted iteration time of a given split (for tests and reports).
double PredictIteration(uint64_t total_bytes, uint64_t proxy_bytes, int workers,
                        double t_forward, double t_backward, double bw_proxy,
                        double bw_worker, double sharing = 0);
// `sharing` from three timings of one probe: the ring alone (t_worker), the
// proxies alone (t_proxy) and half of it on each at once (t_both).
// Independent paths take max(t_worker, t_proxy) / 2, one shared bottleneck
// (t_worker + t_proxy) / 2; in between, the fraction of the shorter half
// that was not hidden. Clamped to [0, 1].
double SharingFromProbe(double t_worker, double t_proxy, double t_both);

// The pipelining size for shards whose inbound and outbound copies share
// their bottleneck by `inout_sharing` (SharingFromProbe of a write, a read
// and half of each at once to one proxy). Sharding a node's B bytes into
// shards of b pays about B / b fixed costs of P bytes each and saves the
// (1 - sharing) part of the fill and drain that whole keys pay, so the best
// shard is sqrt(B * P / (1 - sharing)): P / (1 - sharing) here (at most
// P * 1024, where sharding buys nothing: one host's copies, all on the
// same cores and memory bus). P = 0 (unknown) stays 0.
uint64_t PipelineBytesForSharing(uint64_t pipeline_bytes, double inout_sharing);

}  // namespace membox::ps

#endif  // MEMBOX_PS_ROUTING_H_
