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
// Connection set-up: a channel first connects a bootstrap endpoint through
// the UCX connection manager (sockaddr, TCP); over it the two sides exchange
// hello messages carrying their worker addresses, and each side then creates
// its data endpoint from the other's worker address. UCX 1.13 gives
// client-server endpoints TCP lanes only, while address-based endpoints get
// the best transports (shared memory / cross-memory attach on one host,
// verbs on a fabric). Every data message starts with the receiving side's
// channel id, so dispatch does not depend on UCX endpoint matching. The
// bootstrap endpoint stays open as a liveness detector: when the peer
// process dies its TCP connection resets at once.
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

#include "membox/base/wait.h"
#include "membox/transport/device.h"

namespace membox::transport::ucx {

// Active-message ids (docs/formats/wire_protocol.md).
enum AmId : uint16_t {
  kAmHello = 1,
  kAmHelloAck = 2,
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
  // the progress thread for UCX's worker lock when they are dense.
  void HelpProgress() {
    if (sleeping_.load(std::memory_order_acquire)) ucp_worker_progress(worker_);
  }
  static void HelpProgress(void* self) {
    static_cast<UcxWorker*>(self)->HelpProgress();
  }
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
  std::thread thread_;
};

struct ExportedRegion {
  uint64_t address;
  uint64_t length;
  uint64_t token;
  uint32_t rkey_crc;  // crc32 of the packed remote key handed out
};

class UcxDevice final : public Device {
 public:
  explicit UcxDevice(DeviceOptions options);
  ~UcxDevice() override;
  Status Init();

  Result<std::unique_ptr<MemRegion>> AllocateMemRegion(size_t bytes) override;
  Result<std::unique_ptr<MemRegion>> RegisterMemRegion(void* addr,
                                                       size_t bytes) override;
  Result<std::shared_ptr<Channel>> GetChannel(
      const std::string& remote_endpoint, int lane) override;
  Result<std::shared_ptr<Channel>> Accept(
      std::chrono::nanoseconds timeout) override;
  std::string listen_endpoint() const override { return listen_endpoint_; }
  const DeviceOptions& options() const override { return options_; }
  uint64_t id() const override { return id_; }

  // --- internal, used by channels, regions and AM handlers ---
  ucp_context_h context() const { return ctx_; }
  EventCount* events() { return &events_; }
  const std::string& host_id() const { return host_id_; }
  bool rdma_present() const { return rdma_present_; }
  void RegisterExport(uint64_t id, const ExportedRegion& r);
  void UnregisterExport(uint64_t id);
  // Checks an access against the export table. `addr`/`len` must lie inside
  // the region with id `region_id` whose token is `token`.
  Status CheckAccess(uint64_t region_id, uint64_t token, uint64_t addr,
                     uint64_t len);
  bool CheckRkeyCrc(uint64_t region_id, uint32_t crc);
  uint64_t NextRegionId() { return next_region_id_.fetch_add(1); }
  uint64_t RandomToken();
  UcxChannel* ChannelForEp(ucp_ep_h ep);  // bootstrap endpoints
  UcxChannel* ChannelForId(uint64_t id);  // data messages
  uint64_t AddChannelId(const std::shared_ptr<UcxChannel>& ch);
  UcxWorker* NextAcceptWorker();
  UcxWorker* worker(size_t i) { return workers_[i % workers_.size()].get(); }
  void OnConnRequest(ucp_conn_request_h req);
  void OnHello(UcxChannel* ch);  // acceptor side: hello arrived
  int thread_index() const;      // index of the worker whose thread is calling

 private:
  Status CreateListener();
  // Packs the remote key, records the export and wraps `memh` (unmapped on
  // failure).
  Result<std::unique_ptr<MemRegion>> FinishRegistration(ucp_mem_h memh,
                                                        void* addr,
                                                        size_t bytes,
                                                        bool allocated);
  static ucs_status_t AmHandler(void* arg, const void* header, size_t hlen,
                                void* data, size_t len,
                                const ucp_am_recv_param_t* param);

  DeviceOptions options_;
  uint64_t id_;
  std::string host_id_;
  bool rdma_present_ = false;
  ucp_context_h ctx_ = nullptr;
  std::vector<std::unique_ptr<UcxWorker>> workers_;
  ucp_listener_h listener_ = nullptr;
  std::string listen_endpoint_;
  EventCount events_;
  std::atomic<uint64_t> next_region_id_{1};

  std::mutex mu_;
  std::map<uint64_t, ExportedRegion> exports_;  // GUARDED_BY(mu_)
  std::unordered_map<ucp_ep_h, std::shared_ptr<UcxChannel>>
      by_ep_;  // GUARDED_BY(mu_)
  std::unordered_map<uint64_t, std::shared_ptr<UcxChannel>>
      by_id_;                     // GUARDED_BY(mu_)
  uint64_t next_channel_id_ = 1;  // GUARDED_BY(mu_)
  std::map<std::pair<std::string, int>, std::shared_ptr<UcxChannel>>
      out_;                                           // GUARDED_BY(mu_)
  std::deque<std::shared_ptr<UcxChannel>> accept_q_;  // GUARDED_BY(mu_)
  EventCount accept_ev_;
  std::mutex rng_mu_;
  uint64_t rng_state_;
  std::atomic<int> accept_rr_{0};
};

}  // namespace membox::transport::ucx

#endif  // MEMBOX_SRC_TRANSPORT_UCX_UCX_DEVICE_H_
