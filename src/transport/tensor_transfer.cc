#include "membox/transport/tensor_transfer.h"

#include <atomic>
#include <cstring>

#include "membox/base/wire.h"

namespace membox::transport {
namespace {

constexpr size_t kFlagBytes = 64;  // the flag word, padded to a cache line

size_t RoundUp8(size_t n) { return (n + 7) & ~size_t{7}; }

uint64_t LoadAcquire(const void* p) {
  return std::atomic_ref<uint64_t>(
             *static_cast<uint64_t*>(const_cast<void*>(p)))
      .load(std::memory_order_acquire);
}
void StoreRelease(void* p, uint64_t v) {
  std::atomic_ref<uint64_t>(*static_cast<uint64_t*>(p))
      .store(v, std::memory_order_release);
}

// Setup messages: one type byte, then length-prefixed descriptors / numbers.
enum SetupType : uint8_t {
  kStaticDst = 'S',
  kCredit = 'C',
  kMetaSlot = 'M',
  kPool = 'P'
};

Status SendSetup(Channel& ch, SetupType type,
                 std::initializer_list<uint64_t> nums,
                 std::initializer_list<const RegionDescriptor*> descs) {
  wire::Writer w;
  w.U8(type);
  for (uint64_t n : nums) w.U64(n);
  for (const RegionDescriptor* d : descs) {
    auto b = d->Serialize();
    w.U32(static_cast<uint32_t>(b.size()));
    w.Bytes(b.data(), b.size());
  }
  return ch.SendControl(w.buffer());
}

struct Setup {
  std::vector<uint64_t> nums;
  std::vector<RegionDescriptor> descs;
};

Result<Setup> RecvSetup(Channel& ch, SetupType type, int nnums, int ndescs,
                        std::chrono::nanoseconds timeout) {
  ASSIGN_OR_RETURN(auto msg, ch.RecvControl(timeout));
  wire::Reader r(msg);
  uint8_t t = 0;
  if (!r.U8(&t) || t != type) {
    return InvalidArgumentError(
        std::string("unexpected setup message (wanted '") +
        static_cast<char>(type) + "')");
  }
  Setup s;
  for (int i = 0; i < nnums; ++i) {
    uint64_t v;
    if (!r.U64(&v)) return InvalidArgumentError("setup message truncated");
    s.nums.push_back(v);
  }
  for (int i = 0; i < ndescs; ++i) {
    uint32_t len = 0;
    std::vector<uint8_t> b;
    if (!r.U32(&len) || !r.Bytes(&b, len))
      return InvalidArgumentError("setup message truncated");
    ASSIGN_OR_RETURN(auto d, RegionDescriptor::Deserialize(b));
    s.descs.push_back(std::move(d));
  }
  if (r.remaining() != 0)
    return InvalidArgumentError("setup message has trailing bytes");
  return s;
}

// Writes one flag/credit word and returns once it is visible at the peer, so
// that a peer tearing down right after observing it never receives a late
// write into freed memory.
Status WriteWord(Channel& ch, MemRegion& src, const RemoteMemRegion& dst,
                 uint64_t dst_addr, uint64_t value) {
  StoreRelease(src.data(), value);
  ASSIGN_OR_RETURN(OpHandle h, ch.Write(src.data(), src, dst_addr, dst, 8));
  RETURN_IF_ERROR(h.Wait());
  // Mapped stores are visible already; active-message writes are checked
  // against the owner's live regions on arrival. Only raw RMA needs the
  // flush (UCX's emulated put would write into freed memory unchecked).
  if (ch.protocol() != Protocol::kRma) return Status::Ok();
  ASSIGN_OR_RETURN(OpHandle f, ch.Flush());
  return f.Wait();
}

Status WaitWord(const void* word, uint64_t at_least,
                std::chrono::nanoseconds timeout, Channel& ch,
                const char* what) {
  bool ok = SpinThenBlock(
      [&] {
        if (LoadAcquire(word) >= at_least) return true;
        ch.Progress();
        return LoadAcquire(word) >= at_least || !ch.health().ok();
      },
      nullptr, timeout);
  if (LoadAcquire(word) >= at_least) return Status::Ok();
  if (!ch.health().ok()) return ch.health();
  (void)ok;
  return DeadlineExceededError(std::string(what) +
                               " not reached before the timeout");
}

}  // namespace

TensorMeta TensorMeta::Make(DType dtype, std::span<const uint64_t> dims) {
  TensorMeta m;
  m.dtype = dtype;
  m.ndims = static_cast<uint8_t>(std::min<size_t>(dims.size(), kMaxDims));
  uint64_t n = DTypeSize(dtype);
  for (size_t i = 0; i < m.ndims; ++i) {
    m.dims[i] = dims[i];
    n *= dims[i];
  }
  m.nbytes = n;
  return m;
}

void TensorMeta::EncodeTo(uint8_t out[kEncodedSize]) const {
  std::memset(out, 0, kEncodedSize);
  out[0] = static_cast<uint8_t>(dtype);
  out[1] = ndims;
  std::memcpy(out + 8, dims.data(), 8 * kMaxDims);
  std::memcpy(out + 72, &nbytes, 8);
  std::memcpy(out + 80, &src_addr, 8);
  uint32_t crc = wire::Crc32(out, kEncodedSize - 4);
  std::memcpy(out + kEncodedSize - 4, &crc, 4);
}

Result<TensorMeta> TensorMeta::Decode(std::span<const uint8_t> in,
                                      uint64_t max_bytes) {
  if (in.size() != kEncodedSize)
    return InvalidArgumentError("tensor metadata has the wrong size");
  uint32_t crc = 0;
  std::memcpy(&crc, in.data() + kEncodedSize - 4, 4);
  if (wire::Crc32(in.data(), kEncodedSize - 4) != crc) {
    return DataLossError("tensor metadata checksum mismatch");
  }
  TensorMeta m;
  m.dtype = static_cast<DType>(in[0]);
  m.ndims = in[1];
  if (DTypeSize(m.dtype) == 0) {
    return InvalidArgumentError("tensor metadata: unknown dtype " +
                                std::to_string(in[0]));
  }
  if (m.ndims > kMaxDims) {
    return InvalidArgumentError("tensor metadata: " + std::to_string(m.ndims) +
                                " dimensions");
  }
  std::memcpy(m.dims.data(), in.data() + 8, 8 * kMaxDims);
  std::memcpy(&m.nbytes, in.data() + 72, 8);
  std::memcpy(&m.src_addr, in.data() + 80, 8);
  unsigned __int128 n = DTypeSize(m.dtype);
  for (int i = 0; i < m.ndims; ++i) {
    n *= m.dims[i];
    if (n > max_bytes) {
      return OutOfRangeError("tensor metadata: tensor larger than " +
                             std::to_string(max_bytes) + " bytes");
    }
  }
  for (int i = m.ndims; i < kMaxDims; ++i) {
    if (m.dims[i] != 0)
      return InvalidArgumentError("tensor metadata: unused dims not zero");
  }
  if (static_cast<uint64_t>(n) != m.nbytes) {
    return InvalidArgumentError(
        "tensor metadata: byte size does not match the shape");
  }
  return m;
}

// ------------------------------------------------------------ static

Result<std::unique_ptr<StaticTensorReceiver>> StaticTensorReceiver::Create(
    Device& device, std::shared_ptr<Channel> channel, size_t bytes,
    std::chrono::nanoseconds timeout) {
  if (bytes == 0) return InvalidArgumentError("static tensor of 0 bytes");
  std::unique_ptr<StaticTensorReceiver> r(new StaticTensorReceiver());
  r->channel_ = std::move(channel);
  r->bytes_ = bytes;
  r->flag_off_ = RoundUp8(bytes);
  ASSIGN_OR_RETURN(r->buf_,
                   device.AllocateMemRegion(r->flag_off_ + kFlagBytes));
  ASSIGN_OR_RETURN(r->credit_src_, device.AllocateMemRegion(kFlagBytes));
  StoreRelease(static_cast<char*>(r->buf_->data()) + r->flag_off_, 0);
  auto desc = r->buf_->Export();
  RETURN_IF_ERROR(
      SendSetup(*r->channel_, kStaticDst, {bytes, r->flag_off_}, {&desc}));
  ASSIGN_OR_RETURN(Setup s, RecvSetup(*r->channel_, kCredit, 0, 1, timeout));
  ASSIGN_OR_RETURN(r->sender_credit_, r->channel_->Import(s.descs[0], timeout));
  return r;
}

StaticTensorReceiver::~StaticTensorReceiver() = default;

bool StaticTensorReceiver::Poll() const {
  return LoadAcquire(static_cast<char*>(buf_->data()) + flag_off_) == expect_;
}

Status StaticTensorReceiver::Wait(std::chrono::nanoseconds timeout) {
  bool ok = SpinThenBlock(
      [this] {
        if (Poll()) return true;
        channel_->Progress();
        return Poll() || !channel_->health().ok();
      },
      nullptr, timeout);
  if (Poll()) return Status::Ok();
  if (!channel_->health().ok()) return channel_->health();
  (void)ok;
  return DeadlineExceededError("no tensor arrived before the timeout");
}

Status StaticTensorReceiver::Release() {
  if (!Poll())
    return FailedPreconditionError("Release() without a received tensor");
  StoreRelease(static_cast<char*>(buf_->data()) + flag_off_, 0);
  RETURN_IF_ERROR(WriteWord(*channel_, *credit_src_, *sender_credit_,
                            sender_credit_->address(), expect_));
  ++expect_;
  return Status::Ok();
}

Result<std::unique_ptr<StaticTensorSender>> StaticTensorSender::Create(
    Device& device, std::shared_ptr<Channel> channel,
    std::chrono::nanoseconds timeout) {
  std::unique_ptr<StaticTensorSender> s(new StaticTensorSender());
  s->channel_ = std::move(channel);
  ASSIGN_OR_RETURN(Setup setup,
                   RecvSetup(*s->channel_, kStaticDst, 2, 1, timeout));
  uint64_t bytes = setup.nums[0], flag_off = setup.nums[1];
  if (flag_off != RoundUp8(bytes) ||
      setup.descs[0].length != flag_off + kFlagBytes) {
    return InvalidArgumentError(
        "static tensor descriptor has an inconsistent layout");
  }
  ASSIGN_OR_RETURN(s->dst_, s->channel_->Import(setup.descs[0], timeout));
  s->capacity_ = bytes;
  ASSIGN_OR_RETURN(s->credit_, device.AllocateMemRegion(kFlagBytes));
  ASSIGN_OR_RETURN(s->flag_src_, device.AllocateMemRegion(kFlagBytes));
  StoreRelease(s->credit_->data(), 0);
  auto desc = s->credit_->Export();
  RETURN_IF_ERROR(SendSetup(*s->channel_, kCredit, {}, {&desc}));
  return s;
}

StaticTensorSender::~StaticTensorSender() = default;

Status StaticTensorSender::Send(const void* src, const MemRegion& region,
                                size_t bytes,
                                std::chrono::nanoseconds timeout) {
  if (bytes > capacity_) {
    return InvalidArgumentError("tensor of " + std::to_string(bytes) +
                                " bytes exceeds the receiver's buffer of " +
                                std::to_string(capacity_));
  }
  RETURN_IF_ERROR(
      WaitWord(credit_->data(), seq_, timeout, *channel_, "receiver credit"));
  ASSIGN_OR_RETURN(OpHandle h,
                   channel_->Write(src, region, dst_->address(), *dst_, bytes));
  RETURN_IF_ERROR(h.Wait());
  RETURN_IF_ERROR(channel_->Fence());
  ++seq_;
  return WriteWord(*channel_, *flag_src_, *dst_,
                   dst_->address() + RoundUp8(capacity_), seq_);
}

Status StaticTensorSender::WaitReleased(std::chrono::nanoseconds timeout) {
  return WaitWord(credit_->data(), seq_, timeout, *channel_, "receiver credit");
}

// ------------------------------------------------------------ dynamic

Result<std::unique_ptr<DynamicTensorReceiver>> DynamicTensorReceiver::Create(
    Device& device, std::shared_ptr<Channel> channel, size_t pool_bytes,
    std::chrono::nanoseconds timeout) {
  std::unique_ptr<DynamicTensorReceiver> r(new DynamicTensorReceiver());
  r->channel_ = std::move(channel);
  ASSIGN_OR_RETURN(r->slot_, device.AllocateMemRegion(TensorMeta::kEncodedSize +
                                                      kFlagBytes));
  std::memset(r->slot_->data(), 0, r->slot_->size());
  ASSIGN_OR_RETURN(r->pool_, RegisteredPool::Create(device, pool_bytes));
  ASSIGN_OR_RETURN(r->credit_src_, device.AllocateMemRegion(kFlagBytes));
  auto desc = r->slot_->Export();
  RETURN_IF_ERROR(SendSetup(*r->channel_, kMetaSlot, {}, {&desc}));
  ASSIGN_OR_RETURN(Setup s, RecvSetup(*r->channel_, kPool, 0, 2, timeout));
  ASSIGN_OR_RETURN(r->sender_pool_, r->channel_->Import(s.descs[0], timeout));
  ASSIGN_OR_RETURN(r->sender_credit_, r->channel_->Import(s.descs[1], timeout));
  return r;
}

DynamicTensorReceiver::~DynamicTensorReceiver() = default;

Result<ReceivedTensor> DynamicTensorReceiver::Receive(
    std::chrono::nanoseconds timeout) {
  char* flag = static_cast<char*>(slot_->data()) + TensorMeta::kEncodedSize;
  bool ok = SpinThenBlock(
      [&] {
        if (LoadAcquire(flag) == expect_) return true;
        channel_->Progress();
        return LoadAcquire(flag) == expect_ || !channel_->health().ok();
      },
      nullptr, timeout);
  if (LoadAcquire(flag) != expect_) {
    if (!channel_->health().ok()) return channel_->health();
    (void)ok;
    return DeadlineExceededError(
        "no tensor metadata arrived before the timeout");
  }
  std::array<uint8_t, TensorMeta::kEncodedSize> raw;
  std::memcpy(raw.data(), slot_->data(), raw.size());
  // Consume the slot whatever the metadata holds, so one bad message does
  // not wedge the stream.
  auto consume = [&]() -> Status {
    StoreRelease(flag, 0);
    Status s = WriteWord(*channel_, *credit_src_, *sender_credit_,
                         sender_credit_->address(), expect_);
    ++expect_;
    return s;
  };
  Result<TensorMeta> meta = TensorMeta::Decode(raw, pool_->region().size());
  if (!meta.ok()) {
    RETURN_IF_ERROR(consume());
    return meta.status();
  }
  if (!sender_pool_->Contains(meta->src_addr, meta->nbytes)) {
    RETURN_IF_ERROR(consume());
    return OutOfRangeError("tensor metadata points outside the sender's pool");
  }
  ReceivedTensor t;
  t.meta = *meta;
  if (meta->nbytes > 0) {
    auto block = pool_->Allocate(meta->nbytes);
    if (!block.ok()) {
      RETURN_IF_ERROR(consume());
      return block.status();
    }
    t.block = std::move(*block);
    ASSIGN_OR_RETURN(
        OpHandle h,
        channel_->Read(t.block.data(), t.block.region(), meta->src_addr,
                       *sender_pool_, meta->nbytes));
    Status rs = h.Wait();
    if (!rs.ok()) {
      (void)consume();
      return rs;
    }
  }
  RETURN_IF_ERROR(consume());
  return t;
}

Result<std::unique_ptr<DynamicTensorSender>> DynamicTensorSender::Create(
    Device& device, std::shared_ptr<Channel> channel, size_t pool_bytes,
    std::chrono::nanoseconds timeout) {
  std::unique_ptr<DynamicTensorSender> s(new DynamicTensorSender());
  s->channel_ = std::move(channel);
  ASSIGN_OR_RETURN(Setup setup,
                   RecvSetup(*s->channel_, kMetaSlot, 0, 1, timeout));
  if (setup.descs[0].length != TensorMeta::kEncodedSize + kFlagBytes) {
    return InvalidArgumentError("metadata slot descriptor has the wrong size");
  }
  ASSIGN_OR_RETURN(s->slot_, s->channel_->Import(setup.descs[0], timeout));
  ASSIGN_OR_RETURN(s->pool_, RegisteredPool::Create(device, pool_bytes));
  ASSIGN_OR_RETURN(s->credit_, device.AllocateMemRegion(kFlagBytes));
  ASSIGN_OR_RETURN(s->meta_src_, device.AllocateMemRegion(
                                     TensorMeta::kEncodedSize + kFlagBytes));
  StoreRelease(s->credit_->data(), 0);
  auto pool_desc = s->pool_->region().Export();
  auto credit_desc = s->credit_->Export();
  RETURN_IF_ERROR(
      SendSetup(*s->channel_, kPool, {}, {&pool_desc, &credit_desc}));
  return s;
}

DynamicTensorSender::~DynamicTensorSender() = default;

Result<uint64_t> DynamicTensorSender::Send(const TensorMeta& meta,
                                           const void* data,
                                           std::chrono::nanoseconds timeout) {
  if (meta.nbytes > 0 && !pool_->region().Contains(data, meta.nbytes)) {
    return InvalidArgumentError("tensor data must live in the sender's pool");
  }
  RETURN_IF_ERROR(WaitConsumed(seq_, timeout));
  TensorMeta m = meta;
  m.src_addr = reinterpret_cast<uint64_t>(data);
  auto* raw = static_cast<uint8_t*>(meta_src_->data());
  m.EncodeTo(raw);
  ASSIGN_OR_RETURN(OpHandle h,
                   channel_->Write(raw, *meta_src_, slot_->address(), *slot_,
                                   TensorMeta::kEncodedSize));
  RETURN_IF_ERROR(h.Wait());
  RETURN_IF_ERROR(channel_->Fence());
  ++seq_;
  StoreRelease(raw + TensorMeta::kEncodedSize, seq_);
  ASSIGN_OR_RETURN(
      OpHandle f,
      channel_->Write(raw + TensorMeta::kEncodedSize, *meta_src_,
                      slot_->address() + TensorMeta::kEncodedSize, *slot_, 8));
  RETURN_IF_ERROR(f.Wait());
  return seq_;
}

Status DynamicTensorSender::WaitConsumed(uint64_t seq,
                                         std::chrono::nanoseconds timeout) {
  return WaitWord(credit_->data(), seq, timeout, *channel_, "receiver credit");
}

}  // namespace membox::transport
