// Channel: a connection to one remote device on one lane (seed 002 §3.1: a
// channel corresponds to a queue pair). It moves bytes between local
// MemRegions and imported remote regions with one-sided Memcpy, and carries
// small two-sided control messages (the paper's auxiliary "vanilla RPC") used
// to hand descriptors over.
//
// Completion semantics of Memcpy, per direction:
//   kWrite (local -> remote): completion means the local buffer may be
//     reused. The data is visible to the remote process only after a later
//     Flush() completes, or -- for ordering only -- after a Fence() and a
//     subsequent write that the remote side observes (the tail-flag protocol,
//     see tensor_transfer.h).
//   kRead (remote -> local): completion means the data is in the local buffer.
//
// Protocol per transport (chosen when the channel connects, reported by
// protocol()):
//   kMapped  peer on this host and the remote region device-allocated: the
//            region is mapped into this process and Memcpy is a plain memcpy
//            done in the caller's thread (completes during the call);
//   kRma     UCX one-sided put/get (shared memory cross-memory attach,
//            InfiniBand/RoCE verbs);
//   kActiveMessage  UCX active messages carrying the data; the peer's
//            progress thread places it after validating the target range.
//            Forced with ProtocolChoice::kActiveMessage (measurement).
//   kTcp     membox's own data path over the authenticated TCP connection
//            (between hosts without RDMA, and for transports = "tcp"): the
//            peer's reader thread places writes after validating the target
//            range (src/transport/net/tcp_channel.h).
//
// Ordering between a read and earlier writes on the same channel is not
// guaranteed (UCX RMA does not order them; membox's TCP path lets a read
// request overtake queued writes): a read that must observe a write waits
// for that write's Flush().
//
// Pending operations per buffer: any number of reads may be pending against
// one local buffer; while a write from a buffer or a read into it is pending,
// the caller must not modify (write) or read (read) that buffer. Overlapping
// remote ranges written by concurrent writes land in an unspecified order
// unless separated by Fence().
//
// Failure: when the peer dies or the link breaks, pending operations complete
// with kUnavailable naming the peer, and later calls fail fast with the same
// error. Bad arguments (range outside a region, region not imported on this
// channel) fail the call with kOutOfRange / kInvalidArgument and start
// nothing.
//
// Thread-safety: all methods may be called from any thread concurrently.
// Ownership: channels are shared_ptrs owned jointly by the Device and users;
// they must not outlive the Device.
#ifndef MEMBOX_TRANSPORT_CHANNEL_H_
#define MEMBOX_TRANSPORT_CHANNEL_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "membox/base/credential.h"
#include "membox/base/status.h"
#include "membox/transport/mem_region.h"
#include "membox/transport/op_handle.h"

namespace membox::transport {

enum class Direction { kRead, kWrite };
enum class Protocol { kMapped, kRma, kActiveMessage, kTcp };
const char* ProtocolName(Protocol p);

// A remote region imported on one channel: validated with its owner (address
// range and access token) and with the transport key unpacked.
class RemoteMemRegion {
 public:
  virtual ~RemoteMemRegion() = default;
  const RegionDescriptor& descriptor() const { return desc_; }
  uint64_t address() const { return desc_.address; }
  uint64_t size() const { return desc_.length; }
  // Local pointer to the region's first byte when the peer's memory is mapped
  // into this process (same host, device-allocated region); else nullptr.
  void* mapped() const { return mapped_; }
  bool Contains(uint64_t addr, uint64_t n) const {
    return addr >= desc_.address && n <= desc_.length &&
           addr - desc_.address <= desc_.length - n;
  }

 protected:
  RemoteMemRegion(RegionDescriptor d, void* mapped)
      : desc_(std::move(d)), mapped_(mapped) {}

 private:
  RegionDescriptor desc_;
  void* mapped_;
};

class Channel {
 public:
  virtual ~Channel() = default;

  // Imports a peer's region for use on this channel. Performs one round trip
  // to the owner, which checks that the region exists with this token and
  // range: a wrong or stale descriptor fails here with kPermissionDenied or
  // kNotFound, never later as a stray write. Blocking; do not call from a
  // completion callback. `verify_with_owner = false` skips the round trip
  // for a descriptor the peer itself just sent on this channel (e.g. in an
  // authenticated reply); active-message accesses are still checked.
  virtual Result<std::shared_ptr<RemoteMemRegion>> Import(
      const RegionDescriptor& desc,
      std::chrono::nanoseconds timeout = std::chrono::seconds(10),
      bool verify_with_owner = true) = 0;

  // Seed 002 Table 1's Memcpy: copies `size` bytes between `local_addr`
  // (inside `local`) and `remote_addr` (inside `remote`). See the file comment
  // for what completion means.
  virtual Result<OpHandle> Memcpy(void* local_addr, const MemRegion& local,
                                  uint64_t remote_addr,
                                  const RemoteMemRegion& remote, size_t size,
                                  Direction direction,
                                  Completion callback = nullptr) = 0;

  Result<OpHandle> Write(const void* local_addr, const MemRegion& local,
                         uint64_t remote_addr, const RemoteMemRegion& remote,
                         size_t size, Completion cb = nullptr) {
    return Memcpy(const_cast<void*>(local_addr), local, remote_addr, remote,
                  size, Direction::kWrite, std::move(cb));
  }
  Result<OpHandle> Read(void* local_addr, const MemRegion& local,
                        uint64_t remote_addr, const RemoteMemRegion& remote,
                        size_t size, Completion cb = nullptr) {
    return Memcpy(local_addr, local, remote_addr, remote, size,
                  Direction::kRead, std::move(cb));
  }

  // Orders writes: a write issued after Fence() never becomes visible at the
  // peer before any write issued before it on this channel. Cheap on kMapped
  // (a release fence) and kRma (ucp_worker_fence); on kActiveMessage it waits
  // for local completion of the earlier writes.
  virtual Status Fence() = 0;
  // Completes when every write issued before it is visible at the peer.
  virtual Result<OpHandle> Flush(Completion callback = nullptr) = 0;

  // Control messages: small (<= kMaxControlMessage bytes), reliable, ordered,
  // two-sided. SendControl copies `msg` and returns when it is queued.
  // RecvControl returns the next message or kDeadlineExceeded.
  virtual Status SendControl(std::span<const uint8_t> msg) = 0;
  virtual Result<std::vector<uint8_t>> RecvControl(
      std::chrono::nanoseconds timeout) = 0;
  static constexpr size_t kMaxControlMessage = 1 << 20;

  // Event-driven alternative to RecvControl for servers: once set, every
  // control message (including ones already queued) is handed to `on_message`
  // on the device's progress thread, and `on_failure` runs once when the
  // channel fails. Handlers must be quick and must not block (queue the work).
  // Set them once, before the peer can send; they must outlive the channel.
  using ControlHandler = std::function<void(std::vector<uint8_t>)>;
  using FailureHandler = std::function<void(const Status&)>;
  virtual void SetHandlers(ControlHandler on_message,
                           FailureHandler on_failure) = 0;

  // Drives this channel's progress engine once from the calling thread.
  // Threads that poll for data arriving through kActiveMessage / kRma call it
  // while they wait, which saves a progress-thread wake-up per message. Cheap
  // and a no-op on kMapped. Never required for correctness.
  virtual void Progress() = 0;

  // Closes the channel: pending operations complete with kAborted, later
  // calls fail, the peer sees the connection drop. When it returns, no
  // handler (SetHandlers) runs or will run any more -- a call in progress
  // on another thread has finished -- so what they captured may be
  // destroyed (a handler call the calling thread itself is inside of is
  // not waited for). Idempotent.
  virtual void Close() = 0;

  virtual Protocol protocol() const = 0;
  // OK while the peer is reachable; the failure that closed the channel after.
  virtual Status health() const = 0;
  virtual int lane() const = 0;
  // "host:port" for channels this side opened; the peer's device name for
  // accepted ones.
  virtual std::string peer() const = 0;

  // Who the peer proved to be in the handshake (base/credential.h). For an
  // accepted channel: the cluster, or the principal of its credential. For
  // a channel this side opened: the cluster (the server proved the key this
  // side holds). Set by the device before the channel is handed out; never
  // changes after.
  const Principal& principal() const { return principal_; }
  void set_principal(Principal p) { principal_ = std::move(p); }

 private:
  Principal principal_;
};

}  // namespace membox::transport

#endif  // MEMBOX_TRANSPORT_CHANNEL_H_
