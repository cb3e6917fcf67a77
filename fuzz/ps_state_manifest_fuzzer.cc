// Fuzzes the state-manifest parser (a peer proxy's description of the
// shards a joining or lagging proxy reads from it): accepted input
// satisfies every invariant the copy relies on.
#include <cstdlib>
#include <set>

#include "src/ps/state_copy.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  membox::ps::StateManifest m;
  if (membox::ps::ParseStateManifest({data, size}, &m).ok()) {
    std::set<std::pair<uint64_t, uint32_t>> seen;
    for (const auto& s : m.shards) {
      const uint64_t offset = uint64_t{s.shard} * s.shard_bytes;
      if (s.shard_bytes == 0 || s.shard_bytes > s.key_bytes ||
          offset >= s.key_bytes || s.bytes == 0 ||
          s.bytes != std::min(s.shard_bytes, s.key_bytes - offset) ||
          s.value.length < s.bytes || (s.m1 && s.m1->length < s.bytes) ||
          (s.m2 && (!s.m1 || s.m2->length < s.bytes)) ||
          !seen.insert({s.key, s.shard}).second)
        std::abort();
    }
    std::set<uint64_t> keys;
    for (const auto& k : m.keys) {
      if (k.shard_bytes == 0 || k.shard_bytes > k.key_bytes ||
          !keys.insert(k.key).second)
        std::abort();
    }
    // What parses re-encodes to something that parses the same way.
    membox::ps::StateManifest again;
    if (!membox::ps::ParseStateManifest(membox::ps::EncodeStateManifest(m),
                                        &again)
             .ok() ||
        again.shards.size() != m.shards.size() ||
        again.keys.size() != m.keys.size() || again.proxy_rank != m.proxy_rank)
      std::abort();
  }
  return 0;
}
