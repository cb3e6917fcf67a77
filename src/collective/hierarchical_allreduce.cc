#include "membox/collective/hierarchical_allreduce.h"

#include <cstring>
#include <functional>
#include <map>
#include <set>

#include "membox/base/accumulate.h"
#include "membox/base/copy.h"
#include "membox/transport/device.h"

#include "src/collective/peer_links.h"
#include "src/collective/ring_message.h"

namespace membox::collective {
namespace {

using transport::Channel;
using transport::MemRegion;

class HierImpl final : public HierarchicalAllreduce {
 public:
  explicit HierImpl(HierarchicalOptions o) : opt_(std::move(o)) {}
  ~HierImpl() override {
    CloseLinks(links_);
    links_.clear();
    send_.reset();
    device_.reset();
  }

  Status Init() {
    if (opt_.world < 1 || opt_.rank < 0 || opt_.rank >= opt_.world ||
        opt_.local_size < 1 || opt_.world % opt_.local_size != 0) {
      return InvalidArgumentError(
          "need 0 <= rank < world and world a multiple of local_size");
    }
    int nodes = opt_.world / opt_.local_size;
    if ((nodes & (nodes - 1)) != 0) {
      return InvalidArgumentError("the number of nodes must be a power of two");
    }
    transport::DeviceOptions d;
    d.listen_address = opt_.listen;
    d.transports = opt_.transports;
    d.secret = opt_.secret;
    d.name = "hier-" + std::to_string(opt_.rank);
    ASSIGN_OR_RETURN(device_, transport::Device::Create(d));
    ASSIGN_OR_RETURN(send_, device_->AllocateMemRegion(opt_.max_bytes));
    return Status::Ok();
  }

  std::string endpoint() const override { return device_->listen_endpoint(); }

  Status Connect(const std::vector<std::string>& endpoints) override {
    if (endpoints.size() != static_cast<size_t>(opt_.world)) {
      return InvalidArgumentError("one endpoint per worker");
    }
    std::set<int> peers;
    const int L = opt_.local_size, r = opt_.rank;
    const int node = r / L, local = r % L, nodes = opt_.world / L;
    if (local > 0) peers.insert(node * L + (local - 1) / 2);
    for (int c : {2 * local + 1, 2 * local + 2})
      if (c < L) peers.insert(node * L + c);
    if (local == 0)
      for (int k = 1; k < nodes; k <<= 1) peers.insert((node ^ k) * L);
    ASSIGN_OR_RETURN(links_, ConnectPeers(*device_, r, endpoints, peers,
                                          opt_.max_bytes, opt_.timeout));
    return Status::Ok();
  }

  Status Allreduce(float* data, size_t count) override {
    if (opt_.world == 1 || count == 0) return Status::Ok();
    if (count * sizeof(float) > opt_.max_bytes) {
      return InvalidArgumentError("buffer larger than max_bytes");
    }
    const uint64_t call = ++calls_;
    const size_t bytes = count * sizeof(float);
    const int L = opt_.local_size, r = opt_.rank;
    const int node = r / L, local = r % L, nodes = opt_.world / L;
    std::vector<int> children;
    for (int c : {2 * local + 1, 2 * local + 2})
      if (c < L) children.push_back(node * L + c);
    const int parent = local > 0 ? node * L + (local - 1) / 2 : -1;
    uint32_t step = 0;
    // 1. Reduce up the tree.
    for (int c : children) RETURN_IF_ERROR(RecvAdd(c, data, count, call, step));
    ++step;
    if (parent >= 0) RETURN_IF_ERROR(Send(parent, data, bytes, call, step - 1));
    // 2. Leaders: recursive doubling.
    if (local == 0) {
      for (int k = 1; k < nodes; k <<= 1, ++step) {
        int partner = (node ^ k) * L;
        RETURN_IF_ERROR(Send(partner, data, bytes, call, step));
        RETURN_IF_ERROR(RecvAdd(partner, data, count, call, step));
      }
    }
    // 3. Broadcast down the tree.
    const uint32_t down = 1000;
    if (parent >= 0) RETURN_IF_ERROR(RecvCopy(parent, data, bytes, call, down));
    for (int c : children) RETURN_IF_ERROR(Send(c, data, bytes, call, down));
    // Every buffer we wrote into has been consumed (ACKs) before we return.
    for (auto& [p, pend] : pending_acks_) {
      for (uint32_t s : pend)
        RETURN_IF_ERROR(Recv(*links_.at(p).out, RingType::kAck, call, s));
    }
    pending_acks_.clear();
    return Status::Ok();
  }

 private:
  Status Send(int peer, const float* data, size_t bytes, uint64_t call,
              uint32_t step) {
    PeerLink& l = links_.at(peer);
    // The peer's buffer must be free: wait for its ACK of our last send.
    auto& pend = pending_acks_[peer];
    for (uint32_t s : pend)
      RETURN_IF_ERROR(Recv(*l.out, RingType::kAck, call, s));
    pend.clear();
    CopyBytes(send_->data(), data, bytes);
    ASSIGN_OR_RETURN(
        auto h, l.out->Write(send_->data(), *send_, l.remote_recv->address(),
                             *l.remote_recv, bytes));
    RETURN_IF_ERROR(h.Wait(opt_.timeout));
    ASSIGN_OR_RETURN(auto f, l.out->Flush());
    RETURN_IF_ERROR(f.Wait(opt_.timeout));
    RETURN_IF_ERROR(SendRing(*l.out, {RingType::kReady, call, step}));
    pend.push_back(step);
    return Status::Ok();
  }

  Status Consume(int peer, uint64_t call, uint32_t step,
                 const std::function<void(const float*)>& fn) {
    PeerLink& l = links_.at(peer);
    RETURN_IF_ERROR(Recv(*l.in, RingType::kReady, call, step));
    fn(static_cast<const float*>(l.recv->data()));
    return SendRing(*l.in, {RingType::kAck, call, step});
  }

  Status RecvAdd(int peer, float* data, size_t count, uint64_t call,
                 uint32_t step) {
    return Consume(peer, call, step, [&](const float* in) {
      AccumulateKernel(DType::kFloat32, data, in, count, 1.0);
    });
  }

  Status RecvCopy(int peer, float* data, size_t bytes, uint64_t call,
                  uint32_t step) {
    return Consume(peer, call, step,
                   [&](const float* in) { CopyBytes(data, in, bytes); });
  }

  Status Recv(Channel& ch, RingType type, uint64_t call, uint32_t step) {
    return RecvRing(ch, type, call, step, opt_.timeout).status();
  }

  HierarchicalOptions opt_;
  std::unique_ptr<transport::Device> device_;
  std::unique_ptr<MemRegion> send_;
  std::map<int, PeerLink> links_;
  std::map<int, std::vector<uint32_t>> pending_acks_;
  uint64_t calls_ = 0;
};

}  // namespace

Result<std::unique_ptr<HierarchicalAllreduce>> HierarchicalAllreduce::Create(
    const HierarchicalOptions& options) {
  return MakeInitialized<HierarchicalAllreduce, HierImpl>(options);
}

}  // namespace membox::collective
