// wire::Crc32: the value every disk and wire format carries is zlib's
// crc32, whatever computes it (files written before ISA-L computed it must
// still read back).
#include "membox/base/wire.h"

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <zlib.h>

namespace membox::wire {
namespace {

uint32_t Zlib(const uint8_t* p, size_t n) {
  return static_cast<uint32_t>(crc32(0L, p, static_cast<uInt>(n)));
}

TEST(WireTest, Crc32IsTheStandardCheckValue) {
  const std::string s = "123456789";
  EXPECT_EQ(Crc32(s.data(), s.size()), 0xCBF43926u);
  EXPECT_EQ(Crc32(nullptr, 0), 0u);
}

// Every length around the switch between the two kernels (32) and the sizes
// the formats use (an SSD record of a 64-wide Adagrad row, a push log
// record), at every alignment.
TEST(WireTest, Crc32IsZlibsAtEveryLengthAndAlignment) {
  std::mt19937 rng(7);
  std::vector<uint8_t> buf(3 << 20);
  for (auto& b : buf) b = static_cast<uint8_t>(rng());
  std::vector<size_t> lengths;
  for (size_t n = 0; n <= 300; ++n) lengths.push_back(n);
  for (size_t n : {511, 512, 513, 540, 544, 4095, 4096, 4097, 65536, 1 << 20,
                   (2 << 20) + 3}) {
    lengths.push_back(n);
  }
  for (size_t n : lengths) {
    for (size_t at = 0; at < 16; ++at) {
      ASSERT_EQ(Crc32(buf.data() + at, n), Zlib(buf.data() + at, n))
          << n << " bytes at offset " << at;
    }
  }
}

TEST(WireTest, Crc32SeesEveryFlippedBit) {
  std::vector<uint8_t> buf(1000, 0x5a);
  const uint32_t want = Crc32(buf.data(), buf.size());
  for (size_t i = 0; i < buf.size(); i += 37) {
    buf[i] ^= 0x10;
    EXPECT_NE(Crc32(buf.data(), buf.size()), want) << "bit flipped at " << i;
    buf[i] ^= 0x10;
  }
  EXPECT_EQ(Crc32(buf.data(), buf.size()), want);
}

}  // namespace
}  // namespace membox::wire
