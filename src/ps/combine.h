// In-memory combining of small keys (seed 000 COARSE §III.C's LatProxy path,
// on memory the workers reach by load and store): a region in the memory
// node's pool where every worker of the job leaves its contribution to a
// round and sums everybody's itself, so a round of a small tensor needs no
// message and no wake-up of the node -- the node only owns the memory.
//
// The proxy offers a region for a key (kCombine) when every worker of the
// job maps its memory (same host: shared memory, or a CXL pool), the key is
// one shard (with several nodes: a striped one, on its owner -- its home
// node; replication does not matter, the results are in the workers'
// memory when answered), is summed or averaged
// without an optimizer, and is at most kMaxCombineBytes. docs/design/ps.md
// ("In-memory combining") has the reasoning.
//
// Layout (docs/formats/ps_combine_region.md): a 64-byte header, a line with
// the abort word, one 64-byte line per rank with the last round it
// published, then two banks (round parity) of one slot per rank.
//
// Round r of rank i: copy the input into slot [r % 2][i] and store
// seq[i] = r (release); once every seq >= r (acquire), sum the slots of bank
// r % 2 in rank order (so every worker computes bit-identical results, the
// same arithmetic as the proxy's LocalSum) and scale for averages. Writing
// bank r % 2 again (round r + 2) overwrites round r's slots; a rank starts
// round r + 2 only after every seq >= r + 1, and a rank that published
// r + 1 has finished reading round r, so nobody reads a slot being
// overwritten. A rank may publish round r once every seq >= r - 1 (the
// same argument one round earlier); CanPublish says when.
//
// Failure: the proxy stores rank + 1 in the abort word when a worker of the
// job disconnects; waiters see it and fail naming that rank.
//
// Waking: every publish (and the abort) rings the region's doorbell, a
// SharedEventCount (base/wait.h) on the abort word's line, so a rank whose
// operation waits for the others sleeps in the kernel until one of them
// publishes (a shared futex: same host; where the region is not on this
// host's memory the sleeper's timeout is its poll).
//
// Thread-safety: a CombineView is used by one thread at a time (the param
// client serialises a key's operations), except bell() and WaitForBell(),
// which any thread may call meanwhile; the region itself is shared
// between processes through atomics on its words.
#ifndef MEMBOX_SRC_PS_COMBINE_H_
#define MEMBOX_SRC_PS_COMBINE_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "membox/base/dtype.h"
#include "membox/base/status.h"

namespace membox::ps {

// Keys above these sizes go through the proxy: combining makes every worker
// read every contribution (world * bytes each, world^2 * bytes in all),
// which only pays while latency, not bandwidth, decides a round. Measured
// on 2 cores (docs/results/allreduce.md): combining won up to 512 KiB of
// contributions per round (p = 2: 256 KiB keys, 4: 128 KiB, 8: 64 KiB) and
// lost from 1 MiB at p = 8.
constexpr uint64_t kMaxCombineBytes = 256 << 10;
constexpr uint64_t kMaxCombineRoundBytes = 512 << 10;  // world * bytes
constexpr uint32_t kMaxCombineWorld = 4096;            // proto::kMaxWorld

// Whether a key of `bytes` in a job of `world` workers is small enough to
// combine (the two bounds above): the one place for the size rule, which
// the proxy applies when it decides and the client when it gives such a
// key one home node (docs/design/ps.md, "In-memory combining").
constexpr bool CombineSizeFits(uint64_t bytes, uint32_t world) {
  return bytes <= kMaxCombineBytes && bytes * world <= kMaxCombineRoundBytes;
}

struct CombineGeometry {
  uint32_t world = 0;
  uint64_t bytes = 0;  // the tensor
  DType dtype = DType::kFloat32;
  bool average = false;
  uint64_t slot_stride() const { return (bytes + 63) & ~uint64_t{63}; }
  // The whole region.
  uint64_t region_bytes() const;
};

// Writes an empty region's header (every seq 0, no abort). `base` is 64-byte
// aligned and holds g.region_bytes().
void InitCombineRegion(void* base, const CombineGeometry& g);

// Reads and checks a region's header against what the worker declared:
// alignment, magic, format, world, size, dtype and the region's length.
// fuzz/ps_combine_region_fuzzer.cc drives it. The proxy is
// authenticated, but its bytes cross a process boundary all the same.
Result<CombineGeometry> ParseCombineRegion(const void* base,
                                           uint64_t region_bytes,
                                           uint32_t world, uint64_t bytes,
                                           DType dtype);

// The proxy's side: worker `rank` left; every waiter fails naming it.
void AbortCombineRegion(void* base, uint32_t rank);

// The newest round every rank has published (0: none), and its sum in
// `out` when it is >= `first` (the proxy folds it into its storage once
// nobody uses the region any more). Only valid while no rank writes.
Result<uint64_t> FoldCombineRegion(const void* base, const CombineGeometry& g,
                                   uint64_t first, void* out);

class CombineView {
 public:
  // `first`: the first round combined (the proxy's answer; >= 1).
  CombineView(void* base, const CombineGeometry& g, uint32_t rank,
              uint64_t first)
      : base_(static_cast<uint8_t*>(base)), g_(g), rank_(rank), first_(first) {}

  const CombineGeometry& geometry() const { return g_; }
  // The first combined round, or every rank has published round - 1 (so
  // bank round % 2 is free).
  bool CanPublish(uint64_t round) const;
  // Copies this rank's contribution to `round` and publishes it.
  void Publish(uint64_t round, const void* in);
  // Every rank has published `round`.
  bool Arrived(uint64_t round) const;
  // out <- the round's sum (average) in rank order. Arrived(round) first.
  void Reduce(uint64_t round, void* out) const;
  // The rank that left the job, if one did.
  std::optional<uint32_t> Aborted() const;
  // Ranks that have not published `round` yet.
  std::vector<uint32_t> Missing(uint64_t round) const;
  // The doorbell: read bell(), check the condition, then WaitForBell(seen)
  // sleeps until a rank publishes (or the abort), at most `timeout`;
  // spurious returns happen. True when the bell has rung since `seen`.
  uint32_t bell() const;
  bool WaitForBell(uint32_t seen, std::chrono::nanoseconds timeout) const;

 private:
  uint8_t* base_;
  CombineGeometry g_;
  uint32_t rank_;
  uint64_t first_;
};

}  // namespace membox::ps

#endif  // MEMBOX_SRC_PS_COMBINE_H_
