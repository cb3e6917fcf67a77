#include "membox/base/copy.h"

#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace membox {
namespace {

std::vector<uint8_t> Pattern(size_t n, uint32_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) {
    seed = seed * 1664525u + 1013904223u;
    v[i] = static_cast<uint8_t>(seed >> 24);
  }
  return v;
}

// Every length around the 64-byte line and every destination/source
// misalignment: the bytes copied are exactly the source's and the bytes
// around the destination range are untouched.
TEST(CopyTest, StreamingCopyMatchesMemcpyAtEveryAlignment) {
  const auto src = Pattern(1024, 7);
  for (size_t n : {0, 1, 15, 63, 64, 65, 127, 128, 129, 200, 511, 700}) {
    for (size_t doff = 0; doff < 64; doff += 5) {
      for (size_t soff = 0; soff < 64; soff += 9) {
        std::vector<uint8_t> dst(1024 + 128, 0xAB);
        StreamingCopy(dst.data() + doff, src.data() + soff, n);
        ASSERT_EQ(0, std::memcmp(dst.data() + doff, src.data() + soff, n))
            << "n=" << n << " doff=" << doff << " soff=" << soff;
        for (size_t i = 0; i < doff; ++i) ASSERT_EQ(dst[i], 0xAB);
        for (size_t i = doff + n; i < dst.size(); ++i) ASSERT_EQ(dst[i], 0xAB);
      }
    }
  }
}

TEST(CopyTest, LargeCopiesOnBothSidesOfTheThreshold) {
  const size_t t = StreamingCopyThreshold();
  ASSERT_GE(t, size_t{4} << 20);
  ASSERT_LE(t, size_t{64} << 20);
  for (size_t n : {t - 3, t, t + 77}) {
    const auto src = Pattern(n + 16, static_cast<uint32_t>(n));
    std::vector<uint8_t> dst(n + 16, 0);
    CopyBytes(dst.data() + 3, src.data() + 5, n);
    ASSERT_EQ(0, std::memcmp(dst.data() + 3, src.data() + 5, n)) << n;
    EXPECT_EQ(dst[0], 0);
    EXPECT_EQ(dst[n + 3], 0);
  }
}

// Set by the edges from MEMBOX_STREAMING_COPY_THRESHOLD; a bad value
// changes nothing. (Runs after the test above, which reads the default.)
TEST(CopyTest, TheThresholdIsSetExplicitly) {
  const size_t before = StreamingCopyThreshold();
  EXPECT_EQ(SetStreamingCopyThreshold("lots").code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(StreamingCopyThreshold(), before);
  ASSERT_TRUE(SetStreamingCopyThreshold("8MiB").ok());
  EXPECT_EQ(StreamingCopyThreshold(), size_t{8} << 20);
  ASSERT_TRUE(SetStreamingCopyThreshold("off").ok());
  EXPECT_EQ(StreamingCopyThreshold(), std::numeric_limits<size_t>::max());
  // Copies stay exact either way.
  const auto src = Pattern(1 << 20, 7);
  std::vector<uint8_t> dst(1 << 20);
  CopyBytes(dst.data(), src.data(), dst.size());
  EXPECT_EQ(0, std::memcmp(dst.data(), src.data(), dst.size()));
  ASSERT_TRUE(SetStreamingCopyThreshold(std::to_string(before)).ok());
  EXPECT_EQ(StreamingCopyThreshold(), before);
}

}  // namespace
}  // namespace membox
