// The key of a memory-node segment (seed 003's SMB key): 128 bits.
//
// A key names a segment within its creator's principal (base/credential.h):
// two principals may use the same key for different segments, and a key
// never opens another principal's segment (docs/design/network_face.md,
// "Capabilities"). Keys the server chooses (Create with an empty key) are
// drawn from the CSPRNG, so a caller cannot derive one from keys it has
// seen; an application may also choose a key itself, e.g. SegmentKey(4242),
// to rendezvous with its own processes. The text form is 32 lowercase hex
// digits, hi word first (what `membox status` prints and Parse reads).
// Thread-safety: a value type.
#ifndef MEMBOX_MEMSERVER_SEGMENT_KEY_H_
#define MEMBOX_MEMSERVER_SEGMENT_KEY_H_

#include <compare>
#include <cstdint>
#include <string>
#include <string_view>

#include "membox/base/status.h"

namespace membox::memserver {

struct SegmentKey {
  uint64_t hi = 0;
  uint64_t lo = 0;

  constexpr SegmentKey() = default;
  // An application-chosen key with `lo_bits` in its low 64 bits (0: the
  // empty key, "let the server choose" in Create).
  constexpr SegmentKey(uint64_t lo_bits) : lo(lo_bits) {}  // NOLINT: implicit
  constexpr SegmentKey(uint64_t hi_bits, uint64_t lo_bits)
      : hi(hi_bits), lo(lo_bits) {}

  // 128 bits from the CSPRNG (never empty).
  static SegmentKey Random();
  // Exactly 32 hex digits (either case); kInvalidArgument otherwise.
  static Result<SegmentKey> Parse(std::string_view text);

  bool empty() const { return hi == 0 && lo == 0; }
  std::string ToString() const;
  friend auto operator<=>(const SegmentKey&, const SegmentKey&) = default;
};

}  // namespace membox::memserver

#endif  // MEMBOX_MEMSERVER_SEGMENT_KEY_H_
