// DType: the element types membox moves and sums (tensor metadata, ps keys,
// the reduce kernels, wire buckets). Values are part of wire and disk formats
// (docs/formats/): never renumber.
// Thread-safety: plain values.
#ifndef MEMBOX_BASE_DTYPE_H_
#define MEMBOX_BASE_DTYPE_H_

#include <cstddef>
#include <cstdint>

namespace membox {

enum class DType : uint8_t {
  kFloat32 = 1,
  kFloat64 = 2,
  kFloat16 = 3,
  kBFloat16 = 4,
  kInt32 = 5,
  kInt64 = 6,
  kUInt8 = 7,
};

// Bytes per element; 0 for values that are not a DType.
size_t DTypeSize(DType t);

}  // namespace membox

#endif  // MEMBOX_BASE_DTYPE_H_
