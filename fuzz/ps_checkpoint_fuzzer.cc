// Fuzzes the checkpoint parser (files on disk are untrusted: a crash, a bad
// disk or a wrong file): accepted input satisfies every invariant the
// restore path relies on.
#include <cstdlib>

#include "src/ps/checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  membox::ps::CheckpointHeader h;
  std::vector<membox::ps::CheckpointShard> shards;
  if (membox::ps::ParseCheckpoint({data, size}, &h, &shards).ok()) {
    if (h.proxy_rank >= h.proxies) std::abort();
    for (const auto& s : shards) {
      // The views lie inside the input.
      auto inside = [&](std::span<const uint8_t> v) {
        return v.empty() ||
               (v.data() >= data && v.data() + v.size() <= data + size);
      };
      if (s.value_stale) {  // its version alone: no bytes at all
        if (!s.value.empty() || !s.m1.empty() || !s.m2.empty()) std::abort();
        continue;
      }
      if (s.value.empty() || s.value.size() > s.key_bytes ||
          (!s.m1.empty() && s.m1.size() != s.value.size()) ||
          (!s.m2.empty() && s.m2.size() != s.value.size()) ||
          !inside(s.value) || !inside(s.m1) || !inside(s.m2))
        std::abort();
    }
  }
  return 0;
}
