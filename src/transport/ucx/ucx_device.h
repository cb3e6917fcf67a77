// UCX (UCP) backend of the transport API. Internal: users see only
// include/membox/transport/*.h.
//
// Structure (mirrors seed 002 Fig. 4):
//   UcxDevice   one ucp_context; N UcxWorkers; the listener; the registry of
//               exported regions (checked by Import and by active-message
//               writes/reads); the channel table.
//   UcxWorker   one ucp_worker in UCS_THREAD_MODE_MULTI and the progress
//               thread that drives it (the paper's CQ polling thread).
//   UcxChannel  one ucp_ep on one worker: a lane to one peer.
//
// Connection set-up (docs/design/network_face.md): a channel starts as a
// plain TCP connection to the device's listener (net::Listener: the
// network thread, the handshake's first step, liveness watches). The two
// sides run the authenticated handshake
// (src/transport/net/handshake.h) and exchange their UCX worker addresses
// inside it; only then does the server pick the data path:
//   UCX     processes on one host (shared memory, cross-memory attach) and
//           hosts with RDMA: each side creates its data endpoint from the
//           other's worker address, and the TCP connection stays open as a
//           liveness detector (the network thread fails the channel when it
//           closes or resets);
//   TCP     otherwise: the connection itself becomes a net::TcpChannel.
// UCX never listens and never sees a byte from an unauthenticated peer: its
// connection manager is not used and its TCP transport is disabled. Every
// UCX data message starts with the receiving side's channel id, so dispatch
// does not depend on UCX endpoint matching.
//
// Active-message ids and their headers are in docs/formats/wire_protocol.md.
//
// Locking: UcxDevice::mu_ guards the tables; UcxChannel::mu_ guards its
// inbox and pending active-message operations. Neither lock is held while
// calling into UCX from a user thread, except ep creation under mu_.
#ifndef MEMBOX_SRC_TRANSPORT_UCX_UCX_DEVICE_H_
#define MEMBOX_SRC_TRANSPORT_UCX_UCX_DEVICE_H_

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <ucp/api/ucp.h>

#include "membox/base/mutex.h"
#include "membox/base/wait.h"
#include "membox/transport/device.h"

#include "src/transport/channel_host.h"
#include "src/transport/export_table.h"
#include "src/transport/net/handshake.h"
#include "src/transport/net/listener.h"
#include "src/transport/net/socket.h"
#include "src/transport/net/tcp_channel.h"

namespace membox::transport::ucx {

// Active-message ids (docs/formats/wire_protocol.md).
enum AmId : uint16_t {
  kAmControl = 3,
  kAmValidateReq = 4,
  kAmValidateResp = 5,
  kAmWrite = 6,
  kAmReadReq = 7,
  kAmReadResp = 8,
  kAmFlushReq = 9,
  kAmFlushResp = 10,
  kAmError = 11,
  kAmCount
};

Status UcsError(ucs_status_t st, const std::string& what);

class UcxDevice;
class UcxChannel;

class UcxWorker {
 public:
  UcxWorker(UcxDevice* dev, int index) : dev_(dev), index_(index) {}
  ~UcxWorker();
  Status Init(ucp_context_h ctx);
  void Start();
  void Stop();
  // Wakes the progress thread after a submission that returned a request.
  void Signal() { ucp_worker_signal(worker_); }
  // Progress from a waiting user thread, only while the progress thread is
  // blocked: it saves a wake-up when messages are sparse and never fights
  // the progress thread for UCX's worker lock when they are dense. A thread
  // that keeps helping (a caller spinning on its reply, a server loop
  // polling) becomes the worker's driver: the progress thread stops
  // spinning and sleeps until the helping stops (Loop), so a round trip
  // costs one busy thread per side instead of two fighting for a core.
  void HelpProgress() {
    if (!InBlockingWait()) {
      last_help_ns_.store(NowNs(), std::memory_order_relaxed);
    }
    if (sleeping_.load(std::memory_order_acquire)) ucp_worker_progress(worker_);
  }
  static void HelpProgress(void* self) {
    static_cast<UcxWorker*>(self)->HelpProgress();
  }
  // Delivers what the worker has already received (a dead peer's last
  // messages) before its channel is failed: progresses the worker from the
  // calling thread, as if it were the progress thread, until a pass finds
  // nothing (at most 1024 passes). Called by the network thread when a
  // peer's liveness connection drops; the hang-up can overtake the
  // peer's last messages, which UCX holds until a progress pass.
  void Drain();
  ucp_worker_h worker() const { return worker_; }
  // This worker's UCX address, which peers use to create data endpoints.
  const std::vector<uint8_t>& address() const { return address_; }
  int index() const { return index_; }

 private:
  void Loop();
  UcxDevice* dev_;
  int index_;
  ucp_worker_h worker_ = nullptr;
  std::vector<uint8_t> address_;
  int efd_ = -1;
  int epfd_ = -1;
  int stop_fd_ = -1;
  std::atomic<bool> stop_{false};
  std::atomic<bool> sleeping_{false};  // the progress thread is in epoll_wait
  std::atomic<int64_t> last_help_ns_{0};  // last HelpProgress (NowNs)
  static int64_t NowNs() {
    return std::chrono::steady_clock::now().time_since_epoch().count();
  }
  std::thread thread_;
};

using ExportedRegion = ExportTable::Entry;

class UcxDevice final : public Device, public ChannelHost {
 public:
  explicit UcxDevice(DeviceOptions options);
  ~UcxDevice() override;
  Status Init();

  Result<std::unique_ptr<MemRegion>> AllocateMemRegion(size_t bytes) override;
  using Device::RegisterMemRegion;
  Result<std::unique_ptr<MemRegion>> RegisterMemRegion(
      void* addr, size_t bytes, MemoryType type) override;
  Result<std::unique_ptr<MemRegion>> RegisterSharedMemRegion(
      void* addr, size_t bytes, int fd, uint64_t file_offset) override;
  bool SupportsMemoryType(MemoryType type) const override;
  Result<std::shared_ptr<Channel>> GetChannel(
      const std::string& remote_endpoint, int lane) override;
  Result<std::shared_ptr<Channel>> Accept(
      std::chrono::nanoseconds timeout) override;
  std::string listen_endpoint() const override { return listen_endpoint_; }
  void Progress() override {
    for (auto& w : workers_) w->HelpProgress();
  }
  bool HasPolledChannels() const override {
    return ucx_channels_.load(std::memory_order_relaxed) > 0;
  }
  // UcxChannel's constructor and its first Close() keep the count of open
  // UCX channels (HasPolledChannels).
  void ChannelOpened() {
    ucx_channels_.fetch_add(1, std::memory_order_relaxed);
  }
  void ChannelGone() { ucx_channels_.fetch_sub(1, std::memory_order_relaxed); }
  const DeviceOptions& options() const override { return options_; }
  uint64_t id() const override { return id_; }

  // --- internal, used by channels, regions and AM handlers ---
  ucp_context_h context() const { return ctx_; }
  EventCount* events() override { return &events_; }
  const std::string& host_id() const { return host_id_; }
  bool rdma_present() const { return rdma_present_; }
  void RegisterExport(uint64_t id, const ExportedRegion& r);
  void UnregisterExport(uint64_t id);
  // Checks an access against the export table (export_table.h): `addr`/`len`
  // must lie inside the region with id `region_id` whose token is `token`.
  Status CheckAccess(uint64_t region_id, const Token128& token, uint64_t addr,
                     uint64_t len, bool host_memory) override;
  // The same, holding the range until the returned lease is released;
  // `fence` fails the caller's channel if revocation cannot wait for it.
  Result<ExportTable::Lease> AcquireAccess(uint64_t region_id,
                                           const Token128& token, uint64_t addr,
                                           uint64_t len, bool host_memory,
                                           ExportTable::Fence fence) override;
  bool CheckRkeyCrc(uint64_t region_id, uint32_t crc) override;
  uint64_t NextRegionId() { return next_region_id_.fetch_add(1); }
  // This device's proof of its process for shared-file exports (mem_region.h
  // SharedFile): pid, the descriptor of a shared-memory file holding a
  // random value, and that value. Created on first use.
  Result<SharedFile> SharedFileProof();
  // A fresh capability (base/hmac.h): 128 CSPRNG bits.
  static Token128 RandomToken() { return Token128::Random(); }
  uint64_t NewChannelId();
  UcxChannel* ChannelForId(uint64_t id);  // data messages
  UcxWorker* NextAcceptWorker();
  UcxWorker* worker(size_t i) { return workers_[i % workers_.size()].get(); }
  int thread_index() const;  // index of the worker whose thread is calling
  // A UCX channel's TCP connection is watched by the listener's network
  // thread until the channel forgets it (Close).
  void WatchLiveness(int fd, const std::shared_ptr<UcxChannel>& ch);
  void ForgetLiveness(int fd);

 private:
  // The handshake's last step, on the listener's thread: checks the
  // client's proof, sends the verdict and makes the channel.
  void OnProof(net::Listener::Handshake& h);
  uint32_t LocalFlags() const;
  // Whether a channel to this peer runs over UCX (shared memory only with a
  // peer proven local, on connection `fd`).
  bool UseUcx(uint32_t peer_flags, const std::string& peer_host, int fd) const;
  // A first check of a peer's UCX worker address before UCX sees it.
  bool PlausibleUcxAddress(const std::vector<uint8_t>& address) const;
  // Builds the channel for an authenticated connection on either side. It
  // takes `fd` only when it succeeds: on an error the caller still holds
  // the connection (a server tells the peer why on it).
  Result<std::shared_ptr<Channel>> MakeChannel(
      net::Fd&& fd, net::DataPath path, const msg::Hello& peer,
      const std::shared_ptr<UcxChannel>& ucx, int lane,
      const std::string& peer_label, const Principal& principal);
  // The principal a peer's credential id names and the key its proof must
  // be made with; an error when this device cannot check such a proof.
  Result<std::pair<Principal, std::string>> KeyFor(
      const std::string& credential) const;
  void RegisterChannel(const std::shared_ptr<Channel>& ch);
  // Packs the remote key, records the export and wraps `memh` (unmapped on
  // failure).
  Result<std::unique_ptr<MemRegion>> FinishRegistration(
      ucp_mem_h memh, void* addr, size_t bytes, bool allocated,
      MemoryType type = MemoryType::kHost);
  static ucs_status_t AmHandler(void* arg, const void* header, size_t hlen,
                                void* data, size_t len,
                                const ucp_am_recv_param_t* param);

  Mutex proof_mu_;
  net::Fd proof_fd_ MEMBOX_GUARDED_BY(proof_mu_);
  std::array<uint8_t, 16> proof_ MEMBOX_GUARDED_BY(proof_mu_){};
  DeviceOptions options_;
  uint64_t id_;
  Credential own_;         // the key this device proves, and as whom
  Status own_init_error_;  // a malformed credential: Init() fails
  std::string host_id_;
  bool rdma_present_ = false;
  uint64_t ucx_memory_types_ = 0;  // ucp_context_query: UCS_BIT(type)
  ucp_context_h ctx_ = nullptr;
  std::vector<std::unique_ptr<UcxWorker>> workers_;
  std::string listen_endpoint_;
  std::unique_ptr<net::Listener> listener_;  // set by Init
  EventCount events_;
  std::atomic<uint64_t> next_region_id_{1};
  std::atomic<int> ucx_channels_{0};  // open UcxChannels

  Mutex mu_;
  ExportTable exports_;  // thread-safe on its own
  std::vector<std::shared_ptr<Channel>> channels_ MEMBOX_GUARDED_BY(mu_);
  std::unordered_map<uint64_t, std::shared_ptr<UcxChannel>> by_id_
      MEMBOX_GUARDED_BY(mu_);
  uint64_t next_channel_id_ MEMBOX_GUARDED_BY(mu_) = 1;
  std::map<std::pair<std::string, int>, std::shared_ptr<Channel>> out_
      MEMBOX_GUARDED_BY(mu_);
  std::deque<std::shared_ptr<Channel>> accept_q_ MEMBOX_GUARDED_BY(mu_);
  EventCount accept_ev_;
  std::atomic<int> accept_rr_{0};
};

}  // namespace membox::transport::ucx

#endif  // MEMBOX_SRC_TRANSPORT_UCX_UCX_DEVICE_H_
