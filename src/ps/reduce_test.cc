#include "src/ps/reduce.h"

#include <cmath>
#include <cstring>
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

// Two steps of each optimizer against torch.optim's update written out in
// double precision (weight decay included).
TEST(ReduceTest, OptimizersMatchTorchsUpdates) {
  SyncCores cores(2);
  const double lr = 0.1, wd = 0.05, b1 = 0.9, b2 = 0.99, eps = 1e-8;
  const double g1 = 0.5, g2 = -0.25;
  struct Case {
    OptimizerStep::Kind kind;
    double want;  // w after two steps from w = 1
  };
  // SGD, momentum 0.9, L2 decay.
  double w = 1, buf = 0;
  for (double g : {g1, g2}) {
    double gi = g + wd * w;
    buf = 0.9 * buf + gi;
    w -= lr * buf;
  }
  const double sgd = w;
  // Adam (L2) and AdamW (decoupled) share the moments' arithmetic.
  auto adam = [&](bool decoupled) {
    double w = 1, m = 0, v = 0;
    int t = 0;
    for (double g : {g1, g2}) {
      ++t;
      double gi = decoupled ? g : g + wd * w;
      if (decoupled) w *= 1 - lr * wd;
      m = b1 * m + (1 - b1) * gi;
      v = b2 * v + (1 - b2) * gi * gi;
      double denom = std::sqrt(v) / std::sqrt(1 - std::pow(b2, t)) + eps;
      w -= lr / (1 - std::pow(b1, t)) * m / denom;
    }
    return w;
  };
  w = 1;
  double sum = 0;
  for (double g : {g1, g2}) {
    double gi = g + wd * w;
    sum += gi * gi;
    w -= lr * gi / (std::sqrt(sum) + eps);
  }
  const double adagrad = w;
  for (Case c :
       {Case{OptimizerStep::kSgd, sgd}, Case{OptimizerStep::kAdam, adam(false)},
        Case{OptimizerStep::kAdamW, adam(true)},
        Case{OptimizerStep::kAdagrad, adagrad}}) {
    std::vector<double> wv = {1}, m = {0}, v = {0};
    OptimizerStep s;
    s.kind = c.kind;
    s.lr = lr;
    s.momentum = 0.9;
    s.beta1 = b1;
    s.beta2 = b2;
    s.eps = eps;
    s.weight_decay = wd;
    for (double g : {g1, g2}) {
      ApplyOptimizer(cores, DType::kFloat64, s, wv.data(), &g, m.data(),
                     v.data(), 1);
      ++s.t;
    }
    EXPECT_NEAR(wv[0], c.want, 1e-12) << c.kind;
  }
}

TEST(ReduceTest, SumIntoScalesInTheSamePass) {
  // float32: the sum, then the scale, exactly as two passes would give.
  SyncCores cores(2);
  const size_t n = (1 << 20) + 5;
  std::vector<std::vector<float>> in(3, std::vector<float>(n));
  std::mt19937 rng(2);
  std::uniform_real_distribution<float> d(-1, 1);
  for (auto& v : in)
    for (auto& x : v) x = d(rng);
  std::vector<float> out(n), want(n);
  std::vector<const void*> srcs = {in[0].data(), in[1].data(), in[2].data()};
  SumInto(cores, DType::kFloat32, out.data(), srcs, n * 4, 1.0 / 3);
  SumInto(DType::kFloat32, want.data(), srcs, n * 4);
  ScaleInPlace(cores, DType::kFloat32, want.data(), n, 1.0 / 3);
  for (size_t i = 0; i < n; i += 7919) ASSERT_EQ(out[i], want[i]) << i;
  ASSERT_EQ(out[n - 1], want[n - 1]);
}

TEST(ReduceTest, SumIntoCopiesTheResultInTheSamePass) {
  // The copies get the result, bit for bit, for a whole-number-of-blocks
  // size and a ragged one, float32 and bfloat16, and a copy may be one of
  // the sources (an in-place push and pull): each block is read before it
  // is overwritten.
  SyncCores cores(2);
  for (size_t n : {size_t{1} << 18, (size_t{5} << 18) + 3}) {
    for (DType t : {DType::kFloat32, DType::kBFloat16}) {
      const size_t es = DTypeSize(t), bytes = n * es;
      std::mt19937 rng(static_cast<unsigned>(n));
      std::vector<std::vector<uint8_t>> in(2, std::vector<uint8_t>(bytes));
      for (auto& v : in) {
        for (size_t i = 0; i < n; ++i) {
          float x = std::uniform_real_distribution<float>(-2, 2)(rng);
          if (t == DType::kFloat32) {
            std::memcpy(&v[i * 4], &x, 4);
          } else {
            NarrowFromFloat(t, &x, &v[i * 2], 1);
          }
        }
      }
      std::vector<uint8_t> want(bytes), out(bytes), copy(bytes);
      SumInto(t, want.data(), {in[0].data(), in[1].data()}, bytes, 0.5);
      std::vector<uint8_t> aliased = in[1];
      SumInto(cores, t, out.data(), {in[0].data(), aliased.data()}, bytes, 0.5,
              {copy.data(), aliased.data()});
      ASSERT_EQ(out, want) << n << " " << static_cast<int>(t);
      ASSERT_EQ(copy, want) << n << " " << static_cast<int>(t);
      ASSERT_EQ(aliased, want) << n << " " << static_cast<int>(t);
    }
  }
  // No sources: zeros everywhere.
  std::vector<float> z(100, 1.f), zc(100, 1.f);
  SumInto(cores, DType::kFloat32, z.data(), {}, 400, 1.0, {zc.data()});
  EXPECT_EQ(z, std::vector<float>(100, 0.f));
  EXPECT_EQ(zc, std::vector<float>(100, 0.f));
}

TEST(ReduceTest, HalfAveragesRoundOnce) {
  // bfloat16 and float16: (a + b + c) / 3 computed in float32 and rounded
  // once, for every element (the vector and the scalar tails alike).
  SyncCores cores(2);
  for (DType t : {DType::kBFloat16, DType::kFloat16}) {
    const size_t n = (300 << 10) + 3;
    std::vector<std::vector<uint16_t>> in(3, std::vector<uint16_t>(n));
    std::vector<std::vector<float>> wide(3, std::vector<float>(n));
    std::mt19937 rng(3);
    std::uniform_real_distribution<float> d(-4, 4);
    for (int k = 0; k < 3; ++k) {
      for (size_t i = 0; i < n; ++i) {
        float x = d(rng);
        NarrowFromFloat(t, &x, &in[k][i], 1);
        WidenToFloat(t, &in[k][i], &wide[k][i], 1);
      }
    }
    std::vector<uint16_t> out(n);
    SumInto(cores, t, out.data(), {in[0].data(), in[1].data(), in[2].data()},
            n * 2, 1.0 / 3);
    for (size_t i = 0; i < n; ++i) {
      float sum = wide[0][i];
      sum += wide[1][i];
      sum += wide[2][i];
      float avg = sum * static_cast<float>(1.0 / 3);
      uint16_t want;
      NarrowFromFloat(t, &avg, &want, 1);
      ASSERT_EQ(out[i], want) << "dtype " << static_cast<int>(t) << " at " << i;
    }
  }
}

TEST(ReduceTest, ScaleAverages) {
  std::vector<float> v = {4, 8};
  ScaleInPlace(DType::kFloat32, v.data(), 2, 0.25);
  EXPECT_EQ(v[0], 1.0f);
  EXPECT_EQ(v[1], 2.0f);
  // Over the sync cores, and half types through float32.
  SyncCores cores(2);
  std::vector<uint16_t> h(1 << 20);
  float three = 3.0f, x;
  NarrowFromFloat(DType::kBFloat16, &three, &h[0], 1);
  for (auto& e : h) e = h[0];
  ScaleInPlace(cores, DType::kBFloat16, h.data(), h.size(), 0.5);
  for (size_t i = 0; i < h.size(); i += 4099) {
    WidenToFloat(DType::kBFloat16, &h[i], &x, 1);
    ASSERT_EQ(x, 1.5f) << i;
  }
}

}  // namespace
}  // namespace membox::ps
