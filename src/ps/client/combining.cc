#include "src/ps/client/combining.h"

#include <chrono>

namespace membox::ps::client {

Result<AttachedCombine> AttachCombineRegion(transport::Channel& home,
                                            const std::string& descriptor,
                                            const CombineRequest& r) {
  ASSIGN_OR_RETURN(auto desc,
                   transport::RegionDescriptor::Deserialize(
                       {reinterpret_cast<const uint8_t*>(descriptor.data()),
                        descriptor.size()}));
  ASSIGN_OR_RETURN(auto region, home.Import(desc, std::chrono::seconds(10),
                                            /*verify_with_owner=*/false));
  if (!region->mapped()) {
    return FailedPreconditionError(
        "the proxy offered to combine key " + std::to_string(r.key) +
        " in its memory, which this worker cannot map");
  }
  ASSIGN_OR_RETURN(auto g, ParseCombineRegion(region->mapped(), region->size(),
                                              r.world, r.bytes, r.dtype));
  if (r.next_round != r.from) {
    return DataLossError("the proxy combines key " + std::to_string(r.key) +
                         " from round " + std::to_string(r.from) +
                         ", this worker is at round " +
                         std::to_string(r.next_round));
  }
  CombineView view(region->mapped(), g, r.rank, r.from);
  return AttachedCombine{std::move(region), view};
}

}  // namespace membox::ps::client
