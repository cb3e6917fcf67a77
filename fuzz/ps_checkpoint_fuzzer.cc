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
      if (s.owned_value.empty() || s.owned_value.size() > s.key_bytes ||
          (!s.owned_m1.empty() && s.owned_m1.size() != s.owned_value.size()) ||
          (!s.owned_m2.empty() && s.owned_m2.size() != s.owned_value.size()))
        std::abort();
    }
  }
  return 0;
}
