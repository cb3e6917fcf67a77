// MessageRma: membox's one-sided operations carried as messages, written
// once for every channel whose data path has no RMA of its own:
// net::TcpChannel, and a ucx::UcxChannel in Protocol::kActiveMessage (every
// UcxChannel also checks its imports with it).
//
// The channel moves bytes; this class keeps what the messages mean
// (headers: am_messages.h, docs/formats/wire_protocol.md):
//   requester side  numbers each validate, read and flush request, keeps it
//                   pending until its answer comes or the channel fails, and
//                   matches the answer to it;
//   owner side      decodes each incoming request and checks it against the
//                   owner's export table (ChannelHost): the answer's header,
//                   and for writes and reads the exact range with its lease;
//                   a flush is answered once every write received before it
//                   is in place;
//   errors          what the peer reports about rejected writes, kept for
//                   the next Flush.
// A malformed header, or an answer to no pending request, is returned as an
// error: the channel decides whether that fails it (TCP: one stream, it
// must) or drops the message (UCX).
//
// Ownership: holds the pending requests' states; borrows the host, which
// must outlive it.
// Threading: every method may be called from any thread. One internal lock,
// never held while a state completes or the host is called.
// Completion: a pending request's state completes exactly once, with its
// answer or with the failure given to Close(); after Close every new request
// fails at once with that failure.
#ifndef MEMBOX_SRC_TRANSPORT_MESSAGE_RMA_H_
#define MEMBOX_SRC_TRANSPORT_MESSAGE_RMA_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "membox/base/mutex.h"
#include "membox/base/status.h"
#include "membox/transport/mem_region.h"
#include "membox/transport/op_handle.h"

#include "src/transport/channel_host.h"
#include "src/transport/export_table.h"

namespace membox::transport {

class MessageRma {
 public:
  // `host_memory_only`: imports are checked as host memory (a data path that
  // copies with the CPU); otherwise GPU regions pass the import check too.
  MessageRma(ChannelHost* host, bool host_memory_only)
      : host_(host), host_memory_only_(host_memory_only) {}
  MessageRma(const MessageRma&) = delete;
  MessageRma& operator=(const MessageRma&) = delete;

  // --- requester side ---
  struct Request {
    uint64_t id = 0;
    std::vector<uint8_t> header;  // to send as the request's header
  };
  // Each registers `state` as pending under a fresh id; the channel's failure
  // once Close ran.
  Result<Request> Validate(const RegionDescriptor& desc,
                           std::shared_ptr<OpState> state);
  Result<Request> Read(void* local, size_t len, uint64_t remote_addr,
                       const RegionDescriptor& remote,
                       std::shared_ptr<OpState> state);
  Result<Request> Flush(std::shared_ptr<OpState> state);
  // Forgets a request that could not be sent (its state is not completed).
  void Withdraw(uint64_t id);
  // An import's check with the owner: registers a validate request on
  // `state`, sends its header with `send`, and waits up to `timeout` for
  // the answer. At the deadline the state is completed here and the
  // request stays registered, so a late answer is taken and changes
  // nothing. Errors name the region.
  Status CheckWithOwner(const RegionDescriptor& desc,
                        std::shared_ptr<OpState> state,
                        std::chrono::nanoseconds timeout,
                        const std::function<Status(const Request&)>& send);
  // A write's header: no answer comes (a rejection arrives as an error).
  static std::vector<uint8_t> WriteHeader(uint64_t remote_addr,
                                          const RegionDescriptor& remote,
                                          size_t len);

  // Answers. Validate and flush answers complete their request here.
  Status OnValidateAnswer(std::span<const uint8_t> header);
  Status OnFlushAnswer(std::span<const uint8_t> header);
  // Where a read answer's `payload_len` bytes go: the channel receives them
  // into `local` and then completes `state` with the receive's status. With
  // `local` null the read failed at the owner, its state is completed and no
  // payload follows. An answer of the wrong length completes the read with
  // kDataLoss and returns an error.
  struct ReadTarget {
    void* local = nullptr;
    size_t len = 0;
    std::shared_ptr<OpState> state;
  };
  Result<ReadTarget> OnReadAnswer(std::span<const uint8_t> header,
                                  uint64_t payload_len);
  // An error the peer reports (a rejected write): kept, the first one wins,
  // until TakeAsyncError.
  Status OnError(std::span<const uint8_t> header, const std::string& peer);
  // The kept error (then cleared), OK if none.
  Status TakeAsyncError();

  // --- owner side ---
  // The validate answer's header: region, token, range and key bytes checked.
  Result<std::vector<uint8_t>> AnswerValidate(std::span<const uint8_t> header);
  // A write of `payload_len` bytes. `refused` not OK: the payload is to be
  // discarded and `error_header` sent back (an error frame); otherwise the
  // payload goes to `dst`, holding `lease` until it is in place. `fence`
  // fails the channel if the range is revoked meanwhile.
  struct IncomingWrite {
    Status refused;
    std::vector<uint8_t> error_header;
    void* dst = nullptr;
    ExportTable::Lease lease;
  };
  Result<IncomingWrite> AdmitWrite(std::span<const uint8_t> header,
                                   uint64_t payload_len,
                                   ExportTable::Fence fence);
  // A read request's answer: its header, and (on success) the registered
  // range itself as payload, with its lease, to hold until the last byte is
  // sent (zero copy).
  struct ReadAnswer {
    std::vector<uint8_t> header;
    const void* src = nullptr;
    size_t len = 0;
    ExportTable::Lease lease;
  };
  Result<ReadAnswer> AnswerRead(std::span<const uint8_t> header,
                                ExportTable::Fence fence);
  // A flush request: its answer's header now, or nullopt when writes are
  // still being received (BeginWrite/EndWrite); it is then among what
  // EndWrite returns.
  Result<std::optional<std::vector<uint8_t>>> OnFlushRequest(
      std::span<const uint8_t> header);
  // Brackets a write whose payload arrives after its header was handled
  // (UCX rendezvous). EndWrite returns the flush answers now due.
  void BeginWrite();
  std::vector<std::vector<uint8_t>> EndWrite();
  // The header of an error frame reporting `s` to the peer.
  static std::vector<uint8_t> ErrorHeader(const Status& s);

  // Completes every pending request with `failure`; later requests fail
  // with it. Idempotent: the first failure stays.
  void Close(const Status& failure);
  // Requests waiting for an answer (tests).
  size_t pending() const;

 private:
  struct PendingRead {
    void* local;
    size_t len;
    std::shared_ptr<OpState> state;
  };
  Result<uint64_t> AddRpc(std::shared_ptr<OpState> state);
  Result<std::shared_ptr<OpState>> TakeRpc(uint64_t id);

  ChannelHost* const host_;
  const bool host_memory_only_;
  std::atomic<uint64_t> next_id_{1};
  mutable Mutex mu_;
  Status closed_ MEMBOX_GUARDED_BY(mu_);  // not OK once Close ran
  Status async_error_ MEMBOX_GUARDED_BY(mu_);
  std::map<uint64_t, PendingRead> reads_ MEMBOX_GUARDED_BY(mu_);
  std::map<uint64_t, std::shared_ptr<OpState>> rpcs_ MEMBOX_GUARDED_BY(mu_);
  int64_t writes_receiving_ MEMBOX_GUARDED_BY(mu_) = 0;
  std::vector<uint64_t> deferred_flushes_ MEMBOX_GUARDED_BY(mu_);
};

}  // namespace membox::transport

#endif  // MEMBOX_SRC_TRANSPORT_MESSAGE_RMA_H_
