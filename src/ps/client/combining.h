// Attaching a key combined in a memory node's memory (src/ps/combine.h):
// the node said yes to a worker's kCombine with the region's descriptor
// and the round it combines from; the worker maps the region, checks it
// against what it declared, and gets the view its Combiner works through.
//
// Threading: none of its own; AttachCombineRegion blocks the caller while
// the channel imports the region. Ownership: the result owns the mapping
// (`region`); the view points into it.
#ifndef MEMBOX_SRC_PS_CLIENT_COMBINING_H_
#define MEMBOX_SRC_PS_CLIENT_COMBINING_H_

#include <cstdint>
#include <memory>
#include <string>

#include "membox/base/dtype.h"
#include "membox/base/status.h"
#include "membox/transport/channel.h"

#include "src/ps/combine.h"

namespace membox::ps::client {

struct AttachedCombine {
  std::shared_ptr<transport::RemoteMemRegion> region;  // the mapping
  CombineView view;
};

// What the worker declared and where it stands.
struct CombineRequest {
  uint64_t key = 0;
  uint32_t world = 0;
  uint32_t rank = 0;
  uint64_t bytes = 0;
  DType dtype = DType::kFloat32;
  uint64_t from = 0;        // the node's answer: the first combined round
  uint64_t next_round = 0;  // this worker's next push of the key
};

// Maps the region `descriptor` (a serialized RegionDescriptor from the
// node) over `home`, the channel to the key's home node, and checks it:
// the descriptor decodes, the region maps into this process (combining is
// for workers on the node's host), its header matches the request
// (ParseCombineRegion), and the node combines from this worker's next
// round. Errors say which; nothing is kept on failure.
Result<AttachedCombine> AttachCombineRegion(transport::Channel& home,
                                            const std::string& descriptor,
                                            const CombineRequest& r);

}  // namespace membox::ps::client

#endif  // MEMBOX_SRC_PS_CLIENT_COMBINING_H_
