#include "membox/base/accumulate.h"

#include <cmath>
#include <cstring>
#include <random>

#include <gtest/gtest.h>

namespace membox {
namespace {

uint16_t ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}
float FromBf16(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

TEST(AccumulateTest, Float32AndFloat64WithScale) {
  std::vector<float> d(1001), s(1001);
  std::vector<double> dd(1001), sd(1001);
  for (size_t i = 0; i < d.size(); ++i) {
    d[i] = static_cast<float>(i);
    s[i] = 0.5f * static_cast<float>(i);
    dd[i] = static_cast<double>(i);
    sd[i] = 0.25 * static_cast<double>(i);
  }
  AccumulateKernel(DType::kFloat32, d.data(), s.data(), d.size(), 1.0);
  AccumulateKernel(DType::kFloat64, dd.data(), sd.data(), dd.size(), 2.0);
  for (size_t i = 0; i < d.size(); ++i) {
    EXPECT_FLOAT_EQ(d[i], 1.5f * static_cast<float>(i));
    EXPECT_DOUBLE_EQ(dd[i], 1.5 * static_cast<double>(i));
  }
}

TEST(AccumulateTest, HalfPrecisionMatchesReference) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-100, 100);
  const size_t n = 1003;
  std::vector<uint16_t> bd(n), bs(n), hd(n), hs(n);
  std::vector<float> ref_b(n), ref_h(n);
  for (size_t i = 0; i < n; ++i) {
    bd[i] = ToBf16(u(rng));
    bs[i] = ToBf16(u(rng));
    ref_b[i] = FromBf16(bd[i]) + FromBf16(bs[i]);
  }
  AccumulateKernel(DType::kBFloat16, bd.data(), bs.data(), n, 1.0);
  for (size_t i = 0; i < n; ++i) {
    EXPECT_NEAR(FromBf16(bd[i]), ref_b[i], std::fabs(ref_b[i]) / 128 + 1e-3)
        << i;
  }
  // fp16: 1.0 = 0x3c00, 2.0 = 0x4000, 0.5 = 0x3800, -3.0 = 0xc200.
  for (size_t i = 0; i < n; ++i) {
    hd[i] = 0x3c00;
    hs[i] = (i % 2) ? 0x3800 : 0xc200;
  }
  AccumulateKernel(DType::kFloat16, hd.data(), hs.data(), n, 1.0);
  for (size_t i = 0; i < n; ++i) {
    EXPECT_EQ(hd[i], (i % 2) ? 0x3e00 : 0xc000) << i;  // 1.5 or -2.0
  }
}

TEST(AccumulateTest, SyncCoresSplitLargeVectors) {
  SyncCores cores(3);
  const size_t n = 3 << 20;
  std::vector<float> d(n, 1.0f), s(n, 2.0f);
  cores.Run(DType::kFloat32, d.data(), s.data(), n, 0.5);
  for (size_t i = 0; i < n; i += 4099) ASSERT_FLOAT_EQ(d[i], 2.0f);
  ASSERT_FLOAT_EQ(d[n - 1], 2.0f);
  EXPECT_TRUE(AccumulateSupports(DType::kBFloat16));
  EXPECT_FALSE(AccumulateSupports(DType::kInt32));
}

}  // namespace
}  // namespace membox
