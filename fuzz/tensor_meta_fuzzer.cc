// Fuzzes TensorMeta::Decode: accepted metadata is always self-consistent.
#include <cstdlib>

#include "membox/transport/tensor_transfer.h"
using membox::DTypeSize;
using membox::transport::TensorMeta;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto m = TensorMeta::Decode({data, size}, 1ull << 32);
  if (m.ok()) {
    unsigned __int128 n = DTypeSize(m->dtype);
    for (int i = 0; i < m->ndims; ++i) n *= m->dims[i];
    if (n != m->nbytes || m->nbytes > (1ull << 32) ||
        m->ndims > TensorMeta::kMaxDims) {
      std::abort();
    }
  }
  return 0;
}
