// Fuzzes the check a worker makes of a combining region a memory node
// offers (src/ps/combine.h): what it accepts is safe to combine in --
// every rank's sequence word and slot lies inside the region, whatever the
// sequence words say.
// Input: world u32, bytes u64, dtype u8 (what the worker declared), then
// the region's bytes.
#include <cstdlib>
#include <cstring>
#include <vector>

#include "src/ps/combine.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  constexpr size_t kHead = 4 + 8 + 1;
  if (size < kHead || size > (1u << 20)) return 0;
  uint32_t world;
  uint64_t bytes;
  std::memcpy(&world, data, 4);
  std::memcpy(&bytes, data + 4, 8);
  auto dtype = static_cast<membox::DType>(data[12]);
  const size_t n = size - kHead;
  // The region as a node's pool hands it out: aligned.
  auto* region =
      static_cast<uint8_t*>(std::aligned_alloc(64, (n + 64) & ~size_t{63}));
  std::memcpy(region, data + kHead, n);
  auto g = membox::ps::ParseCombineRegion(region, n, world, bytes, dtype);
  if (g.ok()) {
    if (g->region_bytes() > n || g->world != world || g->bytes != bytes)
      std::abort();
    for (uint32_t rank : {0u, world - 1}) {
      membox::ps::CombineView v(region, *g, rank, 1);
      (void)v.Aborted();
      (void)v.Missing(2);
      if (v.Arrived(1)) {
        std::vector<uint8_t> out(bytes);
        v.Reduce(1, out.data());
      }
    }
    std::vector<uint8_t> out(bytes);
    (void)membox::ps::FoldCombineRegion(region, *g, 1, out.data());
  }
  std::free(region);
  return 0;
}
