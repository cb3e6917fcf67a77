// An embedding table of the sparse parameter store (seed 004): rows of
// `dim` floats keyed by 64-bit feature ids, each stored with the state of
// its optimizer right behind it, so a row and its state move between
// memory, SSD and network together.
//
// Row layout (floats): [value: dim][state: StateFloats()]
//   kSgd      no state                     w -= lr * g
//   kAdagrad  accumulator: dim             a += g*g; w -= lr * g / (sqrt(a) +
//   eps) kAdam     m: dim, v: dim, step: 1      per-row step count for the bias
//             correction (a row's moments only advance when it is touched,
//             the "lazy" sparse Adam)
// New rows: values uniform in [-init_scale, init_scale] from a generator
// seeded by (seed, key) -- the same key gets the same row on any node, in
// any run --, state zero (the Adagrad accumulator initial_accumulator).
//
// Thread-safety: plain values and pure functions.
#ifndef MEMBOX_EMBEDDING_TABLE_H_
#define MEMBOX_EMBEDDING_TABLE_H_

#include <cstdint>
#include <span>
#include <string>

#include "membox/base/status.h"

namespace membox::embedding {

enum class RowOptimizer : uint8_t { kSgd = 0, kAdagrad = 1, kAdam = 2 };
const char* RowOptimizerName(RowOptimizer o);
Result<RowOptimizer> ParseRowOptimizer(const std::string& name);

struct TableConfig {
  std::string name;  // [A-Za-z0-9_.-], 1..64 characters, not "." or ".."
  uint32_t dim = 0;  // 1..kMaxDim
  RowOptimizer optimizer = RowOptimizer::kAdagrad;
  double lr = 0.01;
  double eps = 1e-8;
  double beta1 = 0.9, beta2 = 0.999;  // kAdam
  double initial_accumulator = 0.0;   // kAdagrad
  uint64_t seed = 0;
  double init_scale = 0.01;

  static constexpr uint32_t kMaxDim = 4096;
  uint32_t state_floats() const;
  uint32_t row_floats() const { return dim + state_floats(); }
  uint32_t row_bytes() const { return row_floats() * 4; }
  bool operator==(const TableConfig&) const = default;
};

// kInvalidArgument naming the bad field.
Status ValidateTableConfig(const TableConfig& c);
// Fills a new row (value and state) for `key`.
void InitializeRow(const TableConfig& c, uint64_t key, std::span<float> row);
// Applies one gradient (dim floats) to a row (row_floats()).
void ApplyGradient(const TableConfig& c, std::span<float> row,
                   std::span<const float> grad);

}  // namespace membox::embedding

#endif  // MEMBOX_EMBEDDING_TABLE_H_
