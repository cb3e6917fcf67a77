#include "membox/base/wire.h"

#include <bit>

#include <isa-l/crc.h>
#include <zlib.h>

namespace membox::wire {

static_assert(std::endian::native == std::endian::little,
              "wire formats are little-endian; add byte swaps for this target");

uint32_t Crc32(const void* data, size_t n) {
  // The same value either way (wire_test checks); below 32 bytes (a file
  // header) zlib's table is faster than ISA-L's dispatch.
  if (n < 32) {
    return static_cast<uint32_t>(
        crc32(0L, static_cast<const Bytef*>(data), static_cast<uInt>(n)));
  }
  return crc32_gzip_refl(0, static_cast<const unsigned char*>(data), n);
}

}  // namespace membox::wire
