#include "membox/embedding/table.h"

#include <cmath>

#include "membox/base/credential.h"

#include "src/embedding/splitmix.h"

namespace membox::embedding {
namespace {

// A table's own name: a file name in the node's directory that cannot be
// hidden, be the push log's, or hold a NUL or separator.
bool ValidName(const std::string& n) {
  if (n.empty() || n.size() > 64 || n[0] == '.' || n == "PUSHLOG") {
    return false;
  }
  for (char ch : n) {
    bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
              (ch >= '0' && ch <= '9') || ch == '_' || ch == '.' || ch == '-';
    if (!ok) return false;
  }
  return true;
}

// "name" (the cluster's) or "name@principal" (a credential's namespace).
bool ValidQualifiedName(const std::string& n) {
  size_t at = n.find('@');
  if (at == std::string::npos) return ValidName(n);
  return ValidName(n.substr(0, at)) &&
         ValidatePrincipalName(n.substr(at + 1)).ok();
}

}  // namespace

const char* RowOptimizerName(RowOptimizer o) {
  switch (o) {
    case RowOptimizer::kSgd:
      return "sgd";
    case RowOptimizer::kAdagrad:
      return "adagrad";
    case RowOptimizer::kAdam:
      return "adam";
  }
  return "?";
}

Result<RowOptimizer> ParseRowOptimizer(const std::string& name) {
  if (name == "sgd") return RowOptimizer::kSgd;
  if (name == "adagrad") return RowOptimizer::kAdagrad;
  if (name == "adam") return RowOptimizer::kAdam;
  return InvalidArgumentError("unknown embedding optimizer '" + name +
                              "' (sgd, adagrad, adam)");
}

uint32_t TableConfig::state_floats() const {
  switch (optimizer) {
    case RowOptimizer::kSgd:
      return 0;
    case RowOptimizer::kAdagrad:
      return dim;
    case RowOptimizer::kAdam:
      return 2 * dim + 1;
  }
  return 0;
}

Status ValidateTableConfig(const TableConfig& c) {
  if (!ValidQualifiedName(c.name)) {
    return InvalidArgumentError(
        "bad table name '" + c.name.substr(0, 80) +
        "' (1-64 of A-Z a-z 0-9 _ . -, not starting with '.', not PUSHLOG)");
  }
  if (c.dim == 0 || c.dim > TableConfig::kMaxDim) {
    return InvalidArgumentError("table dim must be in 1.." +
                                std::to_string(TableConfig::kMaxDim));
  }
  if (static_cast<uint8_t>(c.optimizer) > 2) {
    return InvalidArgumentError("unknown embedding optimizer");
  }
  auto finite_pos = [](double v) { return std::isfinite(v) && v >= 0; };
  if (!finite_pos(c.lr) || !finite_pos(c.eps) ||
      !finite_pos(c.initial_accumulator) || !finite_pos(c.init_scale)) {
    return InvalidArgumentError(
        "lr, eps, initial_accumulator and init_scale must be finite and >= 0");
  }
  if (!(c.beta1 >= 0 && c.beta1 < 1 && c.beta2 >= 0 && c.beta2 < 1)) {
    return InvalidArgumentError("beta1 and beta2 must be in [0, 1)");
  }
  return Status::Ok();
}

void InitializeRow(const TableConfig& c, uint64_t key, std::span<float> row) {
  uint64_t state = c.seed * 0x2545F4914F6CDD1Dull ^ key;
  for (uint32_t i = 0; i < c.dim; ++i) {
    double u = (SplitMix64(state) >> 11) * 0x1.0p-53;  // [0, 1)
    row[i] = static_cast<float>((2 * u - 1) * c.init_scale);
  }
  for (size_t i = c.dim; i < row.size(); ++i) row[i] = 0;
  if (c.optimizer == RowOptimizer::kAdagrad) {
    for (uint32_t i = 0; i < c.dim; ++i) {
      row[c.dim + i] = static_cast<float>(c.initial_accumulator);
    }
  }
}

void ApplyGradient(const TableConfig& c, std::span<float> row,
                   std::span<const float> grad) {
  const uint32_t d = c.dim;
  float* w = row.data();
  const float* g = grad.data();
  const float lr = static_cast<float>(c.lr);
  const float eps = static_cast<float>(c.eps);
  switch (c.optimizer) {
    case RowOptimizer::kSgd:
      for (uint32_t i = 0; i < d; ++i) w[i] -= lr * g[i];
      break;
    case RowOptimizer::kAdagrad: {
      float* a = w + d;
      for (uint32_t i = 0; i < d; ++i) {
        a[i] += g[i] * g[i];
        w[i] -= lr * g[i] / (std::sqrt(a[i]) + eps);
      }
      break;
    }
    case RowOptimizer::kAdam: {
      float* m = w + d;
      float* v = m + d;
      float& t = v[d];
      t += 1;
      const double b1 = c.beta1, b2 = c.beta2;
      const float c1 = static_cast<float>(1 - std::pow(b1, t));
      const float c2 = static_cast<float>(1 - std::pow(b2, t));
      const float fb1 = static_cast<float>(b1), fb2 = static_cast<float>(b2);
      for (uint32_t i = 0; i < d; ++i) {
        m[i] = fb1 * m[i] + (1 - fb1) * g[i];
        v[i] = fb2 * v[i] + (1 - fb2) * g[i] * g[i];
        w[i] -= lr * (m[i] / c1) / (std::sqrt(v[i] / c2) + eps);
      }
      break;
    }
  }
}

}  // namespace membox::embedding
