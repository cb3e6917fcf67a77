#include "membox/embedding/table.h"

#include <cmath>
#include <vector>

#include <gtest/gtest.h>

namespace membox::embedding {
namespace {

TableConfig Config(RowOptimizer o, uint32_t dim = 4) {
  // Built, not assigned: GCC 12 at -O3 flags assigning a short literal to
  // a std::string (-Wrestrict, GCC bug 105329).
  TableConfig c{.name = "t", .dim = dim, .optimizer = o, .lr = 0.1};
  c.seed = 7;
  return c;
}

TEST(TableTest, RowLayoutPerOptimizer) {
  EXPECT_EQ(Config(RowOptimizer::kSgd, 8).row_floats(), 8u);
  EXPECT_EQ(Config(RowOptimizer::kAdagrad, 8).row_floats(), 16u);
  EXPECT_EQ(Config(RowOptimizer::kAdam, 8).row_floats(), 25u);
  EXPECT_EQ(Config(RowOptimizer::kAdam, 8).row_bytes(), 100u);
}

TEST(TableTest, InitializerIsSeededPerKeyAndBounded) {
  TableConfig c = Config(RowOptimizer::kAdagrad, 16);
  c.initial_accumulator = 0.5;
  std::vector<float> a(c.row_floats()), b(c.row_floats()),
      other(c.row_floats());
  InitializeRow(c, 42, a);
  InitializeRow(c, 42, b);
  InitializeRow(c, 43, other);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, other);
  for (uint32_t i = 0; i < c.dim; ++i) EXPECT_LE(std::fabs(a[i]), c.init_scale);
  for (uint32_t i = c.dim; i < c.row_floats(); ++i) EXPECT_EQ(a[i], 0.5f);
  c.seed = 8;
  InitializeRow(c, 42, b);
  EXPECT_NE(a, b);
}

TEST(TableTest, OptimizersMatchTheirFormulas) {
  const float g = 0.5f;
  std::vector<float> grad(4, g);
  {
    TableConfig c = Config(RowOptimizer::kSgd);
    std::vector<float> row(c.row_floats(), 1.0f);
    ApplyGradient(c, row, grad);
    EXPECT_FLOAT_EQ(row[0], 1.0f - 0.1f * g);
  }
  {
    TableConfig c = Config(RowOptimizer::kAdagrad);
    std::vector<float> row(c.row_floats(), 0.0f);
    row[0] = 1.0f;
    ApplyGradient(c, row, grad);
    ApplyGradient(c, row, grad);
    // a = g^2, then 2 g^2
    float w = 1.0f - 0.1f * g / (std::sqrt(g * g) + 1e-8f);
    w -= 0.1f * g / (std::sqrt(2 * g * g) + 1e-8f);
    EXPECT_NEAR(row[0], w, 1e-6);
    EXPECT_FLOAT_EQ(row[4], 2 * g * g);
  }
  {
    TableConfig c = Config(RowOptimizer::kAdam);
    std::vector<float> row(c.row_floats(), 0.0f);
    ApplyGradient(c, row, grad);
    // First Adam step moves by lr * sign(g) (bias-corrected m/sqrt(v) = 1).
    EXPECT_NEAR(row[0], -0.1f, 1e-5);
    EXPECT_EQ(row[c.row_floats() - 1], 1.0f);  // the row's step count
  }
}

TEST(TableTest, ValidationNamesTheField) {
  TableConfig c = Config(RowOptimizer::kSgd);
  EXPECT_TRUE(ValidateTableConfig(c).ok());
  c.name = "../etc";
  EXPECT_EQ(ValidateTableConfig(c).code(), StatusCode::kInvalidArgument);
  c = Config(RowOptimizer::kSgd, 0);
  EXPECT_NE(ValidateTableConfig(c).message().find("dim"), std::string::npos);
  c = Config(RowOptimizer::kSgd);
  c.lr = -1;
  EXPECT_FALSE(ValidateTableConfig(c).ok());
  c = Config(RowOptimizer::kAdam);
  c.beta2 = 1.0;
  EXPECT_FALSE(ValidateTableConfig(c).ok());
  EXPECT_FALSE(ParseRowOptimizer("rmsprop").ok());
  EXPECT_EQ(*ParseRowOptimizer("adam"), RowOptimizer::kAdam);
}

}  // namespace
}  // namespace membox::embedding
