// SplitMix64: the 64-bit generator / mixer the embedding layer uses for
// seeded row initialisation and for hashing keys to nodes.
// Thread-safety: pure function of its argument.
#ifndef MEMBOX_SRC_EMBEDDING_SPLITMIX_H_
#define MEMBOX_SRC_EMBEDDING_SPLITMIX_H_

#include <cstdint>

namespace membox::embedding {

// Advances `state` and returns the next value of its sequence.
inline uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace membox::embedding

#endif  // MEMBOX_SRC_EMBEDDING_SPLITMIX_H_
