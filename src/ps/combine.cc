#include "src/ps/combine.h"

#include <atomic>
#include <cstring>
#include <string>

#include "membox/base/wait.h"

#include "src/ps/reduce.h"

namespace membox::ps {
namespace {

constexpr uint64_t kMagic = 0x31424d4f43584d42ull;  // "BMXCOMB1", little end
constexpr uint32_t kFormat = 1;
constexpr uint64_t kLine = 64;
// Header line: magic, format, world, bytes, dtype, average.
constexpr uint64_t kAbortOffset = kLine;
// The doorbell (an epoch every publish bumps) and its sleepers count, on the
// abort word's line: a SharedEventCount (base/wait.h).
constexpr uint64_t kBellOffset = kLine + 8;
constexpr uint64_t kBellSleepersOffset = kLine + 12;
constexpr uint64_t kSeqOffset = 2 * kLine;

struct Header {
  uint64_t magic;
  uint32_t format;
  uint32_t world;
  uint64_t bytes;
  uint8_t dtype;
  uint8_t average;
};
static_assert(sizeof(Header) <= kLine);

uint64_t SlotsOffset(uint32_t world) { return kSeqOffset + world * kLine; }

uint64_t* SeqWord(uint8_t* base, uint32_t rank) {
  return reinterpret_cast<uint64_t*>(base + kSeqOffset + rank * kLine);
}

uint64_t LoadSeq(uint8_t* base, uint32_t rank) {
  return std::atomic_ref<uint64_t>(*SeqWord(base, rank))
      .load(std::memory_order_acquire);
}

uint32_t* AbortWord(uint8_t* base) {
  return reinterpret_cast<uint32_t*>(base + kAbortOffset);
}

SharedEventCount Bell(uint8_t* base) {
  return SharedEventCount(
      reinterpret_cast<uint32_t*>(base + kBellOffset),
      reinterpret_cast<uint32_t*>(base + kBellSleepersOffset));
}

uint8_t* Slot(uint8_t* base, const CombineGeometry& g, uint64_t round,
              uint32_t rank) {
  return base + SlotsOffset(g.world) +
         ((round & 1) * g.world + rank) * g.slot_stride();
}

// Sum (average) of bank `round % 2` in rank order.
void SumBank(uint8_t* base, const CombineGeometry& g, uint64_t round,
             void* out) {
  std::vector<const void*> srcs(g.world);
  for (uint32_t i = 0; i < g.world; ++i) srcs[i] = Slot(base, g, round, i);
  SumInto(g.dtype, out, srcs, g.bytes,
          g.average && g.world > 1 ? 1.0 / g.world : 1.0);
}

}  // namespace

uint64_t CombineGeometry::region_bytes() const {
  return SlotsOffset(world) + 2 * uint64_t{world} * slot_stride();
}

void InitCombineRegion(void* base, const CombineGeometry& g) {
  auto* b = static_cast<uint8_t*>(base);
  std::memset(b, 0, SlotsOffset(g.world));
  Header h{};
  h.magic = kMagic;
  h.format = kFormat;
  h.world = g.world;
  h.bytes = g.bytes;
  h.dtype = static_cast<uint8_t>(g.dtype);
  h.average = g.average ? 1 : 0;
  std::memcpy(b, &h, sizeof h);
  std::atomic_thread_fence(std::memory_order_release);
}

Result<CombineGeometry> ParseCombineRegion(const void* base,
                                           uint64_t region_bytes,
                                           uint32_t world, uint64_t bytes,
                                           DType dtype) {
  if (reinterpret_cast<uintptr_t>(base) % kLine != 0) {
    return DataLossError("combining region is not 64-byte aligned");
  }
  if (world == 0 || world > kMaxCombineWorld || bytes == 0 ||
      bytes > kMaxCombineBytes || DTypeSize(dtype) == 0 ||
      bytes % DTypeSize(dtype) != 0) {
    return InvalidArgumentError("no combining for world " +
                                std::to_string(world) + " and " +
                                std::to_string(bytes) + " bytes");
  }
  if (region_bytes < kSeqOffset) {
    return DataLossError("combining region of " + std::to_string(region_bytes) +
                         " bytes: too short");
  }
  Header h;
  std::memcpy(&h, base, sizeof h);
  if (h.magic != kMagic || h.format != kFormat) {
    return DataLossError("combining region: bad magic or format");
  }
  if (h.world != world || h.bytes != bytes ||
      h.dtype != static_cast<uint8_t>(dtype) || h.average > 1) {
    return DataLossError(
        "combining region is for world " + std::to_string(h.world) + ", " +
        std::to_string(h.bytes) + " bytes, dtype " + std::to_string(h.dtype) +
        "; this worker has world " + std::to_string(world) + ", " +
        std::to_string(bytes) + " bytes, dtype " +
        std::to_string(static_cast<int>(dtype)));
  }
  CombineGeometry g;
  g.world = h.world;
  g.bytes = h.bytes;
  g.dtype = dtype;
  g.average = h.average == 1;
  if (g.region_bytes() > region_bytes) {
    return DataLossError("combining region of " + std::to_string(region_bytes) +
                         " bytes cannot hold " +
                         std::to_string(g.region_bytes()));
  }
  return g;
}

void AbortCombineRegion(void* base, uint32_t rank) {
  auto* b = static_cast<uint8_t*>(base);
  std::atomic_ref<uint32_t>(*AbortWord(b))
      .store(rank + 1, std::memory_order_release);
  Bell(b).Notify();  // sleepers see the abort now, not at their timeout
}

Result<uint64_t> FoldCombineRegion(const void* base, const CombineGeometry& g,
                                   uint64_t first, void* out) {
  auto* b = const_cast<uint8_t*>(static_cast<const uint8_t*>(base));
  uint64_t lo = UINT64_MAX;
  for (uint32_t i = 0; i < g.world; ++i) lo = std::min(lo, LoadSeq(b, i));
  if (lo == UINT64_MAX || lo == 0) return uint64_t{0};
  if (lo >= first) SumBank(b, g, lo, out);
  return lo;
}

bool CombineView::CanPublish(uint64_t round) const {
  return round <= first_ || Arrived(round - 1);
}

void CombineView::Publish(uint64_t round, const void* in) {
  std::memcpy(Slot(base_, g_, round, rank_), in, g_.bytes);
  std::atomic_ref<uint64_t>(*SeqWord(base_, rank_))
      .store(round, std::memory_order_release);
  Bell(base_).Notify();
}

uint32_t CombineView::bell() const { return Bell(base_).epoch(); }

bool CombineView::WaitForBell(uint32_t seen,
                              std::chrono::nanoseconds timeout) const {
  return Bell(base_).WaitFor(seen, timeout);
}

bool CombineView::Arrived(uint64_t round) const {
  for (uint32_t i = 0; i < g_.world; ++i) {
    if (LoadSeq(base_, i) < round) return false;
  }
  return true;
}

void CombineView::Reduce(uint64_t round, void* out) const {
  SumBank(base_, g_, round, out);
}

std::optional<uint32_t> CombineView::Aborted() const {
  uint32_t a = std::atomic_ref<uint32_t>(*AbortWord(base_))
                   .load(std::memory_order_acquire);
  if (a == 0) return std::nullopt;
  return a - 1;
}

std::vector<uint32_t> CombineView::Missing(uint64_t round) const {
  std::vector<uint32_t> out;
  for (uint32_t i = 0; i < g_.world; ++i) {
    if (LoadSeq(base_, i) < round) out.push_back(i);
  }
  return out;
}

}  // namespace membox::ps
