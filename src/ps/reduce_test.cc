#include "src/ps/reduce.h"

#include <cmath>
#include <random>

#include <gtest/gtest.h>

namespace membox::ps {
namespace {

TEST(ReduceTest, SumIntoAddsInRankOrder) {
  SyncCores cores(2);
  const size_t n = (1 << 20) + 7;
  std::vector<std::vector<float>> in(3, std::vector<float>(n));
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> d(-1, 1);
  for (auto& v : in)
    for (auto& x : v) x = d(rng);
  std::vector<float> out(n);
  SumInto(cores, DType::kFloat32, out.data(),
          {in[0].data(), in[1].data(), in[2].data()}, n * 4);
  for (size_t i = 0; i < n; i += 9973) {
    float want = in[0][i];
    want += in[1][i];
    want += in[2][i];
    ASSERT_EQ(out[i], want) << i;  // bit-exact: same order
  }
  SumInto(cores, DType::kFloat32, out.data(), {}, n * 4);
  EXPECT_EQ(out[5], 0.0f);
}

TEST(ReduceTest, SgdWithMomentumMatchesReference) {
  SyncCores cores(2);
  std::vector<double> w = {1, 2}, g = {0.5, -1}, m = {0, 0};
  OptimizerStep s;
  s.kind = OptimizerStep::kSgd;
  s.lr = 0.1;
  s.momentum = 0.9;
  ApplyOptimizer(cores, DType::kFloat64, s, w.data(), g.data(), m.data(),
                 nullptr, 2);
  EXPECT_DOUBLE_EQ(w[0], 1 - 0.1 * 0.5);
  ApplyOptimizer(cores, DType::kFloat64, s, w.data(), g.data(), m.data(),
                 nullptr, 2);
  EXPECT_DOUBLE_EQ(m[0], 0.9 * 0.5 + 0.5);
  EXPECT_DOUBLE_EQ(w[0], 1 - 0.1 * 0.5 - 0.1 * (0.9 * 0.5 + 0.5));
}

TEST(ReduceTest, AdamFirstStepMovesByLr) {
  SyncCores cores(1);
  std::vector<float> w = {1, 1}, g = {3, -0.01f}, m = {0, 0}, v = {0, 0};
  OptimizerStep s;
  s.kind = OptimizerStep::kAdam;
  s.lr = 0.01;
  s.t = 1;
  ApplyOptimizer(cores, DType::kFloat32, s, w.data(), g.data(), m.data(),
                 v.data(), 2);
  // Bias-corrected first step: w -= lr * sign(g) (up to eps).
  EXPECT_NEAR(w[0], 0.99f, 1e-5);
  EXPECT_NEAR(w[1], 1.01f, 1e-4);
}

TEST(ReduceTest, ScaleAverages) {
  std::vector<float> v = {4, 8};
  ScaleInPlace(DType::kFloat32, v.data(), 2, 0.25);
  EXPECT_EQ(v[0], 1.0f);
  EXPECT_EQ(v[1], 2.0f);
}

}  // namespace
}  // namespace membox::ps
