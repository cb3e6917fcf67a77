// TcpChannel: membox's own data path over one authenticated TCP connection
// (the Channel contract of include/membox/transport/channel.h, protocol
// kTcp). Used between hosts without RDMA and whenever a device is told
// `transports = "tcp"`; UCX keeps shared memory and RDMA (docs/design/
// network_face.md says why: UCX's TCP transport listens on every interface
// and aborts on malformed bytes).
//
// Frames (docs/formats/wire_protocol.md, "TCP data path"): a 16-byte header
// {u32 type, u32 header length, u64 payload length}, the header bytes (the
// same encodings as the active-message headers) and the payload. What the
// frames mean (requests pending, access checks, answers) is MessageRma's,
// shared with UCX's active-message path; this class moves them. Writes are
// received straight into the target region after the owner's export table
// has checked region, access token and range; reads are answered from the
// region itself, so neither side copies beyond the socket.
//
// Threads: one reader thread (applies writes in arrival order, answers
// requests, completes reads) and one writer thread (sends queued frames; a
// write's completion means its bytes are in the kernel, so the local buffer
// may be reused). A frame submitted while nothing is queued is first tried
// without blocking from the submitting thread; what the socket does not take
// goes to the writer, ahead of later frames. The reader never blocks on
// sending, so two peers reading from each other cannot deadlock. Ordering: one
// stream, applied in order, so Fence() is free and a flush answer proves every
// earlier write is in place.
//
// Ownership: shared. The device holds every channel until it Stop()s it
// (joining both threads) or, once it has failed and nobody else holds it,
// drops it from a thread of its own (RegisterChannel). So the last reference
// never goes on the reader or writer thread, whose loops still use the
// channel after a callback returns; a user's callback must not hold the
// only other reference past the device either.
//
// Failure: EOF, a reset, keepalive expiry or any malformed frame fails the
// channel: every pending operation completes with kUnavailable (or the
// protocol error) naming the peer.
#ifndef MEMBOX_SRC_TRANSPORT_NET_TCP_CHANNEL_H_
#define MEMBOX_SRC_TRANSPORT_NET_TCP_CHANNEL_H_

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "membox/base/mutex.h"
#include "membox/base/wait.h"
#include "membox/transport/channel.h"

#include "src/transport/channel_host.h"
#include "src/transport/control_inbox.h"
#include "src/transport/export_table.h"
#include "src/transport/message_rma.h"
#include "src/transport/net/socket.h"

namespace membox::transport::net {

enum TcpFrame : uint32_t {
  kTcpControl = 1,
  kTcpValidateReq = 2,
  kTcpValidateResp = 3,
  kTcpWrite = 4,
  kTcpReadReq = 5,
  kTcpReadResp = 6,
  kTcpFlushReq = 7,
  kTcpFlushResp = 8,
  kTcpError = 9,
};

class TcpChannel final : public Channel,
                         public std::enable_shared_from_this<TcpChannel> {
 public:
  // Takes the authenticated, blocking socket. `peer` names the other side in
  // errors ("host:port" or the peer device's name).
  TcpChannel(transport::ChannelHost* host, Fd fd, int lane, std::string peer);
  ~TcpChannel() override;
  void Start();

  Result<std::shared_ptr<RemoteMemRegion>> Import(
      const RegionDescriptor& desc, std::chrono::nanoseconds timeout,
      bool verify_with_owner) override;
  Result<OpHandle> Memcpy(void* local_addr, const MemRegion& local,
                          uint64_t remote_addr, const RemoteMemRegion& remote,
                          size_t size, Direction direction,
                          Completion callback) override;
  Status Fence() override;
  Result<OpHandle> Flush(Completion callback) override;
  Status SendControl(std::span<const uint8_t> msg) override;
  Result<std::vector<uint8_t>> RecvControl(
      std::chrono::nanoseconds timeout) override;
  void SetHandlers(ControlHandler on_message,
                   FailureHandler on_failure) override;
  void Progress() override {}
  void Close() override;
  // Close() and wait for the reader and writer threads to end, so nothing
  // touches the owning device afterwards (the device calls it before it
  // goes away; the destructor too).
  void Stop();
  Protocol protocol() const override { return Protocol::kTcp; }
  Status health() const override;
  int lane() const override { return lane_; }
  std::string peer() const override { return peer_; }

 private:
  struct OutFrame {
    uint32_t type = 0;
    uint8_t head[16];
    std::vector<uint8_t> header;
    const void* payload = nullptr;  // not owned (user buffer or region)
    size_t payload_len = 0;
    std::vector<uint8_t> owned;  // owned payload (control messages)
    size_t sent = 0;  // bytes of head + header + payload already sent
    std::shared_ptr<OpState> state;  // completed once sent (may be null)
    ExportTable::Lease lease;        // the exported range `payload` reads from
    size_t cost = 0;                 // counted in queued_cost_ while in sendq_
  };
  // What frames waiting in sendq_ may hold: their headers and owned
  // payloads, plus kFrameOverhead each. A peer that stops reading while it
  // keeps sending requests (whose answers queue here) fails the channel at
  // the limit instead of growing this process without bound.
  static constexpr size_t kFrameOverhead = 128;
  static constexpr size_t kMaxQueuedCost = size_t{64} << 20;
  Status Enqueue(uint32_t type, std::vector<uint8_t> header,
                 const void* payload, size_t len, std::vector<uint8_t> owned,
                 std::shared_ptr<OpState> state,
                 ExportTable::Lease lease = nullptr);
  // Fails this channel (if it still exists) when a range it holds a lease
  // on is revoked and the access does not finish in time.
  ExportTable::Fence FenceFor();
  void Fail(const Status& s);
  // Sends the rest of `f`; without `block`, only what the socket takes now.
  // True when the whole frame is out.
  Result<bool> SendSome(OutFrame& f, bool block);
  void ReaderLoop();
  void WriterLoop();
  Status HandleFrame(uint32_t type, std::vector<uint8_t>& header,
                     uint64_t payload_len);
  Status Discard(uint64_t n);
  // Sends a request registered with rma_ (withdrawn if it cannot be sent).
  Status SendRequest(uint32_t type, Result<MessageRma::Request> request);

  transport::ChannelHost* host_;
  Fd fd_;
  const int lane_;
  const std::string peer_;
  Mutex stop_mu_;  // serialises Stop() (device teardown vs destructor)
  std::thread reader_;
  std::thread writer_;
  std::atomic<bool> failed_{false};

  mutable Mutex mu_;
  CondVar send_cv_;
  Status failure_ MEMBOX_GUARDED_BY(mu_);
  std::deque<OutFrame> sendq_ MEMBOX_GUARDED_BY(mu_);
  size_t queued_cost_ MEMBOX_GUARDED_BY(mu_) = 0;
  bool sending_ MEMBOX_GUARDED_BY(mu_) =
      false;        // a thread owns the socket's send
  MessageRma rma_;  // reads, writes, imports and flushes as frames
  ControlInbox inbox_;
};

}  // namespace membox::transport::net

#endif  // MEMBOX_SRC_TRANSPORT_NET_TCP_CHANNEL_H_
