#include "membox/collective/ring_allreduce.h"

#include <algorithm>
#include <cstring>

#include "membox/base/accumulate.h"
#include "membox/transport/device.h"

#include "src/collective/ring_message.h"

namespace membox::collective {
namespace {

using transport::Channel;
using transport::MemRegion;
using transport::RemoteMemRegion;

class RingImpl final : public RingAllreduce {
 public:
  explicit RingImpl(RingOptions o) : opt_(std::move(o)) {}
  ~RingImpl() override {
    if (next_) next_->Close();
    if (prev_) prev_->Close();
    // Channels and regions before the device that owns their machinery.
    next_.reset();
    prev_.reset();
    remote_recv_.reset();
    send_.reset();
    recv_.reset();
    device_.reset();
  }

  Status Init() {
    if (opt_.world < 1 || opt_.rank < 0 || opt_.rank >= opt_.world) {
      return InvalidArgumentError("rank must be in [0, world)");
    }
    transport::DeviceOptions d;
    d.listen_address = opt_.listen;
    d.transports = opt_.transports;
    d.secret = opt_.secret;
    d.name = "ring-" + std::to_string(opt_.rank);
    ASSIGN_OR_RETURN(device_, transport::Device::Create(d));
    size_t chunk = ChunkCapacity();
    ASSIGN_OR_RETURN(send_, device_->AllocateMemRegion(chunk));
    ASSIGN_OR_RETURN(recv_, device_->AllocateMemRegion(chunk));
    return Status::Ok();
  }

  std::string endpoint() const override { return device_->listen_endpoint(); }

  Status Connect(const std::vector<std::string>& endpoints) override {
    if (endpoints.size() != static_cast<size_t>(opt_.world)) {
      return InvalidArgumentError("one endpoint per worker");
    }
    if (opt_.world == 1) return Status::Ok();
    int next = (opt_.rank + 1) % opt_.world;
    auto deadline = std::chrono::steady_clock::now() + opt_.timeout;
    Status last;
    while (std::chrono::steady_clock::now() < deadline) {
      auto ch = device_->GetChannel(endpoints[next]);
      if (ch.ok()) {
        next_ = *ch;
        break;
      }
      last = ch.status();
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (!next_) {
      return UnavailableError("ring: cannot reach worker " +
                              std::to_string(next) + ": " + last.ToString());
    }
    ASSIGN_OR_RETURN(prev_, device_->Accept(opt_.timeout));
    // Tell the predecessor where to write.
    RingMessage d;
    d.type = RingType::kDescriptor;
    d.payload = recv_->Export().Serialize();
    RETURN_IF_ERROR(SendRing(*prev_, d));
    ASSIGN_OR_RETURN(RingMessage got,
                     Recv(*next_, RingType::kDescriptor, 0, 0));
    ASSIGN_OR_RETURN(auto desc,
                     transport::RegionDescriptor::Deserialize(got.payload));
    ASSIGN_OR_RETURN(remote_recv_, next_->Import(desc, opt_.timeout));
    if (remote_recv_->size() < ChunkCapacity()) {
      return FailedPreconditionError("ring: workers disagree on max_bytes");
    }
    return Status::Ok();
  }

  Status Allreduce(float* data, size_t count) override {
    const int P = opt_.world;
    if (P == 1 || count == 0) return Status::Ok();
    if (!next_ || !prev_) return FailedPreconditionError("ring not connected");
    if (count * sizeof(float) > opt_.max_bytes) {
      return InvalidArgumentError("buffer larger than the ring's max_bytes");
    }
    const uint64_t call = ++calls_;
    const size_t per = (count + P - 1) / P;
    auto chunk = [&](int c) {
      size_t b = std::min(count, per * static_cast<size_t>(c));
      return std::make_pair(b, std::min(count, b + per) - b);
    };
    const int r = opt_.rank;
    const int steps = 2 * (P - 1);
    for (int s = 0; s < steps; ++s) {
      bool reduce = s < P - 1;
      int t = s - (P - 1);
      int send_c = reduce ? ((r - s) % P + P) % P : ((r + 1 - t) % P + P) % P;
      int recv_c =
          reduce ? ((r - s - 1) % P + 2 * P) % P : ((r - t) % P + P) % P;
      // The successor has consumed what we sent last step.
      if (s > 0)
        RETURN_IF_ERROR(Recv(*next_, RingType::kAck, call, s - 1).status());
      auto [sb, sn] = chunk(send_c);
      RETURN_IF_ERROR(SendPiece(data + sb, sn * sizeof(float), call, s));
      RETURN_IF_ERROR(Recv(*prev_, RingType::kReady, call, s).status());
      auto [rb, rn] = chunk(recv_c);
      const float* in = static_cast<const float*>(recv_->data());
      if (reduce) {
        AccumulateKernel(DType::kFloat32, data + rb, in, rn, 1.0);
      } else {
        std::memcpy(data + rb, in, rn * sizeof(float));
      }
      RETURN_IF_ERROR(Send(*prev_, RingType::kAck, call, s));
    }
    return Recv(*next_, RingType::kAck, call, steps - 1).status();
  }

  Status Allgather(void* data, size_t chunk_bytes) override {
    return AroundTheRing(static_cast<uint8_t*>(data), chunk_bytes, 0, false);
  }

  Status ReduceScatter(float* data, size_t count) override {
    return AroundTheRing(reinterpret_cast<uint8_t*>(data),
                         count * sizeof(float), 1, true);
  }

  Status Broadcast(void* data, size_t bytes, int root) override {
    const int P = opt_.world;
    if (root < 0 || root >= P) return InvalidArgumentError("no such root");
    if (P == 1 || bytes == 0) return Status::Ok();
    if (!next_ || !prev_) return FailedPreconditionError("ring not connected");
    auto* base = static_cast<uint8_t*>(data);
    // Pieces small enough that the chain fills quickly (a quarter of the
    // bytes per hop of the chain at least), large enough to amortise a
    // step's messages.
    const size_t piece = std::min(
        ChunkCapacity(),
        std::max<size_t>(256 << 10, bytes / (4 * static_cast<size_t>(P))));
    const size_t pieces = (bytes + piece - 1) / piece;
    const int d = ((opt_.rank - root) % P + P) % P;  // place in the chain
    const uint64_t call = ++calls_;
    for (size_t j = 0; j < pieces; ++j) {
      const size_t off = j * piece, n = std::min(piece, bytes - off);
      const int step = static_cast<int>(j);
      if (d > 0) {
        RETURN_IF_ERROR(Recv(*prev_, RingType::kReady, call, step).status());
        std::memcpy(base + off, recv_->data(), n);
        RETURN_IF_ERROR(Send(*prev_, RingType::kAck, call, step));
      }
      if (d == P - 1) continue;  // the chain's end
      if (j > 0)
        RETURN_IF_ERROR(Recv(*next_, RingType::kAck, call, step - 1).status());
      RETURN_IF_ERROR(SendPiece(base + off, n, call, step));
    }
    if (d == P - 1) return Status::Ok();
    return Recv(*next_, RingType::kAck, call, static_cast<int>(pieces) - 1)
        .status();
  }

 private:
  size_t ChunkCapacity() const {
    size_t floats = (opt_.max_bytes / sizeof(float) + opt_.world - 1) /
                    static_cast<size_t>(opt_.world);
    return std::max<size_t>(floats * sizeof(float), 64);
  }

  // p - 1 steps around the ring over `base`'s p chunks of `chunk_bytes`,
  // in pieces of at most ChunkCapacity() (a multiple of 4): step t sends
  // chunk (r - t - shift) and receives chunk (r - t - shift - 1), which it
  // copies (the all-gather half of Allreduce: shift 0) or adds to as
  // float32 (its reduce-scatter half, shifted so that worker r ends with
  // chunk r complete: shift 1).
  Status AroundTheRing(uint8_t* base, size_t chunk_bytes, int shift,
                       bool reduce) {
    const int P = opt_.world;
    if (P == 1 || chunk_bytes == 0) return Status::Ok();
    if (!next_ || !prev_) return FailedPreconditionError("ring not connected");
    const size_t piece = ChunkCapacity();
    const int r = opt_.rank;
    for (size_t off = 0; off < chunk_bytes; off += piece) {
      const size_t n = std::min(piece, chunk_bytes - off);
      const uint64_t call = ++calls_;
      for (int t = 0; t < P - 1; ++t) {
        const int send_c = ((r - t - shift) % P + 2 * P) % P;
        const int recv_c = ((r - t - shift - 1) % P + 2 * P) % P;
        if (t > 0)
          RETURN_IF_ERROR(Recv(*next_, RingType::kAck, call, t - 1).status());
        RETURN_IF_ERROR(
            SendPiece(base + send_c * chunk_bytes + off, n, call, t));
        RETURN_IF_ERROR(Recv(*prev_, RingType::kReady, call, t).status());
        uint8_t* into = base + recv_c * chunk_bytes + off;
        if (reduce) {
          AccumulateKernel(DType::kFloat32, reinterpret_cast<float*>(into),
                           static_cast<const float*>(recv_->data()),
                           n / sizeof(float), 1.0);
        } else {
          std::memcpy(into, recv_->data(), n);
        }
        RETURN_IF_ERROR(Send(*prev_, RingType::kAck, call, t));
      }
      RETURN_IF_ERROR(Recv(*next_, RingType::kAck, call, P - 2).status());
    }
    return Status::Ok();
  }

  // `n` bytes of `src` into the successor's receive buffer (through the
  // registered send buffer; nothing for n = 0), flushed, then READY.
  Status SendPiece(const void* src, size_t n, uint64_t call, int step) {
    if (n > 0) {
      std::memcpy(send_->data(), src, n);
      ASSIGN_OR_RETURN(
          auto h, next_->Write(send_->data(), *send_, remote_recv_->address(),
                               *remote_recv_, n));
      RETURN_IF_ERROR(h.Wait(opt_.timeout));
      ASSIGN_OR_RETURN(auto f, next_->Flush());
      RETURN_IF_ERROR(f.Wait(opt_.timeout));
    }
    return Send(*next_, RingType::kReady, call, step);
  }

  Status Send(Channel& ch, RingType type, uint64_t call, int step) {
    return SendRing(ch, {type, call, static_cast<uint32_t>(step)});
  }

  Result<RingMessage> Recv(Channel& ch, RingType type, uint64_t call,
                           int step) {
    return RecvRing(ch, type, call, static_cast<uint32_t>(step), opt_.timeout);
  }

  RingOptions opt_;
  std::unique_ptr<transport::Device> device_;
  std::unique_ptr<MemRegion> send_, recv_;
  std::shared_ptr<Channel> next_, prev_;
  std::shared_ptr<RemoteMemRegion> remote_recv_;
  uint64_t calls_ = 0;
};

}  // namespace

Result<std::unique_ptr<RingAllreduce>> RingAllreduce::Create(
    const RingOptions& options) {
  return MakeInitialized<RingAllreduce, RingImpl>(options);
}

}  // namespace membox::collective
