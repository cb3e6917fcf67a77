#include "membox/base/wire.h"

#include <bit>

#include <zlib.h>

namespace membox::wire {

static_assert(std::endian::native == std::endian::little,
              "wire formats are little-endian; add byte swaps for this target");

uint32_t Crc32(const void* data, size_t n) {
  return static_cast<uint32_t>(
      crc32(0L, static_cast<const Bytef*>(data), static_cast<uInt>(n)));
}

}  // namespace membox::wire
