#include "membox/collective/mesh.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <optional>
#include <set>

#include "membox/base/copy.h"
#include "membox/transport/device.h"

#include "src/collective/peer_links.h"
#include "src/collective/ring_message.h"

namespace membox::collective {
namespace {

using transport::MemRegion;
using transport::OpHandle;

class MeshImpl final : public Mesh {
 public:
  explicit MeshImpl(MeshOptions o) : opt_(std::move(o)) {}
  ~MeshImpl() override {
    CloseLinks(links_);
    // Links and buffers before the device that owns their machinery.
    links_.clear();
    send_.clear();
    device_.reset();
  }

  Status Init() {
    ASSIGN_OR_RETURN(device_, OpenDirect(opt_, "mesh", &slot_));
    return Status::Ok();
  }

  std::string endpoint() const override { return device_->listen_endpoint(); }

  Status Connect(const std::vector<std::string>& endpoints) override {
    if (endpoints.size() != static_cast<size_t>(opt_.world)) {
      return InvalidArgumentError("one endpoint per worker");
    }
    if (connected_) return FailedPreconditionError("mesh already connected");
    std::set<int> peers;
    for (int q = 0; q < opt_.world; ++q)
      if (q != opt_.rank) peers.insert(q);
    for (int q : peers) {
      ASSIGN_OR_RETURN(send_[q], device_->AllocateMemRegion(slot_));
    }
    ASSIGN_OR_RETURN(links_, ConnectPeers(*device_, opt_.rank, endpoints, peers,
                                          slot_, opt_.timeout));
    connected_ = true;
    return Status::Ok();
  }

  Status AllToAll(const std::vector<std::span<const uint8_t>>& sends,
                  const std::vector<std::span<uint8_t>>& recvs) override {
    const int P = opt_.world, r = opt_.rank;
    if (sends.size() != static_cast<size_t>(P) ||
        recvs.size() != static_cast<size_t>(P)) {
      return InvalidArgumentError("one send and one receive buffer per worker");
    }
    if (sends[r].size() != recvs[r].size()) {
      return InvalidArgumentError(
          "this worker's send to itself and receive from itself differ in "
          "size");
    }
    if (!broken_.ok()) {
      return FailedPreconditionError(
          "mesh unusable after an earlier failure: " + broken_.ToString());
    }
    if (P > 1 && !connected_)
      return FailedPreconditionError("mesh not connected");
    if (sends[r].data() != recvs[r].data() && !sends[r].empty()) {
      std::memmove(recvs[r].data(), sends[r].data(), sends[r].size());
    }
    if (P == 1) return Status::Ok();
    Status s = Exchange(sends, recvs);
    if (!s.ok()) {
      broken_ = s;
      CloseLinks(links_);
    }
    return s;
  }

 private:
  // A pair of n bytes goes inline (in its one notice) up to inline_bytes;
  // above, in pieces written into the peer's buffer.
  bool Inline(size_t n) const { return n <= opt_.inline_bytes; }
  // Where the peer's buffer for us is mapped here (one host), a pair
  // inline by size but above kMappedInlineBytes that fits the buffer is
  // copied straight into it instead (one copy, where the control path
  // makes three), with an empty kPiece notice.
  static constexpr size_t kMappedInlineBytes = 32 << 10;
  bool MappedWrite(const PeerLink& l, size_t n) const {
    return l.remote_recv->mapped() != nullptr && n > kMappedInlineBytes &&
           n <= slot_;
  }
  // Copies a piece into the peer's mapped buffer and says so: the notice
  // follows the bytes (release), and the peer ACKs it.
  Status PutMapped(int q, PeerLink& l, const uint8_t* data, size_t n,
                   RingMessage& m) {
    RETURN_IF_ERROR(AwaitFree(q));
    CopyBytes(l.remote_recv->mapped(), data, n);
    std::atomic_thread_fence(std::memory_order_release);
    RETURN_IF_ERROR(SendRing(*l.out, m));
    unacked_[q] = {m.call, m.step};
    return Status::Ok();
  }
  size_t Pieces(size_t n) const {
    return Inline(n) ? 1 : (n + slot_ - 1) / slot_;
  }

  // The peer's buffer for us is free again: its ACK of the last piece we
  // wrote there (possibly of an earlier call) has come.
  Status AwaitFree(int q) {
    auto it = unacked_.find(q);
    if (it == unacked_.end()) return Status::Ok();
    auto [call, step] = it->second;
    unacked_.erase(it);
    return Recv(*links_.at(q).out, RingType::kAck, call, step);
  }

  Status Exchange(const std::vector<std::span<const uint8_t>>& sends,
                  const std::vector<std::span<uint8_t>>& recvs) {
    const int P = opt_.world, r = opt_.rank;
    const uint64_t call = ++calls_;
    size_t rounds = 0;
    for (int q = 0; q < P; ++q) {
      if (q == r) continue;
      rounds =
          std::max({rounds, Pieces(sends[q].size()), Pieces(recvs[q].size())});
    }
    for (size_t i = 0; i < rounds; ++i) {
      const uint32_t step = static_cast<uint32_t>(i);
      // 1. Send this piece to every peer (in the order r+1, r+2, ... so
      // that not everyone sends to the same worker first): inline, or
      // start its write.
      std::vector<std::pair<int, std::optional<OpHandle>>> writes;
      for (int k = 1; k < P; ++k) {
        const int q = (r + k) % P;
        const size_t total = sends[q].size();
        if (i >= Pieces(total)) continue;
        PeerLink& l = links_.at(q);
        RingMessage m{RingType::kPiece, call, step};
        m.total = total;
        const size_t off = i * slot_, n = std::min(slot_, total - off);
        if (Inline(total) && !MappedWrite(l, total)) {
          m.payload.assign(sends[q].begin(), sends[q].end());
          RETURN_IF_ERROR(SendRing(*l.out, m));
          continue;
        }
        if (l.remote_recv->mapped() != nullptr) {
          RETURN_IF_ERROR(PutMapped(q, l, sends[q].data() + off, n, m));
          continue;
        }
        RETURN_IF_ERROR(AwaitFree(q));
        MemRegion& buf = *send_.at(q);
        CopyBytes(buf.data(), sends[q].data() + off, n);
        ASSIGN_OR_RETURN(auto h,
                         l.out->Write(buf.data(), buf, l.remote_recv->address(),
                                      *l.remote_recv, n));
        writes.emplace_back(q, std::move(h));
      }
      // 2. As each write lands, flush it and say so.
      for (auto& [q, h] : writes) {
        PeerLink& l = links_.at(q);
        RETURN_IF_ERROR(h->Wait(opt_.timeout));
        ASSIGN_OR_RETURN(auto f, l.out->Flush());
        RETURN_IF_ERROR(f.Wait(opt_.timeout));
        RingMessage m{RingType::kPiece, call, step};
        m.total = sends[q].size();
        RETURN_IF_ERROR(SendRing(*l.out, m));
        unacked_[q] = {call, step};
      }
      // 3. Take this piece from every peer; free the buffer of a written
      // one.
      for (int k = 1; k < P; ++k) {
        const int q = (r - k + P) % P;
        const size_t total = recvs[q].size();
        if (i >= Pieces(total)) continue;
        PeerLink& l = links_.at(q);
        ASSIGN_OR_RETURN(RingMessage m, RecvRing(*l.in, RingType::kPiece, call,
                                                 step, opt_.timeout));
        if (m.total != total) {
          return InvalidArgumentError(
              "all-to-all sizes disagree: worker " + std::to_string(q) +
              " sends " + std::to_string(m.total) + " bytes to worker " +
              std::to_string(r) + ", which expects " + std::to_string(total));
        }
        // Inline by size, its bytes are in the notice -- or, sent empty,
        // in our buffer (MappedWrite), which then holds all of them.
        const bool in_buffer =
            !Inline(total) || (total > 0 && m.payload.empty());
        if (!in_buffer) {
          if (m.payload.size() != total) {
            return DataLossError("worker " + std::to_string(q) +
                                 " sent a short inline piece");
          }
          if (total > 0) CopyBytes(recvs[q].data(), m.payload.data(), total);
          continue;
        }
        if (Inline(total) && total > slot_) {
          return DataLossError("worker " + std::to_string(q) +
                               " sent an empty notice for " +
                               std::to_string(total) +
                               " bytes, more than its buffer here holds");
        }
        std::atomic_thread_fence(std::memory_order_acquire);
        const size_t off = i * slot_, n = std::min(slot_, total - off);
        CopyBytes(recvs[q].data() + off, l.recv->data(), n);
        Status acked = SendRing(*l.in, {RingType::kAck, call, step});
        // The pair's last ACK may find the peer gone: it had all it needed
        // from us and may have left the job (its next call would fail).
        if (!acked.ok() && i + 1 < Pieces(total)) return acked;
      }
    }
    // The last written pieces' ACKs are awaited before their buffers are
    // written again (AwaitFree), not here: the call ends when every piece
    // has arrived.
    return Status::Ok();
  }

  Status Recv(transport::Channel& ch, RingType type, uint64_t call,
              uint32_t step) {
    return RecvRing(ch, type, call, step, opt_.timeout).status();
  }

  MeshOptions opt_;
  size_t slot_ = 0;
  std::unique_ptr<transport::Device> device_;
  std::map<int, std::unique_ptr<MemRegion>> send_;  // per peer
  std::map<int, PeerLink> links_;
  bool connected_ = false;
  // Per peer: the (call, step) of the last piece written into its buffer
  // whose ACK has not been read.
  std::map<int, std::pair<uint64_t, uint32_t>> unacked_;
  Status broken_;  // the first failure; calls are refused after it
  uint64_t calls_ = 0;
};

}  // namespace

Result<std::unique_ptr<Mesh>> Mesh::Create(const MeshOptions& options) {
  return MakeInitialized<Mesh, MeshImpl>(options);
}

}  // namespace membox::collective
