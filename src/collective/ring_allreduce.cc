#include "membox/collective/ring_allreduce.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <functional>
#include <optional>
#include <thread>

#include "membox/base/accumulate.h"
#include "membox/base/mutex.h"
#include "membox/transport/device.h"

#include "src/collective/ring_message.h"

namespace membox::collective {
namespace {

using transport::Channel;
using transport::MemRegion;
using transport::RemoteMemRegion;

// At most this many segments per step in a pipelined pass (the control
// notices per step grow with it).
constexpr size_t kMaxSegments = 16;

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

  using RingAllreduce::Allreduce;
  Status Allreduce(void* data, size_t count, DType dtype) override {
    RETURN_IF_ERROR(Summable(dtype));
    const size_t es = DTypeSize(dtype);
    const int P = opt_.world;
    if (P == 1 || count == 0) return Status::Ok();
    if (!next_ || !prev_) return FailedPreconditionError("ring not connected");
    if (count * es > opt_.max_bytes) {
      return InvalidArgumentError("buffer larger than the ring's max_bytes");
    }
    const size_t per = (count + P - 1) / P;
    if (per * es > ChunkCapacity()) {  // 8-byte elements, a tiny max_bytes
      return InvalidArgumentError("ring: a chunk of " +
                                  std::to_string(per * es) +
                                  " bytes exceeds the ring's buffer");
    }
    Pass pass;
    pass.base = static_cast<uint8_t*>(data);
    pass.dtype = dtype;
    pass.steps = 2 * (P - 1);
    pass.reduce_steps = P - 1;  // reduce-scatter, then all-gather
    pass.chunk = [count, per, es](int c) {
      size_t b = std::min(count, per * static_cast<size_t>(c));
      return std::make_pair(b * es, (std::min(count, b + per) - b) * es);
    };
    pass.largest = per * es;
    return Run(pass);
  }

  Status Allgather(void* data, size_t chunk_bytes) override {
    return AroundTheRing(static_cast<uint8_t*>(data), chunk_bytes, 0,
                         std::nullopt);
  }

  using RingAllreduce::ReduceScatter;
  Status ReduceScatter(void* data, size_t count, DType dtype) override {
    RETURN_IF_ERROR(Summable(dtype));
    return AroundTheRing(static_cast<uint8_t*>(data), count * DTypeSize(dtype),
                         1, dtype);
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
      RETURN_IF_ERROR(SendPiece(base + off, 0, n, call, step));
    }
    if (d == P - 1) return Status::Ok();
    return Recv(*next_, RingType::kAck, call, static_cast<int>(pieces) - 1)
        .status();
  }

 private:
  // The dtypes the reduce steps can add (the accumulate kernels').
  static Status Summable(DType dtype) {
    if (DTypeSize(dtype) != 0 && AccumulateSupports(dtype)) return Status::Ok();
    return InvalidArgumentError("ring: no sum of dtype " +
                                std::to_string(static_cast<int>(dtype)));
  }

  size_t ChunkCapacity() const {
    size_t floats = (opt_.max_bytes / sizeof(float) + opt_.world - 1) /
                    static_cast<size_t>(opt_.world);
    return std::max<size_t>(floats * sizeof(float), 64);
  }

  // p - 1 steps around the ring over `base`'s p chunks of `chunk_bytes`,
  // in pieces of at most ChunkCapacity() (a multiple of 8 when it is cut,
  // so whole elements): step t sends chunk (r - t - shift) and receives
  // chunk (r - t - shift - 1), which it copies (the all-gather half of
  // Allreduce: shift 0, no `reduce`) or adds to as `reduce` (its
  // reduce-scatter half, shifted so that worker r ends with chunk r
  // complete: shift 1).
  Status AroundTheRing(uint8_t* base, size_t chunk_bytes, int shift,
                       std::optional<DType> reduce) {
    const int P = opt_.world;
    if (P == 1 || chunk_bytes == 0) return Status::Ok();
    if (!next_ || !prev_) return FailedPreconditionError("ring not connected");
    const size_t piece = ChunkCapacity() / 8 * 8;
    for (size_t off = 0; off < chunk_bytes; off += piece) {
      const size_t n = std::min(piece, chunk_bytes - off);
      Pass pass;
      pass.base = base;
      pass.dtype = reduce.value_or(DType::kFloat32);
      pass.steps = P - 1;
      pass.reduce_steps = reduce ? P - 1 : 0;
      pass.shift = shift;
      pass.chunk = [chunk_bytes, off, n](int c) {
        return std::make_pair(static_cast<size_t>(c) * chunk_bytes + off, n);
      };
      pass.largest = n;
      RETURN_IF_ERROR(Run(pass));
    }
    return Status::Ok();
  }

  // One pass around the ring: step s sends chunk Send(s) = (rank - s -
  // shift) mod p and receives chunk Send(s + 1) -- what a step receives,
  // the next one forwards --, which it adds to as float32 (s <
  // reduce_steps) or copies. chunk(c) = (byte offset in base, bytes); no
  // chunk is larger than `largest` (<= ChunkCapacity()).
  struct Pass {
    uint8_t* base = nullptr;
    DType dtype = DType::kFloat32;  // what the reduce steps add
    int steps = 0;
    int reduce_steps = 0;
    int shift = 0;
    std::function<std::pair<size_t, size_t>(int)> chunk;
    size_t largest = 0;
  };

  int SendChunk(const Pass& p, int s) const {
    const int P = opt_.world;
    return ((opt_.rank - s - p.shift) % P + 2 * P) % P;
  }

  // How many segments each step's chunk goes in: opt_.segment_bytes each
  // (rounded to whole float32s), at most kMaxSegments, 1 when off.
  int Segments(const Pass& p) const {
    if (opt_.segment_bytes == 0 || p.largest < 2 * opt_.segment_bytes) return 1;
    return static_cast<int>(
        std::min<size_t>(kMaxSegments, p.largest / opt_.segment_bytes));
  }

  Status Run(const Pass& p) {
    const int k = Segments(p);
    const uint64_t call = ++calls_;
    return k == 1 ? RunInSteps(p, call) : RunPipelined(p, call, k);
  }

  // Step after step on the calling thread: send the step's chunk, take the
  // predecessor's, wait for the successor to have consumed ours.
  Status RunInSteps(const Pass& p, uint64_t call) {
    for (int s = 0; s < p.steps; ++s) {
      // The successor has consumed what we sent last step.
      if (s > 0)
        RETURN_IF_ERROR(Recv(*next_, RingType::kAck, call, s - 1).status());
      auto [sb, sn] = p.chunk(SendChunk(p, s));
      RETURN_IF_ERROR(SendPiece(p.base + sb, 0, sn, call, s));
      RETURN_IF_ERROR(Recv(*prev_, RingType::kReady, call, s).status());
      auto [rb, rn] = p.chunk(SendChunk(p, s + 1));
      Consume(p, s, p.base + rb, recv_->data(), rn);
      RETURN_IF_ERROR(Send(*prev_, RingType::kAck, call, s));
    }
    return Recv(*next_, RingType::kAck, call, p.steps - 1).status();
  }

  // The same pass in k segments per step, without a barrier between steps:
  // the calling thread takes each segment from the predecessor as it
  // arrives and hands it on to a sender thread, which forwards it to the
  // successor (segment j of step s + 1 is segment j of step s's chunk) as
  // soon as the successor has consumed segment j of the step before. So a
  // link carries the next segment while the last one is added, and a slow
  // hop holds up one segment, not every worker's next step. Segment j
  // lives at the same offset of the send and receive buffers in every
  // step. Notices are numbered s * k + j. On an error the first one is
  // returned and both neighbours' connections are closed: the other
  // thread may be blocked on either, and the ring is out of step anyway.
  Status RunPipelined(const Pass& p, uint64_t call, int k) {
    // Whole elements of any dtype (at most 8 bytes) in every segment.
    const size_t seg = ((p.largest + k - 1) / k + 7) / 8 * 8;
    auto piece = [&](int s, int j) {  // (offset in base, bytes) of a segment
      auto [b, n] = p.chunk(SendChunk(p, s));
      size_t lo = std::min(n, seg * static_cast<size_t>(j));
      return std::make_pair(b + lo, std::min(n, lo + seg) - lo);
    };
    auto id = [k](int s, int j) { return s * k + j; };
    Mutex mu;
    CondVar cv;
    std::deque<int> to_send;  // segment ids of steps >= 1, in order
    bool stop = false;
    Status first;
    // The first error closes both connections (once: the other thread's
    // error is then only their closing).
    auto fail = [&](Status st) {
      {
        MutexLock l(&mu);
        if (!first.ok()) return;
        first = st;
        stop = true;
      }
      cv.NotifyAll();
      next_->Close();
      prev_->Close();
    };
    std::thread sender([&] {
      auto send = [&](int s, int j) {
        auto [b, n] = piece(s, j);
        return SendPiece(p.base + b, seg * j, n, call, id(s, j));
      };
      Status st = [&]() -> Status {
        for (int j = 0; j < k; ++j) RETURN_IF_ERROR(send(0, j));
        for (int left = (p.steps - 1) * k; left > 0; --left) {
          int i;
          {
            MutexLock l(&mu);
            while (!stop && to_send.empty()) cv.Wait(&mu);
            if (to_send.empty()) return AbortedError("ring: stopped");
            i = to_send.front();
            to_send.pop_front();
          }
          const int s = i / k, j = i % k;
          RETURN_IF_ERROR(
              Recv(*next_, RingType::kAck, call, id(s - 1, j)).status());
          RETURN_IF_ERROR(send(s, j));
        }
        for (int j = 0; j < k; ++j) {
          RETURN_IF_ERROR(
              Recv(*next_, RingType::kAck, call, id(p.steps - 1, j)).status());
        }
        return Status::Ok();
      }();
      if (!st.ok()) fail(st);
    });
    Status st = [&]() -> Status {
      for (int s = 0; s < p.steps; ++s) {
        for (int j = 0; j < k; ++j) {
          RETURN_IF_ERROR(
              Recv(*prev_, RingType::kReady, call, id(s, j)).status());
          auto [b, n] = piece(s + 1, j);
          Consume(p, s, p.base + b,
                  static_cast<const uint8_t*>(recv_->data()) + seg * j, n);
          RETURN_IF_ERROR(Send(*prev_, RingType::kAck, call, id(s, j)));
          if (s + 1 < p.steps) {
            {
              MutexLock l(&mu);
              to_send.push_back(id(s + 1, j));
            }
            cv.NotifyOne();
          }
        }
      }
      return Status::Ok();
    }();
    if (!st.ok()) fail(st);
    sender.join();
    MutexLock l(&mu);
    return first;
  }

  // Step s's received bytes `in` into `into`: added as p.dtype or copied.
  static void Consume(const Pass& p, int s, uint8_t* into, const void* in,
                      size_t n) {
    if (s < p.reduce_steps) {
      AccumulateKernel(p.dtype, into, in, n / DTypeSize(p.dtype), 1.0);
    } else {
      std::memcpy(into, in, n);
    }
  }

  // `n` bytes of `src` into the successor's receive buffer at `at`
  // (through the registered send buffer at the same offset; nothing for
  // n = 0), flushed, then READY.
  Status SendPiece(const void* src, size_t at, size_t n, uint64_t call,
                   int step) {
    if (n > 0) {
      auto* from = static_cast<uint8_t*>(send_->data()) + at;
      std::memcpy(from, src, n);
      ASSIGN_OR_RETURN(auto h,
                       next_->Write(from, *send_, remote_recv_->address() + at,
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
