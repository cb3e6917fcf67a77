// UcxChannel: one ucp_ep (a lane to one peer). See channel.h for the public
// contract and ucx_device.h for the structure.
//
// Ordering argument for kActiveMessage (why the tail flag never overtakes the
// data): active messages on one ep travel over one TCP lane in order and are
// handled by the peer's progress thread in arrival order; an eager write is
// copied into place inside the handler, a rendezvous write is received
// straight into place and its sender-side completion happens only after the
// peer finished receiving. Fence() waits until every earlier write on this
// channel completed locally, so any later write is handled after all earlier
// data is in place.
#ifndef MEMBOX_SRC_TRANSPORT_UCX_UCX_CHANNEL_H_
#define MEMBOX_SRC_TRANSPORT_UCX_UCX_CHANNEL_H_

#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include <ucp/api/ucp.h>

#include "membox/base/mutex.h"
#include "membox/transport/channel.h"

#include "src/transport/am_messages.h"
#include "src/transport/control_inbox.h"
#include "src/transport/fresh_mapping.h"
#include "src/transport/message_rma.h"
#include "src/transport/shared_file.h"
#include "src/transport/ucx/ucx_device.h"

namespace membox::transport::ucx {

class UcxRemoteMemRegion final : public RemoteMemRegion {
 public:
  UcxRemoteMemRegion(RegionDescriptor d, void* mapped, ucp_rkey_h rkey,
                     const void* channel, SharedMapping file = {})
      : RemoteMemRegion(std::move(d), mapped),
        rkey_(rkey),
        channel_(channel),
        file_(std::move(file)) {}
  ~UcxRemoteMemRegion() override {
    // The owner's memory mapped by the rkey (not a shared file's mapping,
    // which TSan sees) goes with it.
    if (mapped() && !file_.data()) ReleasedMapping(mapped(), size());
    if (rkey_) ucp_rkey_destroy(rkey_);
  }
  ucp_rkey_h rkey() const { return rkey_; }
  const void* channel() const { return channel_; }

 private:
  ucp_rkey_h rkey_;      // unpacked for one ep; null on kActiveMessage
  const void* channel_;  // the channel that imported it
  SharedMapping file_;   // the owner's shared file, mapped (same host)
};

class UcxChannel final : public Channel,
                         public std::enable_shared_from_this<UcxChannel> {
 public:
  UcxChannel(UcxDevice* dev, UcxWorker* worker, int lane, std::string peer,
             bool accepted);
  ~UcxChannel() override;

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
  void Progress() override;
  void SetHandlers(ControlHandler on_message,
                   FailureHandler on_failure) override;
  Protocol protocol() const override { return protocol_; }
  Status health() const override;
  int lane() const override { return lane_; }
  std::string peer() const override;

  // --- internal ---
  // Creates the data endpoint from the peer's hello (authenticated by the
  // handshake) and picks the protocol.
  Status ConnectData(const msg::Hello& peer);
  // The channel's TCP connection: watched by the device for liveness, shut
  // down by Close() so the peer sees the channel drop.
  void set_liveness(net::Fd fd) { liveness_ = std::move(fd); }
  void set_id(uint64_t id) { id_ = id; }
  uint64_t id() const { return id_; }
  UcxWorker* worker() const { return worker_; }
  void Fail(const Status& s);
  // Sends an internal active message. `hdr` is copied. `data` must stay valid
  // until `state` completes (nullptr state: fire and forget for small data).
  Status SendAm(AmId id, const std::vector<uint8_t>& hdr, const void* data,
                size_t len, std::shared_ptr<OpState> state);
  // Handlers, called on the progress thread.
  ucs_status_t OnAm(AmId id, const void* header, size_t hlen, void* data,
                    size_t len, const ucp_am_recv_param_t* param);
  void Close() override;
  void Track(const std::shared_ptr<OpState>& st);    // a pending UCX request
  void Untrack(const std::shared_ptr<OpState>& st);  // its completion

 private:
  Protocol ChooseProtocol() const;
  Status CheckUsable() const;
  // Posts one UCX request through `post` and routes its completion to
  // `state` (done now, pending and tracked, or an error with no completion).
  Status Submit(
      const std::shared_ptr<OpState>& state, const char* what,
      const std::function<ucs_status_ptr_t(ucp_ep_h, ucp_request_param_t*)>&
          post);
  Status CreateDataEp(const std::vector<uint8_t>& peer_address);

 public:
  // Sets `ep`'s error mode and routes endpoint errors to ch->Fail().
  static void SetErrorHandling(ucp_ep_params_t* ep, UcxChannel* ch,
                               ucp_err_handling_mode_t mode);

 private:
  Result<OpHandle> AmWrite(const void* local, uint64_t raddr,
                           const RemoteMemRegion& remote, size_t size,
                           Completion cb);
  Result<OpHandle> AmRead(void* local, uint64_t raddr,
                          const RemoteMemRegion& remote, size_t size,
                          Completion cb);
  // Fails this channel (if it still exists) when a range it holds a lease
  // on is revoked and the access does not finish in time.
  ExportTable::Fence FenceFor();
  void RecvInto(void* data_desc, void* dst, size_t len,
                const ucp_am_recv_param_t* p,
                std::function<void(const Status&)> done);
  // Sends a request registered with rma_ (withdrawn if it cannot be sent).
  Status SendRequest(AmId id, Result<MessageRma::Request> request);
  void SendError(const Status& s);
  // A rendezvous write is in place: sends the flush answers it held back.
  void WriteReceived();

  UcxDevice* dev_;
  UcxWorker* worker_;
  int lane_;
  std::string peer_;
  bool accepted_;
  net::Fd liveness_;  // the authenticated TCP connection
  // Set by the one Close() that shuts liveness_ down (Close may run on
  // several threads at once).
  std::atomic<bool> liveness_closed_{false};
  // The data endpoint, from the peer's worker address. A UCX call on it
  // runs inside an EndpointUse (ep_users_ counted, seq_cst); Close() takes
  // the endpoint out of ep_ and waits for the users inside before closing
  // it, so no call ever runs on a closed endpoint. No lock: a sender may
  // be called from a UCX callback that holds the worker's own lock.
  std::atomic<ucp_ep_h> ep_{nullptr};
  std::atomic<int> ep_users_{0};
  class EndpointUse;
  uint64_t id_ = 0;         // our channel id (peers put it in headers)
  uint64_t remote_id_ = 0;  // the peer's id for this channel
  std::atomic<bool> data_ready_{false};
  bool data_ep_peer_errors_ = true;  // data ep in UCP_ERR_HANDLING_MODE_PEER
  Protocol protocol_ = Protocol::kRma;
  bool peer_same_host_ = false;
  std::atomic<bool> failed_{false};
  // Counted in the device's live UCX channels until the first Close().
  std::atomic<bool> open_{true};
  std::atomic<bool> rma_since_fence_{false};  // an RMA write awaits a fence
  std::atomic<bool> rma_since_flush_{false};  // an RMA write awaits a flush
  std::atomic<int64_t> am_writes_in_flight_{0};
  // UCX requests of this channel not completed yet (Close waits for them).
  std::shared_ptr<std::atomic<int64_t>> requests_ =
      std::make_shared<std::atomic<int64_t>>(0);

  mutable Mutex mu_;
  Status failure_ MEMBOX_GUARDED_BY(mu_);
  std::set<std::shared_ptr<OpState>> inflight_ MEMBOX_GUARDED_BY(mu_);
  std::string peer_name_ MEMBOX_GUARDED_BY(mu_);
  std::string peer_host_ MEMBOX_GUARDED_BY(mu_);
  // Imports' checks, and reads, writes and flushes in kActiveMessage.
  MessageRma rma_;
  ControlInbox inbox_;

  // Control messages are numbered by the sender and delivered in that
  // order: UCX keeps no order across protocols (a rendezvous message
  // completes after an eager one sent later). Messages that overtook a
  // missing one wait here, within a bound (the peer is authenticated, but
  // a bug must not grow this without end).
  static constexpr uint64_t kMaxEarlyControl = 1 << 16;
  static constexpr size_t kMaxEarlyControlBytes = size_t{1} << 30;
  void DeliverInOrder(uint64_t seq, std::vector<uint8_t> m);
  std::atomic<uint64_t> control_out_{1};  // numbers start at 1
  Mutex control_in_mu_;
  uint64_t control_in_next_ MEMBOX_GUARDED_BY(control_in_mu_) = 1;
  std::map<uint64_t, std::vector<uint8_t>> control_early_
      MEMBOX_GUARDED_BY(control_in_mu_);
  size_t control_early_bytes_ MEMBOX_GUARDED_BY(control_in_mu_) = 0;
  friend class UcxDevice;
};

}  // namespace membox::transport::ucx

#endif  // MEMBOX_SRC_TRANSPORT_UCX_UCX_CHANNEL_H_
