#include "src/transport/ucx/ucx_device.h"

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "membox/base/config.h"
#include "membox/base/logging.h"

#include "src/transport/ucx/ucx_channel.h"
#include "src/transport/wire.h"

namespace membox::transport {

Result<std::unique_ptr<Device>> Device::Create(const DeviceOptions& options) {
  if (options.progress_threads < 1 || options.progress_threads > 64) {
    return InvalidArgumentError("progress_threads must be in [1, 64]");
  }
  if (options.lanes_per_peer < 1 || options.lanes_per_peer > 64) {
    return InvalidArgumentError("lanes_per_peer must be in [1, 64]");
  }
  auto dev = std::make_unique<ucx::UcxDevice>(options);
  RETURN_IF_ERROR(dev->Init());
  return std::unique_ptr<Device>(std::move(dev));
}

const char* ProtocolName(Protocol p) {
  switch (p) {
    case Protocol::kMapped:
      return "mapped";
    case Protocol::kRma:
      return "rma";
    case Protocol::kActiveMessage:
      return "active-message";
  }
  return "?";
}

}  // namespace membox::transport

namespace membox::transport::ucx {

Status UcsError(ucs_status_t st, const std::string& what) {
  std::string msg = what + ": " + ucs_status_string(st);
  switch (st) {
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_REJECTED:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_CANCELED:
    case UCS_ERR_BUSY:
    case UCS_ERR_TIMED_OUT:
      return UnavailableError(std::move(msg));
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE:
    case UCS_ERR_EXCEEDS_LIMIT:
      return ResourceExhaustedError(std::move(msg));
    case UCS_ERR_INVALID_PARAM:
    case UCS_ERR_INVALID_ADDR:
      return InvalidArgumentError(std::move(msg));
    case UCS_ERR_UNSUPPORTED:
      return UnimplementedError(std::move(msg));
    default:
      return InternalError(std::move(msg));
  }
}

namespace {

std::string ReadFirstLine(const char* path) {
  std::ifstream in(path);
  std::string s;
  std::getline(in, s);
  return s;
}

Result<sockaddr_storage> Resolve(const std::string& endpoint, socklen_t* len,
                                 bool passive) {
  auto colon = endpoint.rfind(':');
  if (colon == std::string::npos || colon == 0) {
    return InvalidArgumentError("endpoint '" + endpoint + "' is not host:port");
  }
  std::string host = endpoint.substr(0, colon);
  std::string port = endpoint.substr(colon + 1);
  if (!host.empty() && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* res = nullptr;
  int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0 || res == nullptr) {
    return InvalidArgumentError("cannot resolve '" + endpoint +
                                "': " + gai_strerror(rc));
  }
  sockaddr_storage ss{};
  std::memcpy(&ss, res->ai_addr, res->ai_addrlen);
  *len = res->ai_addrlen;
  freeaddrinfo(res);
  return ss;
}

// One MemRegion registered with UCX.
class UcxMemRegion final : public MemRegion {
 public:
  UcxMemRegion(UcxDevice* dev, ucp_mem_h memh, void* data, size_t size,
               uint64_t id, bool allocated, uint64_t token,
               std::vector<uint8_t> rkey)
      : MemRegion(data, size, id, allocated),
        dev_(dev),
        memh_(memh),
        token_(token),
        rkey_(std::move(rkey)) {}
  ~UcxMemRegion() override {
    dev_->UnregisterExport(id());
    {
      std::lock_guard<std::mutex> l(mu_);
      for (uint64_t r : ranges_) dev_->UnregisterExport(r);
    }
    ucp_mem_unmap(dev_->context(), memh_);
  }
  Result<RegionDescriptor> ExportRange(uint64_t offset,
                                       uint64_t length) override {
    if (length == 0 || offset > size() || length > size() - offset) {
      return OutOfRangeError("ExportRange outside the region");
    }
    RegionDescriptor d = Export();
    d.address += offset;
    d.length = length;
    d.region_id = dev_->NextRegionId();
    d.token = dev_->RandomToken();
    dev_->RegisterExport(
        d.region_id,
        {d.address, length, d.token, wire::Crc32(rkey_.data(), rkey_.size())});
    std::lock_guard<std::mutex> l(mu_);
    ranges_.insert(d.region_id);
    return d;
  }
  void RevokeRange(uint64_t range_id) override {
    std::lock_guard<std::mutex> l(mu_);
    if (ranges_.erase(range_id) > 0) dev_->UnregisterExport(range_id);
  }
  RegionDescriptor Export() const override {
    RegionDescriptor d;
    d.address = reinterpret_cast<uint64_t>(data());
    d.length = size();
    d.region_id = id();
    d.token = token_;
    d.device_id = dev_->id();
    d.packed_rkey = rkey_;
    return d;
  }

 private:
  UcxDevice* dev_;
  ucp_mem_h memh_;
  uint64_t token_;
  std::vector<uint8_t> rkey_;
  std::mutex mu_;
  std::set<uint64_t> ranges_;  // GUARDED_BY(mu_): ids from ExportRange
};

struct AmHandlerArg {
  UcxDevice* dev;
  AmId id;
};

thread_local int tls_worker_index = -1;

}  // namespace

// ---------------------------------------------------------------- UcxWorker

UcxWorker::~UcxWorker() {
  Stop();
  if (worker_) ucp_worker_destroy(worker_);
  if (epfd_ >= 0) close(epfd_);
  if (stop_fd_ >= 0) close(stop_fd_);
}

Status UcxWorker::Init(ucp_context_h ctx) {
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_MULTI;
  ucs_status_t st = ucp_worker_create(ctx, &wp, &worker_);
  if (st != UCS_OK) return UcsError(st, "ucp_worker_create");
  ucp_address_t* addr = nullptr;
  size_t addr_len = 0;
  st = ucp_worker_get_address(worker_, &addr, &addr_len);
  if (st != UCS_OK) return UcsError(st, "ucp_worker_get_address");
  address_.assign(reinterpret_cast<uint8_t*>(addr),
                  reinterpret_cast<uint8_t*>(addr) + addr_len);
  ucp_worker_release_address(worker_, addr);
  st = ucp_worker_get_efd(worker_, &efd_);
  if (st != UCS_OK) efd_ = -1;
  epfd_ = epoll_create1(EPOLL_CLOEXEC);
  stop_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (epfd_ < 0 || stop_fd_ < 0) return InternalError("epoll/eventfd failed");
  epoll_event ev{};
  ev.events = EPOLLIN;
  if (efd_ >= 0) {
    ev.data.fd = efd_;
    epoll_ctl(epfd_, EPOLL_CTL_ADD, efd_, &ev);
  }
  ev.data.fd = stop_fd_;
  epoll_ctl(epfd_, EPOLL_CTL_ADD, stop_fd_, &ev);
  return Status::Ok();
}

void UcxWorker::Start() {
  thread_ = std::thread([this] { Loop(); });
}

void UcxWorker::Stop() {
  if (!thread_.joinable()) return;
  stop_.store(true);
  uint64_t one = 1;
  (void)!write(stop_fd_, &one, sizeof(one));
  thread_.join();
}

void UcxWorker::Loop() {
  tls_worker_index = index_;
  using Clock = std::chrono::steady_clock;
  auto last_activity = Clock::now();
  // Spin window after the last event: long enough to catch a reply that is
  // microseconds away, short enough not to matter to other processes.
  const auto spin_window = std::chrono::microseconds(50);
  while (!stop_.load(std::memory_order_relaxed)) {
    if (ucp_worker_progress(worker_) != 0) {
      last_activity = Clock::now();
      continue;
    }
    if (Clock::now() - last_activity < spin_window &&
        !MachineOversubscribed()) {
      CpuRelax();
      continue;
    }
    ucs_status_t st = ucp_worker_arm(worker_);
    if (st == UCS_ERR_BUSY) continue;
    epoll_event evs[2];
    sleeping_.store(true, std::memory_order_release);
    int n = epoll_wait(epfd_, evs, 2, 100);
    sleeping_.store(false, std::memory_order_release);
    if (n > 0) last_activity = Clock::now();
  }
}

// ---------------------------------------------------------------- UcxDevice

UcxDevice::UcxDevice(DeviceOptions options) : options_(std::move(options)) {
  std::random_device rd;
  rng_state_ = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
               static_cast<uint64_t>(getpid()) << 16;
  id_ = RandomToken();
  char hn[256] = {0};
  gethostname(hn, sizeof(hn) - 1);
  host_id_ =
      std::string(hn) + "/" + ReadFirstLine("/proc/sys/kernel/random/boot_id");
  std::error_code ec;
  rdma_present_ = std::filesystem::exists("/sys/class/infiniband", ec) &&
                  !std::filesystem::is_empty("/sys/class/infiniband", ec);
}

uint64_t UcxDevice::RandomToken() {
  std::lock_guard<std::mutex> l(rng_mu_);
  // splitmix64 over a seed from std::random_device.
  uint64_t z = (rng_state_ += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

Status UcxDevice::Init() {
  // A restarted daemon must be able to listen on its old port while
  // connections of its previous life linger in TIME_WAIT. The TCP
  // connection manager reads this from the environment only (ucp_config_
  // modify does not reach it); an explicit setting wins (overwrite = 0).
  ::setenv("UCX_TCP_CM_REUSEADDR", "y", 0);
  ucp_config_t* config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
  if (st != UCS_OK) return UcsError(st, "ucp_config_read");
  // Keepalive detects hung peers and broken networks (a process that dies
  // is detected at once through its bootstrap connection's reset). 1 s
  // declared healthy but busy peers dead when 32 processes shared 2 cores;
  // 10 s does not. An explicit UCX_KEEPALIVE_INTERVAL still wins.
  if (!GetEnv("UCX_KEEPALIVE_INTERVAL")) {
    (void)ucp_config_modify(config, "KEEPALIVE_INTERVAL", "10s");
  }
  if (options_.transports != "auto" && !options_.transports.empty()) {
    st = ucp_config_modify(config, "TLS", options_.transports.c_str());
    if (st != UCS_OK) {
      ucp_config_release(config);
      return UcsError(st, "invalid transports '" + options_.transports + "'");
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES |
                      UCP_PARAM_FIELD_MT_WORKERS_SHARED | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = 1;
  params.name = options_.name.c_str();
  st = ucp_init(&params, config, &ctx_);
  ucp_config_release(config);
  if (st != UCS_OK) return UcsError(st, "ucp_init");

  static std::vector<std::unique_ptr<AmHandlerArg>> args_keepalive;
  static std::mutex args_mu;
  for (int i = 0; i < options_.progress_threads; ++i) {
    auto w = std::make_unique<UcxWorker>(this, i);
    RETURN_IF_ERROR(w->Init(ctx_));
    for (int id = kAmHello; id < kAmCount; ++id) {
      auto arg = std::make_unique<AmHandlerArg>(
          AmHandlerArg{this, static_cast<AmId>(id)});
      ucp_am_handler_param_t hp{};
      hp.field_mask =
          UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
          UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
      hp.id = static_cast<unsigned>(id);
      hp.flags = UCP_AM_FLAG_WHOLE_MSG;
      hp.cb = &UcxDevice::AmHandler;
      hp.arg = arg.get();
      st = ucp_worker_set_am_recv_handler(w->worker(), &hp);
      if (st != UCS_OK) return UcsError(st, "ucp_worker_set_am_recv_handler");
      std::lock_guard<std::mutex> l(args_mu);
      args_keepalive.push_back(std::move(arg));
    }
    workers_.push_back(std::move(w));
  }
  if (!options_.listen_address.empty()) RETURN_IF_ERROR(CreateListener());
  for (auto& w : workers_) w->Start();
  return Status::Ok();
}

Status UcxDevice::CreateListener() {
  socklen_t len = 0;
  ASSIGN_OR_RETURN(sockaddr_storage ss,
                   Resolve(options_.listen_address, &len, true));
  ucp_listener_params_t lp{};
  lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR |
                  UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&ss);
  lp.sockaddr.addrlen = len;
  lp.conn_handler.cb = [](ucp_conn_request_h req, void* arg) {
    static_cast<UcxDevice*>(arg)->OnConnRequest(req);
  };
  lp.conn_handler.arg = this;
  ucs_status_t st = ucp_listener_create(workers_[0]->worker(), &lp, &listener_);
  if (st != UCS_OK) {
    return UcsError(st, "cannot listen on '" + options_.listen_address + "'");
  }
  ucp_listener_attr_t attr{};
  attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  st = ucp_listener_query(listener_, &attr);
  if (st != UCS_OK) return UcsError(st, "ucp_listener_query");
  char host[INET6_ADDRSTRLEN] = {0};
  uint16_t port = 0;
  if (attr.sockaddr.ss_family == AF_INET) {
    auto* sin = reinterpret_cast<sockaddr_in*>(&attr.sockaddr);
    inet_ntop(AF_INET, &sin->sin_addr, host, sizeof(host));
    port = ntohs(sin->sin_port);
  } else {
    auto* sin6 = reinterpret_cast<sockaddr_in6*>(&attr.sockaddr);
    inet_ntop(AF_INET6, &sin6->sin6_addr, host, sizeof(host));
    port = ntohs(sin6->sin6_port);
  }
  std::string h = host;
  // A wildcard listener is reached through the address that was asked for.
  if (h == "0.0.0.0" || h == "::") {
    auto colon = options_.listen_address.rfind(':');
    h = options_.listen_address.substr(0, colon);
    if (h == "0.0.0.0" || h == "::" || h.empty()) h = "127.0.0.1";
  }
  listen_endpoint_ = h + ":" + std::to_string(port);
  MEMBOX_LOG_DEBUG("device {} listening on {}", options_.name,
                   listen_endpoint_);
  return Status::Ok();
}

UcxDevice::~UcxDevice() {
  if (listener_) ucp_listener_destroy(listener_);
  for (auto& w : workers_) w->Stop();
  std::vector<std::shared_ptr<UcxChannel>> all;
  {
    std::lock_guard<std::mutex> l(mu_);
    for (auto& [ep, ch] : by_ep_) all.push_back(ch);
    by_ep_.clear();
    by_id_.clear();
    out_.clear();
    accept_q_.clear();
  }
  for (auto& ch : all) ch->Close();
  all.clear();
  workers_.clear();
  if (ctx_) ucp_cleanup(ctx_);
}

Result<std::unique_ptr<MemRegion>> UcxDevice::AllocateMemRegion(size_t bytes) {
  if (bytes == 0) return InvalidArgumentError("AllocateMemRegion: size 0");
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                  UCP_MEM_MAP_PARAM_FIELD_FLAGS |
                  UCP_MEM_MAP_PARAM_FIELD_ADDRESS;
  mp.address = nullptr;
  mp.length = bytes;
  mp.flags = UCP_MEM_MAP_ALLOCATE;
  ucp_mem_h memh = nullptr;
  ucs_status_t st = ucp_mem_map(ctx_, &mp, &memh);
  if (st != UCS_OK) {
    return UcsError(st, "cannot allocate registered region of " +
                            std::to_string(bytes) + " bytes");
  }
  ucp_mem_attr_t attr{};
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
  ucp_mem_query(memh, &attr);
  return FinishRegistration(memh, attr.address, bytes, /*allocated=*/true);
}

Result<std::unique_ptr<MemRegion>> UcxDevice::FinishRegistration(
    ucp_mem_h memh, void* addr, size_t bytes, bool allocated) {
  void* rkey_buf = nullptr;
  size_t rkey_len = 0;
  ucs_status_t st = ucp_rkey_pack(ctx_, memh, &rkey_buf, &rkey_len);
  if (st != UCS_OK) {
    ucp_mem_unmap(ctx_, memh);
    return UcsError(st, "ucp_rkey_pack");
  }
  std::vector<uint8_t> rkey(static_cast<uint8_t*>(rkey_buf),
                            static_cast<uint8_t*>(rkey_buf) + rkey_len);
  ucp_rkey_buffer_release(rkey_buf);
  uint64_t id = NextRegionId();
  uint64_t token = RandomToken();
  RegisterExport(id, {reinterpret_cast<uint64_t>(addr), bytes, token,
                      wire::Crc32(rkey.data(), rkey.size())});
  return std::unique_ptr<MemRegion>(std::make_unique<UcxMemRegion>(
      this, memh, addr, bytes, id, allocated, token, std::move(rkey)));
}

Result<std::unique_ptr<MemRegion>> UcxDevice::RegisterMemRegion(void* addr,
                                                                size_t bytes) {
  if (addr == nullptr || bytes == 0) {
    return InvalidArgumentError("RegisterMemRegion: null address or size 0");
  }
  ucp_mem_map_params_t mp{};
  mp.field_mask =
      UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_ADDRESS;
  mp.address = addr;
  mp.length = bytes;
  ucp_mem_h memh = nullptr;
  ucs_status_t st = ucp_mem_map(ctx_, &mp, &memh);
  if (st != UCS_OK) return UcsError(st, "cannot register user memory");
  return FinishRegistration(memh, addr, bytes, /*allocated=*/false);
}

void UcxDevice::RegisterExport(uint64_t id, const ExportedRegion& r) {
  std::lock_guard<std::mutex> l(mu_);
  exports_[id] = r;
}

void UcxDevice::UnregisterExport(uint64_t id) {
  std::lock_guard<std::mutex> l(mu_);
  exports_.erase(id);
}

Status UcxDevice::CheckAccess(uint64_t region_id, uint64_t token, uint64_t addr,
                              uint64_t len) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = exports_.find(region_id);
  if (it == exports_.end()) {
    return NotFoundError("region " + std::to_string(region_id) +
                         " is not registered");
  }
  const ExportedRegion& r = it->second;
  if (r.token != token) {
    return PermissionDeniedError("wrong access key for region " +
                                 std::to_string(region_id));
  }
  if (addr < r.address || len > r.length || addr - r.address > r.length - len) {
    return OutOfRangeError("range [" + std::to_string(addr) + ", +" +
                           std::to_string(len) + ") outside region " +
                           std::to_string(region_id));
  }
  return Status::Ok();
}

bool UcxDevice::CheckRkeyCrc(uint64_t region_id, uint32_t crc) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = exports_.find(region_id);
  return it != exports_.end() && it->second.rkey_crc == crc;
}

UcxChannel* UcxDevice::ChannelForEp(ucp_ep_h ep) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = by_ep_.find(ep);
  return it == by_ep_.end() ? nullptr : it->second.get();
}

UcxChannel* UcxDevice::ChannelForId(uint64_t id) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : it->second.get();
}

uint64_t UcxDevice::AddChannelId(const std::shared_ptr<UcxChannel>& ch) {
  std::lock_guard<std::mutex> l(mu_);
  uint64_t id = next_channel_id_++;
  by_id_[id] = ch;
  return id;
}

UcxWorker* UcxDevice::NextAcceptWorker() {
  return workers_[static_cast<size_t>(accept_rr_.fetch_add(1)) %
                  workers_.size()]
      .get();
}

int UcxDevice::thread_index() const { return tls_worker_index; }

void UcxDevice::OnConnRequest(ucp_conn_request_h req) {
  // Runs on worker 0's progress thread: the listener's worker accepts.
  UcxWorker* w = workers_[0].get();
  auto ch = std::make_shared<UcxChannel>(this, w, 0, "", true);
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST |
                  UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                  UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.conn_request = req;
  UcxChannel::SetErrorHandling(&ep, ch.get(), UCP_ERR_HANDLING_MODE_PEER);
  ucp_ep_h h = nullptr;
  ucs_status_t st = ucp_ep_create(w->worker(), &ep, &h);
  if (st != UCS_OK) {
    MEMBOX_LOG_WARN("rejecting a connection: {}", ucs_status_string(st));
    return;
  }
  ch->set_boot_ep(h);
  ch->set_id(AddChannelId(ch));
  std::lock_guard<std::mutex> l(mu_);
  by_ep_[h] = ch;
}

void UcxDevice::OnHello(UcxChannel* ch) {
  std::shared_ptr<UcxChannel> sp;
  {
    std::lock_guard<std::mutex> l(mu_);
    auto it = by_ep_.find(ch->boot_ep());
    if (it == by_ep_.end()) return;
    sp = it->second;
    accept_q_.push_back(sp);
  }
  accept_ev_.Notify();
}

Result<std::shared_ptr<Channel>> UcxDevice::Accept(
    std::chrono::nanoseconds timeout) {
  std::shared_ptr<UcxChannel> got;
  bool ok = SpinThenBlock(
      [&] {
        std::lock_guard<std::mutex> l(mu_);
        if (accept_q_.empty()) return false;
        got = accept_q_.front();
        accept_q_.pop_front();
        return true;
      },
      &accept_ev_, timeout);
  if (!ok)
    return DeadlineExceededError("no incoming channel before the timeout");
  return std::shared_ptr<Channel>(got);
}

Result<std::shared_ptr<Channel>> UcxDevice::GetChannel(
    const std::string& remote_endpoint, int lane) {
  if (lane < 0 || lane >= options_.lanes_per_peer) {
    return InvalidArgumentError("lane " + std::to_string(lane) +
                                " outside [0, " +
                                std::to_string(options_.lanes_per_peer) + ")");
  }
  auto key = std::make_pair(remote_endpoint, lane);
  {
    std::lock_guard<std::mutex> l(mu_);
    auto it = out_.find(key);
    if (it != out_.end() && it->second->health().ok()) {
      return std::shared_ptr<Channel>(it->second);
    }
  }
  socklen_t len = 0;
  ASSIGN_OR_RETURN(sockaddr_storage ss, Resolve(remote_endpoint, &len, false));
  // Lanes of one peer are spread over the progress threads round-robin.
  UcxWorker* w = workers_[static_cast<size_t>(lane) % workers_.size()].get();
  auto ch = std::make_shared<UcxChannel>(this, w, lane, remote_endpoint, false);
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                  UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                  UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&ss);
  ep.sockaddr.addrlen = len;
  UcxChannel::SetErrorHandling(&ep, ch.get(), UCP_ERR_HANDLING_MODE_PEER);
  ucp_ep_h h = nullptr;
  ucs_status_t st = ucp_ep_create(w->worker(), &ep, &h);
  if (st != UCS_OK) return UcsError(st, "cannot connect to " + remote_endpoint);
  ch->set_boot_ep(h);
  ch->set_id(AddChannelId(ch));
  {
    std::lock_guard<std::mutex> l(mu_);
    by_ep_[h] = ch;
  }
  w->Signal();
  Status hs = ch->Handshake(options_.connect_timeout);
  if (!hs.ok()) {
    {
      std::lock_guard<std::mutex> l(mu_);
      by_ep_.erase(h);
      by_id_.erase(ch->id());
    }
    ch->Close();
    return hs.WithContext("cannot connect to " + remote_endpoint);
  }
  std::lock_guard<std::mutex> l(mu_);
  out_[key] = ch;
  return std::shared_ptr<Channel>(ch);
}

ucs_status_t UcxDevice::AmHandler(void* arg, const void* header, size_t hlen,
                                  void* data, size_t len,
                                  const ucp_am_recv_param_t* param) {
  auto* a = static_cast<AmHandlerArg*>(arg);
  uint64_t dest = 0;
  auto drop = [&](const char* why) {
    MEMBOX_LOG_WARN("dropping active message {}: {}", static_cast<int>(a->id),
                    why);
    if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
      ucp_am_data_release(a->dev->workers_[0]->worker(), data);
    }
    return UCS_OK;
  };
  if (hlen < sizeof(dest)) return drop("header too short");
  std::memcpy(&dest, header, sizeof(dest));
  UcxChannel* ch = nullptr;
  if (dest == 0) {
    // Hello / hello-ack travel on the bootstrap endpoint.
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ||
        param->reply_ep == nullptr) {
      return drop("bootstrap message without a reply endpoint");
    }
    ch = a->dev->ChannelForEp(param->reply_ep);
  } else {
    ch = a->dev->ChannelForId(dest);
  }
  if (ch == nullptr) return drop("unknown channel");
  return ch->OnAm(a->id, static_cast<const uint8_t*>(header) + sizeof(dest),
                  hlen - sizeof(dest), data, len, param);
}

}  // namespace membox::transport::ucx
