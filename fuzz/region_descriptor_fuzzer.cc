// Fuzzes RegionDescriptor::Deserialize: any input is refused or round-trips.
#include <cstdlib>

#include "membox/transport/mem_region.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto d = membox::transport::RegionDescriptor::Deserialize({data, size});
  if (d.ok()) {
    auto again = d->Serialize();
    if (again.size() != size) std::abort();
    if (d->length == 0 || d->address + d->length < d->address) std::abort();
  }
  return 0;
}
