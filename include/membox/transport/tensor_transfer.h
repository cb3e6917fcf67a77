// The two tensor-transfer protocols of seed 002 §3.2-3.3, built only on the
// public Device / Channel API.
//
// Static placement (§3.2, Fig. 5). The receiver preallocates the tensor
// buffer followed by an 8-byte tail flag and hands its descriptor to the
// sender once. Send() writes the data, fences, then writes the flag (the
// tensor's sequence number). The receiver polls the flag, hands the tensor on,
// and Release() clears the flag and returns a credit to the sender by writing
// the consumed sequence number into the sender's credit word. The sender
// never overwrites a tensor the receiver has not released.
//
// Dynamic allocation (§3.3, Fig. 6). The receiver preallocates a fixed-size
// metadata slot (dtype, dims, byte size, the tensor's address at the sender)
// with a tail flag. Send() writes the metadata and flag; Receive() polls the
// flag, validates the metadata (it crossed a process boundary), allocates
// from its registered pool, one-sided reads the data from the sender's pool,
// clears the flag and returns a credit, after which the sender may reuse the
// source buffer.
//
// Why the flag is never visible before the data, per protocol:
//   kMapped         data and flag are CPU stores separated by a release fence
//                   (Channel::Fence); the receiver loads the flag with
//                   acquire semantics;
//   kRma            ucp_worker_fence between the data put and the flag put;
//                   UCX applies operations after a fence only once earlier
//                   ones completed remotely (the paper relied on in-order
//                   NIC writes instead);
//   kActiveMessage  Fence waits for local completion of the data write, and
//                   the peer handles messages of one channel in order.
// The flag is an aligned 8-byte word, written by one store.
//
// Threading: each sender/receiver is used by one thread at a time.
// Completion: Send returns when the local buffer may be reused (static) or
// when the metadata is queued (dynamic: see WaitConsumed).
#ifndef MEMBOX_TRANSPORT_TENSOR_TRANSFER_H_
#define MEMBOX_TRANSPORT_TENSOR_TRANSFER_H_

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "membox/base/dtype.h"
#include "membox/base/status.h"
#include "membox/transport/channel.h"
#include "membox/transport/device.h"
#include "membox/transport/registered_pool.h"

namespace membox::transport {

// Tensor metadata written into the receiver's slot (dynamic protocol).
struct TensorMeta {
  static constexpr int kMaxDims = 8;
  static constexpr size_t kEncodedSize = 128;  // incl. checksum; flag follows
  DType dtype = DType::kFloat32;
  uint8_t ndims = 0;
  std::array<uint64_t, kMaxDims> dims{};
  uint64_t nbytes = 0;    // == product(dims) * DTypeSize(dtype)
  uint64_t src_addr = 0;  // address of the data in the sender's pool

  static TensorMeta Make(DType dtype, std::span<const uint64_t> dims);
  void EncodeTo(uint8_t out[kEncodedSize]) const;
  // Validates: known dtype, ndims <= kMaxDims, nbytes == product * size with
  // no overflow, nbytes <= max_bytes, checksum.
  static Result<TensorMeta> Decode(std::span<const uint8_t> in,
                                   uint64_t max_bytes);
};

class StaticTensorReceiver {
 public:
  static Result<std::unique_ptr<StaticTensorReceiver>> Create(
      Device& device, std::shared_ptr<Channel> channel, size_t bytes,
      std::chrono::nanoseconds timeout = std::chrono::seconds(10));
  ~StaticTensorReceiver();

  bool Poll() const;  // the next tensor has fully arrived
  Status Wait(std::chrono::nanoseconds timeout);
  void* data() const { return buf_->data(); }
  size_t size() const { return bytes_; }
  // Clears the flag and gives the sender the credit to write again.
  Status Release();

 private:
  StaticTensorReceiver() = default;
  std::shared_ptr<Channel> channel_;
  std::unique_ptr<MemRegion> buf_;  // tensor bytes, then the flag word
  std::unique_ptr<MemRegion> credit_src_;
  std::shared_ptr<RemoteMemRegion> sender_credit_;
  size_t bytes_ = 0;
  size_t flag_off_ = 0;
  uint64_t expect_ = 1;
};

class StaticTensorSender {
 public:
  static Result<std::unique_ptr<StaticTensorSender>> Create(
      Device& device, std::shared_ptr<Channel> channel,
      std::chrono::nanoseconds timeout = std::chrono::seconds(10));
  ~StaticTensorSender();

  size_t capacity() const { return capacity_; }
  // Writes `bytes` (<= capacity) from `src` inside `region`, then the flag.
  // Waits (up to `timeout`) for the receiver to release the previous tensor.
  Status Send(const void* src, const MemRegion& region, size_t bytes,
              std::chrono::nanoseconds timeout = std::chrono::seconds(60));
  // Returns once the receiver released every tensor sent so far.
  Status WaitReleased(std::chrono::nanoseconds timeout);

 private:
  StaticTensorSender() = default;
  std::shared_ptr<Channel> channel_;
  std::shared_ptr<RemoteMemRegion> dst_;
  std::unique_ptr<MemRegion> credit_;  // the receiver writes consumed seqs here
  std::unique_ptr<MemRegion> flag_src_;
  size_t capacity_ = 0;
  uint64_t seq_ = 0;
};

struct ReceivedTensor {
  TensorMeta meta;
  RegisteredPool::Block block;  // the tensor's bytes, in the receiver's pool
};

class DynamicTensorReceiver {
 public:
  static Result<std::unique_ptr<DynamicTensorReceiver>> Create(
      Device& device, std::shared_ptr<Channel> channel, size_t pool_bytes,
      std::chrono::nanoseconds timeout = std::chrono::seconds(10));
  ~DynamicTensorReceiver();
  Result<ReceivedTensor> Receive(std::chrono::nanoseconds timeout);

 private:
  DynamicTensorReceiver() = default;
  std::shared_ptr<Channel> channel_;
  std::unique_ptr<MemRegion> slot_;  // metadata, then the flag word
  std::shared_ptr<RegisteredPool> pool_;
  std::unique_ptr<MemRegion> credit_src_;
  std::shared_ptr<RemoteMemRegion> sender_pool_;
  std::shared_ptr<RemoteMemRegion> sender_credit_;
  uint64_t expect_ = 1;
};

class DynamicTensorSender {
 public:
  static Result<std::unique_ptr<DynamicTensorSender>> Create(
      Device& device, std::shared_ptr<Channel> channel, size_t pool_bytes,
      std::chrono::nanoseconds timeout = std::chrono::seconds(10));
  ~DynamicTensorSender();

  // Tensors to send live here, so sending never copies.
  RegisteredPool& pool() { return *pool_; }
  // Publishes the tensor `data` (inside pool()) described by `meta`; returns
  // its sequence number. Waits for the previous tensor to be consumed first.
  Result<uint64_t> Send(
      const TensorMeta& meta, const void* data,
      std::chrono::nanoseconds timeout = std::chrono::seconds(60));
  // Returns once the receiver has read tensor `seq` (its buffer is free).
  Status WaitConsumed(uint64_t seq, std::chrono::nanoseconds timeout);

 private:
  DynamicTensorSender() = default;
  std::shared_ptr<Channel> channel_;
  std::shared_ptr<RemoteMemRegion> slot_;
  std::shared_ptr<RegisteredPool> pool_;
  std::unique_ptr<MemRegion> credit_;
  std::unique_ptr<MemRegion> meta_src_;
  uint64_t seq_ = 0;
};

}  // namespace membox::transport

#endif  // MEMBOX_TRANSPORT_TENSOR_TRANSFER_H_
