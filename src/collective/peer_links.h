// The two channels a worker holds with each of its peers in the direct
// collectives (HierarchicalAllreduce's tree and doubling partners, Mesh's
// every other worker), and the one way they are set up.
//
// `out` is the channel this worker opened: it writes into the peer's
// receive buffer through it, sends the notices that a piece is there, and
// receives the peer's ACKs. `in` is the channel the peer opened: its
// notices arrive there and this worker's ACKs leave. `recv` is the buffer
// the peer writes into; `remote_recv` is the peer's buffer for us.
//
// Ownership: the caller's map owns the links; they must be destroyed (and
// should be closed) before the Device that made them.
#ifndef MEMBOX_SRC_COLLECTIVE_PEER_LINKS_H_
#define MEMBOX_SRC_COLLECTIVE_PEER_LINKS_H_

#include <chrono>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "membox/base/status.h"
#include "membox/collective/direct_options.h"
#include "membox/transport/device.h"

namespace membox::collective {

struct PeerLink {
  std::shared_ptr<transport::Channel> out, in;
  std::shared_ptr<transport::RemoteMemRegion> remote_recv;
  std::unique_ptr<transport::MemRegion> recv;
};

// Connects `rank` with every worker in `peers` (each of which must call
// this with `rank` among its own peers): opens a channel to each peer's
// endpoint (retrying until `timeout`) and says who it is (kHello), then
// accepts one channel from each, gives it a receive buffer of `recv_bytes`
// and tells the peer where it is (kDescriptor). A connection from a worker
// not in `peers`, or a second one from the same worker, is kDataLoss.
Result<std::map<int, PeerLink>> ConnectPeers(
    transport::Device& device, int rank,
    const std::vector<std::string>& endpoints, const std::set<int>& peers,
    size_t recv_bytes, std::chrono::milliseconds timeout);

// The checks and the device every DirectOptions user starts with: rank
// and world, inline_bytes within the control path; the device listening
// (named "<kind>-<rank>"); `*slot` the bytes of one peer's buffer.
Result<std::unique_ptr<transport::Device>> OpenDirect(const DirectOptions& o,
                                                      const std::string& kind,
                                                      size_t* slot);

// Closes both channels of every link (pending reads and waits end with
// kAborted / kUnavailable on both sides).
void CloseLinks(std::map<int, PeerLink>& links);

}  // namespace membox::collective

#endif  // MEMBOX_SRC_COLLECTIVE_PEER_LINKS_H_
