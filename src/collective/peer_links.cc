#include "src/collective/peer_links.h"

#include <algorithm>
#include <thread>

#include "src/collective/ring_message.h"

namespace membox::collective {

Result<std::map<int, PeerLink>> ConnectPeers(
    transport::Device& device, int rank,
    const std::vector<std::string>& endpoints, const std::set<int>& peers,
    size_t recv_bytes, std::chrono::milliseconds timeout) {
  std::map<int, PeerLink> links;
  for (int p : peers) {
    if (p < 0 || p >= static_cast<int>(endpoints.size()) || p == rank) {
      return InvalidArgumentError("no such peer " + std::to_string(p));
    }
    PeerLink& l = links[p];
    ASSIGN_OR_RETURN(l.recv, device.AllocateMemRegion(recv_bytes));
    auto deadline = std::chrono::steady_clock::now() + timeout;
    Status last;
    while (!l.out && std::chrono::steady_clock::now() < deadline) {
      auto ch = device.GetChannel(endpoints[p]);
      if (ch.ok()) {
        l.out = *ch;
      } else {
        last = ch.status();
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    }
    if (!l.out) {
      return UnavailableError("cannot reach worker " + std::to_string(p) +
                              ": " + last.ToString());
    }
    // Who we are, so the peer can file our channel as its `in` from us.
    RingMessage hello;
    hello.type = RingType::kHello;
    hello.step = static_cast<uint32_t>(rank);
    RETURN_IF_ERROR(SendRing(*l.out, hello));
  }
  for (size_t i = 0; i < peers.size(); ++i) {
    ASSIGN_OR_RETURN(auto ch, device.Accept(timeout));
    ASSIGN_OR_RETURN(auto bytes, ch->RecvControl(timeout));
    ASSIGN_OR_RETURN(RingMessage m, DecodeRing(bytes));
    int p = static_cast<int>(m.step);
    if (m.type != RingType::kHello || !peers.count(p) || links[p].in) {
      ch->Close();
      return DataLossError("unexpected connection from worker " +
                           std::to_string(p));
    }
    links[p].in = ch;
    RingMessage d;
    d.type = RingType::kDescriptor;
    d.payload = links[p].recv->Export().Serialize();
    RETURN_IF_ERROR(SendRing(*ch, d));
  }
  for (auto& [p, l] : links) {
    ASSIGN_OR_RETURN(RingMessage d,
                     RecvRing(*l.out, RingType::kDescriptor, 0, 0, timeout));
    ASSIGN_OR_RETURN(auto desc,
                     transport::RegionDescriptor::Deserialize(d.payload));
    ASSIGN_OR_RETURN(l.remote_recv, l.out->Import(desc, timeout));
    if (l.remote_recv->size() < recv_bytes) {
      return FailedPreconditionError(
          "worker " + std::to_string(p) +
          "'s receive buffer is smaller than ours (workers disagree on "
          "max_bytes)");
    }
  }
  return links;
}

Result<std::unique_ptr<transport::Device>> OpenDirect(const DirectOptions& o,
                                                      const std::string& kind,
                                                      size_t* slot) {
  if (o.world < 1 || o.rank < 0 || o.rank >= o.world) {
    return InvalidArgumentError("rank must be in [0, world)");
  }
  if (o.inline_bytes + 64 > transport::Channel::kMaxControlMessage) {
    return InvalidArgumentError(
        "inline_bytes exceeds the control path's " +
        std::to_string(transport::Channel::kMaxControlMessage) + " bytes");
  }
  *slot = std::max<size_t>(64 << 10, o.max_bytes / o.world);
  transport::DeviceOptions d;
  d.listen_address = o.listen;
  d.transports = o.transports;
  d.secret = o.secret;
  d.name = kind + "-" + std::to_string(o.rank);
  return transport::Device::Create(d);
}

void CloseLinks(std::map<int, PeerLink>& links) {
  for (auto& [p, l] : links) {
    if (l.out) l.out->Close();
    if (l.in) l.in->Close();
  }
}

}  // namespace membox::collective
