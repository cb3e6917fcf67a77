#include "src/transport/ucx/ucx_device.h"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "membox/base/config.h"
#include "membox/base/logging.h"
#include "membox/base/wire.h"
#include "membox/transport/huge_pages.h"

#include "src/transport/fresh_mapping.h"
#include "src/transport/ucx/ucx_channel.h"

namespace membox::transport {

Result<std::unique_ptr<Device>> Device::Create(const DeviceOptions& options) {
  if (options.progress_threads < 1 || options.progress_threads > 64) {
    return InvalidArgumentError("progress_threads must be in [1, 64]");
  }
  if (options.lanes_per_peer < 1 || options.lanes_per_peer > 64) {
    return InvalidArgumentError("lanes_per_peer must be in [1, 64]");
  }
  return MakeInitialized<Device, ucx::UcxDevice>(options);
}

const char* ProtocolName(Protocol p) {
  switch (p) {
    case Protocol::kMapped:
      return "mapped";
    case Protocol::kRma:
      return "rma";
    case Protocol::kActiveMessage:
      return "active-message";
    case Protocol::kTcp:
      return "tcp";
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

// Whether the user set one of UCX's own variables, which ucp_config_read
// reads from the environment: membox's defaults for UCX's settings give way
// to the user's. (membox's own settings come to the device as options.)
bool UserSetUcx(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0';
}

std::string ReadFirstLine(const char* path) {
  std::ifstream in(path);
  std::string s;
  std::getline(in, s);
  return s;
}

// One MemRegion registered with UCX.
class UcxMemRegion final : public MemRegion {
 public:
  UcxMemRegion(UcxDevice* dev, ucp_mem_h memh, void* data, size_t size,
               uint64_t id, bool allocated, MemoryType type, Token128 token,
               std::vector<uint8_t> rkey)
      : MemRegion(data, size, id, allocated, type),
        dev_(dev),
        memh_(memh),
        token_(token),
        rkey_(std::move(rkey)) {}
  ~UcxMemRegion() override {
    dev_->UnregisterExport(id());
    {
      MutexLock l(&mu_);
      for (uint64_t r : ranges_) dev_->UnregisterExport(r);
    }
    if (device_allocated()) ReleasedMapping(data(), size());
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
    dev_->RegisterExport(d.region_id, {d.address, length, d.token,
                                       wire::Crc32(rkey_.data(), rkey_.size()),
                                       memory_type() == MemoryType::kHost});
    MutexLock l(&mu_);
    ranges_.insert(d.region_id);
    return d;
  }
  void RevokeRange(uint64_t range_id) override {
    MutexLock l(&mu_);
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
    d.shared_file = shared_file_;
    return d;
  }
  void set_shared_file(const SharedFile& f) { shared_file_ = f; }

 private:
  UcxDevice* dev_;
  ucp_mem_h memh_;
  Token128 token_;
  std::vector<uint8_t> rkey_;
  std::optional<SharedFile> shared_file_;  // set once, before any Export
  Mutex mu_;
  std::set<uint64_t> ranges_ MEMBOX_GUARDED_BY(mu_);  // ids from ExportRange
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

void UcxWorker::Drain() {
  const int own = tls_worker_index;
  tls_worker_index = index_;  // handlers see their worker's thread
  for (int i = 0; i < 1024 && ucp_worker_progress(worker_) != 0; ++i) {
  }
  tls_worker_index = own;
}

void UcxWorker::Loop() {
  tls_worker_index = index_;
  // Naps of 100 us stay 100 us (the default timer slack is 50 us).
  prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
  using Clock = std::chrono::steady_clock;
  auto last_activity = Clock::now();
  // Spin window after the last event: long enough to catch a reply that is
  // microseconds away, short enough not to matter to other processes.
  const auto spin_window = std::chrono::microseconds(50);
  // Arms refused (UCS_ERR_BUSY) in a row with nothing progressed between
  // them, and since when the arms this loop tried have all been refused
  // (none held; cleared while a user thread drives the worker): see below.
  uint32_t busy_arms = 0;
  bool refusing = false;
  Clock::time_point refused_since;
  // Every arm refused for this long: an interface is stuck (below).
  const auto stuck_after = std::chrono::milliseconds(10);
  while (!stop_.load(std::memory_order_relaxed)) {
    if (ucp_worker_progress(worker_) != 0) {
      last_activity = Clock::now();
      busy_arms = 0;
      continue;
    }
    // While a user thread drives the worker (HelpProgress within the last
    // 20 us), the progress thread neither spins nor arms the worker (an
    // armed worker makes every sender signal it and wakes this thread onto
    // a core the driver needs): it naps 100 us at a time, stop_fd only,
    // and takes over once the helping stops.
    if (NowNs() - last_help_ns_.load(std::memory_order_relaxed) < 20000) {
      refusing = false;
      pollfd pfd{stop_fd_, POLLIN, 0};
      timespec nap{0, 100000};
      sleeping_.store(true, std::memory_order_release);
      (void)ppoll(&pfd, 1, &nap, nullptr);
      sleeping_.store(false, std::memory_order_release);
      continue;
    }
    if (Clock::now() - last_activity < spin_window &&
        !MachineOversubscribed()) {
      CpuRelax();
      continue;
    }
    ucs_status_t st = ucp_worker_arm(worker_);
    if (st == UCS_ERR_BUSY) {
      // An event came in since the last progress, which found nothing to
      // do: a peer's transfer in flight signals again and again (a large
      // transfer over shared memory does, for its whole length). Arming
      // and progressing in a tight loop then takes a core for nothing; on
      // a machine with more runnable threads than cores that core is the
      // one the transfer's other end or a copy needs (a 1 GiB failover on
      // 2 cores: this loop in two processes took half the machine). After
      // a few such arms, nap 20 us between them there.
      // An interface can also stay busy for good. After kill -9 of a
      // same-host memory node mid-job, in about half the runs, the
      // survivor's and the workers' arms were refused for the rest of the
      // job and their loops went round 150,000-450,000 times a second (a
      // reading of /proc/loadavg missed the crowded 2-core machine half the
      // time). UCX's shared-memory interface refuses an arm while its
      // receive FIFO's head is past what it has read; a peer killed between
      // taking a slot and writing it leaves it so, which fits. So where
      // every arm has been refused for stuck_after, the loop naps 50 us
      // between polls whatever the load; a transfer that signals that long
      // is seen done at most 50 us late.
      ++busy_arms;
      const auto now = Clock::now();
      if (!refusing) {
        refusing = true;
        refused_since = now;
      }
      const bool stuck = now - refused_since > stuck_after;
      if (stuck || (busy_arms > 16 && MachineOversubscribed())) {
        pollfd pfd{stop_fd_, POLLIN, 0};
        timespec nap{0, stuck ? 50000 : 20000};
        (void)ppoll(&pfd, 1, &nap, nullptr);
      }
      continue;
    }
    busy_arms = 0;
    refusing = false;
    epoll_event evs[2];
    sleeping_.store(true, std::memory_order_release);
    int n = epoll_wait(epfd_, evs, 2, 100);
    sleeping_.store(false, std::memory_order_release);
    if (n > 0) last_activity = Clock::now();
  }
}

// ---------------------------------------------------------------- UcxDevice

UcxDevice::UcxDevice(DeviceOptions options) : options_(std::move(options)) {
  // The key this device proves: the cluster secret, or a credential's.
  if (Credential::Looks(options_.secret)) {
    auto c = Credential::Parse(options_.secret);
    if (c.ok()) {
      own_ = *c;
    } else {
      own_init_error_ = c.status();
    }
  } else {
    own_.key = options_.secret;  // the cluster principal
  }
  // Not a secret, and drawn apart from every token (no shared stream).
  id_ = RandomU64();
  char hn[256] = {0};
  gethostname(hn, sizeof(hn) - 1);
  // Processes in different network namespaces count as different hosts, so
  // an emulated cluster (hosts as namespaces) sends over its shaped links
  // rather than through shared memory.
  std::error_code ec;
  std::string netns = std::filesystem::read_symlink("/proc/self/ns/net", ec);
  host_id_ = std::string(hn) + "/" +
             ReadFirstLine("/proc/sys/kernel/random/boot_id") + "/" + netns;
  rdma_present_ = std::filesystem::exists("/sys/class/infiniband", ec) &&
                  !std::filesystem::is_empty("/sys/class/infiniband", ec);
}

Status UcxDevice::Init() {
  RETURN_IF_ERROR(own_init_error_);
  ucp_config_t* config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
  if (st != UCS_OK) return UcsError(st, "ucp_config_read");
  // Keepalive detects hung peers and broken networks (a process that dies
  // is detected at once through its bootstrap connection's reset). 1 s
  // declared healthy but busy peers dead when 32 processes shared 2 cores;
  // 10 s does not. An explicit UCX_KEEPALIVE_INTERVAL still wins.
  if (!UserSetUcx("UCX_KEEPALIVE_INTERVAL")) {
    (void)ucp_config_modify(config, "KEEPALIVE_INTERVAL", "10s");
  }
  // DeviceOptions::sleep_on_worker_lock: UCX guards the worker with a
  // spinlock by default. A memory node's embedding server in the README's
  // CTR run spent 13 % of its CPU in pthread_spin_lock; sleeping there took
  // the node from 0.49-0.51 to 0.46-0.47 CPUs (4 pairs), the run's samples/s
  // within noise. Every process sleeping gave the CTR run 1.09x (median, 10
  // pairs) but the digits job's small DDP rounds 1.09x slower (7 pairs), so
  // it is per device (docs/results/ctr.md).
  if (options_.sleep_on_worker_lock && !UserSetUcx("UCX_USE_MT_MUTEX")) {
    (void)ucp_config_modify(config, "USE_MT_MUTEX", "y");
  }
  // UCX's TCP transport listens on every interface and asserts on malformed
  // bytes, so it is never enabled: TCP between hosts is membox's own path
  // (net::TcpChannel). This also overrides a UCX_TLS from the environment.
  std::string tls = "^tcp";
  if (options_.transports != "auto" && options_.transports != "tcp" &&
      !options_.transports.empty()) {
    if (options_.transports.find("tcp") != std::string::npos ||
        options_.transports.front() == '^') {
      ucp_config_release(config);
      return InvalidArgumentError(
          "transports '" + options_.transports +
          "': name UCX transports to use (not tcp); TCP is membox's own path, "
          "chosen with transports = \"tcp\" or \"auto\"");
    }
    tls = options_.transports;
  }
  st = ucp_config_modify(config, "TLS", tls.c_str());
  if (st != UCS_OK) {
    ucp_config_release(config);
    return UcsError(st, "invalid transports '" + options_.transports + "'");
  }
  // A UCX with CUDA (1.2x) registers the whole cudaMalloc allocation around
  // a registered GPU buffer, from a memory-type detection that comes back
  // empty here (a [0, 0) region: "Invalid parameter", docs/results/gpu.md).
  // membox registers exactly the range it is given. Older UCX has no such
  // setting (the modify fails and nothing changes); the environment wins.
  if (!UserSetUcx("UCX_MEMTYPE_REG_WHOLE_ALLOC_TYPES")) {
    (void)ucp_config_modify(config, "MEMTYPE_REG_WHOLE_ALLOC_TYPES", "");
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
  ucp_context_attr_t cattr{};
  cattr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  if (ucp_context_query(ctx_, &cattr) == UCS_OK) {
    ucx_memory_types_ = cattr.memory_types;
  }

  static std::vector<std::unique_ptr<AmHandlerArg>> args_keepalive;
  static Mutex args_mu;
  for (int i = 0; i < options_.progress_threads; ++i) {
    auto w = std::make_unique<UcxWorker>(this, i);
    RETURN_IF_ERROR(w->Init(ctx_));
    for (int id = kAmControl; id < kAmCount; ++id) {
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
      MutexLock l(&args_mu);
      args_keepalive.push_back(std::move(arg));
    }
    workers_.push_back(std::move(w));
  }
  for (auto& w : workers_) w->Start();
  net::Listener::Options lo;
  lo.name = options_.name;
  lo.listen_address = options_.listen_address;
  lo.max_pending = options_.max_pending_handshakes;
  lo.handshake_timeout = options_.handshake_timeout;
  listener_ = std::make_unique<net::Listener>(
      std::move(lo), [this](net::Listener::Handshake& h) { OnProof(h); });
  RETURN_IF_ERROR(listener_->Start());
  listen_endpoint_ = listener_->endpoint();
  return Status::Ok();
}

UcxDevice::~UcxDevice() {
  // The listener's thread ends first (no handshake or watch callback runs
  // after this); the object stays until the channels below have forgotten
  // their watches.
  if (listener_) listener_->Stop();
  for (auto& w : workers_) w->Stop();
  std::vector<std::shared_ptr<Channel>> all;
  {
    MutexLock l(&mu_);
    all.swap(channels_);
    by_id_.clear();
    out_.clear();
    accept_q_.clear();
  }
  for (auto& ch : all) {
    // TCP channels may outlive the device in their users' hands; their
    // threads must not.
    if (auto tcp = std::dynamic_pointer_cast<net::TcpChannel>(ch)) {
      tcp->Stop();
    } else {
      ch->Close();
    }
  }
  all.clear();
  workers_.clear();
  if (ctx_) ucp_cleanup(ctx_);
}

uint32_t UcxDevice::LocalFlags() const {
  uint32_t f = 0;
  if (options_.transports == "tcp") f |= net::kFlagTcpOnly;
  if (rdma_present_) f |= net::kFlagRdma;
  return f;
}

bool UcxDevice::UseUcx(uint32_t peer_flags, const std::string& peer_host,
                       int fd) const {
  uint32_t mine = LocalFlags();
  if ((mine | peer_flags) & net::kFlagTcpOnly) return false;
  if (peer_host == host_id_) {
    // Shared memory: UCX unpacks the peer's worker address (and attaches the
    // segments it names), and UCX aborts on malformed addresses. So only a
    // peer the kernel proves to be a process of this host running as this
    // process's user gets it; a claimed host id alone gets membox's TCP
    // path (docs/design/network_face.md, "UCX addresses").
    auto uid = net::LocalPeerUid(fd);
    if (!uid.ok() || *uid != geteuid()) {
      MEMBOX_LOG_INFO(
          "{}: {} claims this host but is not proven a local process of uid "
          "{} ({}): TCP data path",
          options_.name, net::PeerName(fd), geteuid(),
          uid.ok() ? "uid " + std::to_string(*uid) : uid.status().ToString());
      return false;
    }
    return true;
  }
  return (mine & net::kFlagRdma) && (peer_flags & net::kFlagRdma);
}

Result<std::pair<Principal, std::string>> UcxDevice::KeyFor(
    const std::string& credential) const {
  if (credential.empty()) {
    // A proof with the cluster secret: only a device holding it can check.
    if (!own_.principal.cluster) {
      return PermissionDeniedError("this device holds a credential");
    }
    return std::make_pair(Principal(), options_.secret);
  }
  ASSIGN_OR_RETURN(Principal p, ParsePublicId(credential));
  if (own_.principal.cluster) {
    return std::make_pair(p, DeriveCredentialKey(options_.secret, credential));
  }
  // A credential holder accepts only its own principal (a job's workers).
  if (credential != own_.principal.public_id()) {
    return PermissionDeniedError("another principal");
  }
  return std::make_pair(p, own_.key);
}

bool UcxDevice::PlausibleUcxAddress(const std::vector<uint8_t>& a) const {
  // Our own worker address comes from the same UCX library: a peer's starts
  // with the same header byte (format version and flags). UCX asserts on
  // other versions instead of returning an error.
  const std::vector<uint8_t>& mine = workers_.front()->address();
  return a.size() >= 16 && !mine.empty() && a[0] == mine[0];
}

void UcxDevice::OnProof(net::Listener::Handshake& h) {
  const auto send_deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(200);
  const net::ClientProof* cp = &h.proof;
  // Logs why, tells the peer `s` (a refusal verdict, no proof); the
  // connection then closes.
  auto refuse = [&](const Status& s, const std::string& as) {
    MEMBOX_LOG_WARN("{}: refusing {} ({}){}: {}", options_.name,
                    net::PeerName(h.fd.get()), cp->hello.name, as,
                    s.ToString());
    net::ServerVerdict v;
    v.code = static_cast<uint32_t>(s.code());
    v.message = std::string(s.message());
    (void)net::SendFrame(h.fd.get(), net::EncodeServerVerdict(v),
                         send_deadline);
  };
  auto key = KeyFor(cp->credential);
  if (!key.ok() ||
      !net::ProofEquals(
          net::ClientProofFor(key->second, h.client_nonce, h.server_nonce, *cp),
          cp->proof)) {
    return refuse(UnauthenticatedError("wrong secret"), "");
  }
  const Principal& principal = key->first;
  if (options_.admit) {
    Status admitted = options_.admit(principal);
    if (!admitted.ok()) return refuse(admitted, " as " + principal.label());
  }
  // UCX's one-sided paths reach a whole registration with its remote key
  // (a memory node's pool, shared memory mapping all of it): only the
  // cluster's principal is trusted with that. A job or tenant with its own
  // credential gets membox's TCP path, where the owner checks every access
  // against the range its token names (docs/design/network_face.md).
  bool ucx = principal.cluster && UseUcx(cp->flags, cp->hello.host, h.fd.get());
  if (ucx && !PlausibleUcxAddress(cp->hello.address)) {
    return refuse(InvalidArgumentError("malformed UCX worker address"), "");
  }
  UcxWorker* w = NextAcceptWorker();
  std::shared_ptr<UcxChannel> uch;
  net::ServerVerdict v;
  v.path = ucx ? net::DataPath::kUcx : net::DataPath::kTcp;
  v.hello.channel_id = NewChannelId();
  v.hello.name = options_.name;
  v.hello.host = host_id_;
  v.hello.address = w->address();
  v.proof = net::ServerProofFor(key->second, h.client_nonce, h.server_nonce,
                                cp->proof, v);
  int lane = static_cast<int>(cp->hello.lane);
  if (ucx) {
    uch = std::make_shared<UcxChannel>(this, w, lane, cp->hello.name, true);
    uch->set_id(v.hello.channel_id);
    MutexLock l(&mu_);
    by_id_[v.hello.channel_id] = uch;
  }
  int raw = h.fd.get();
  auto ch = MakeChannel(std::move(h.fd), v.path, cp->hello, uch, lane,
                        cp->hello.name, principal);
  if (!ch.ok()) {
    if (uch) {
      MutexLock l(&mu_);
      by_id_.erase(v.hello.channel_id);
    }
    // The connection is still ours (MakeChannel did not take it): the
    // peer hears why (an address UCX cannot reach, say), then it closes.
    return refuse(ch.status(), "");
  }
  // The verdict goes out after the channel exists, so the client's first
  // message finds it; a TCP channel's threads start after it.
  Status sent = net::SendFrame(raw, net::EncodeServerVerdict(v), send_deadline);
  if (!sent.ok()) {
    (*ch)->Close();
    return;
  }
  if (auto tcp = std::dynamic_pointer_cast<net::TcpChannel>(*ch)) tcp->Start();
  {
    MutexLock l(&mu_);
    accept_q_.push_back(*ch);
  }
  accept_ev_.Notify();
}

Result<std::shared_ptr<Channel>> UcxDevice::MakeChannel(
    net::Fd&& fd, net::DataPath path, const msg::Hello& peer,
    const std::shared_ptr<UcxChannel>& ucx, int lane,
    const std::string& peer_label, const Principal& principal) {
  if (path == net::DataPath::kTcp) {
    RETURN_IF_ERROR(net::SetBlocking(fd.get(), true));
    auto ch = std::make_shared<net::TcpChannel>(this, std::move(fd), lane,
                                                peer_label);
    ch->set_principal(principal);
    RegisterChannel(ch);
    return std::shared_ptr<Channel>(ch);
  }
  ucx->set_principal(principal);
  RETURN_IF_ERROR(ucx->ConnectData(peer));
  int raw = fd.get();
  ucx->set_liveness(std::move(fd));
  WatchLiveness(raw, ucx);
  RegisterChannel(ucx);
  return std::shared_ptr<Channel>(ucx);
}

void UcxDevice::RegisterChannel(const std::shared_ptr<Channel>& ch) {
  MutexLock l(&mu_);
  // Forget channels that failed long ago, so a long-lived server does not
  // keep every connection it ever had.
  std::erase_if(channels_, [](const std::shared_ptr<Channel>& c) {
    return !c->health().ok() && c.use_count() == 1;
  });
  channels_.push_back(ch);
}

void UcxDevice::WatchLiveness(int fd, const std::shared_ptr<UcxChannel>& ch) {
  listener_->Watch(fd, [w = std::weak_ptr<UcxChannel>(ch)] {
    auto c = w.lock();
    if (!c) return;
    // What the peer sent before it went is delivered first.
    c->worker()->Drain();
    c->Fail(UnavailableError("connection lost"));
  });
}

void UcxDevice::ForgetLiveness(int fd) {
  if (listener_) listener_->Forget(fd);
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
  FreshMapping(attr.address, bytes);
  // Before the first touch: its faults then fill 2 MiB pages where the
  // kernel allows (membox/transport/huge_pages.h).
  AdviseHugePages(attr.address, bytes);
  return FinishRegistration(memh, attr.address, bytes, /*allocated=*/true);
}

Result<std::unique_ptr<MemRegion>> UcxDevice::FinishRegistration(
    ucp_mem_h memh, void* addr, size_t bytes, bool allocated, MemoryType type) {
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
  Token128 token = RandomToken();
  RegisterExport(
      id, {reinterpret_cast<uint64_t>(addr), bytes, token,
           wire::Crc32(rkey.data(), rkey.size()), type == MemoryType::kHost});
  return std::unique_ptr<MemRegion>(std::make_unique<UcxMemRegion>(
      this, memh, addr, bytes, id, allocated, type, token, std::move(rkey)));
}

bool UcxDevice::SupportsMemoryType(MemoryType type) const {
  switch (type) {
    case MemoryType::kHost:
      return true;
    case MemoryType::kCuda:
      return (ucx_memory_types_ & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
  }
  return false;
}

Result<std::unique_ptr<MemRegion>> UcxDevice::RegisterMemRegion(
    void* addr, size_t bytes, MemoryType type) {
  if (addr == nullptr || bytes == 0) {
    return InvalidArgumentError("RegisterMemRegion: null address or size 0");
  }
  if (!SupportsMemoryType(type)) {
    return FailedPreconditionError(
        std::string("cannot register ") + MemoryTypeName(type) +
        " memory: this UCX (" + ucp_get_version_string() +
        ") was built without " + MemoryTypeName(type) +
        " support (Debian's libucx0 has none; PyPI's libucx-cu13 has it); "
        "stage "
        "GPU tensors through registered host memory, as membox.torch does");
  }
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                  UCP_MEM_MAP_PARAM_FIELD_ADDRESS |
                  UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
  mp.address = addr;
  mp.length = bytes;
  mp.memory_type =
      type == MemoryType::kCuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
  ucp_mem_h memh = nullptr;
  ucs_status_t st = ucp_mem_map(ctx_, &mp, &memh);
  if (st != UCS_OK) {
    return UcsError(st, std::string("cannot register ") + MemoryTypeName(type) +
                            " memory of " + std::to_string(bytes) + " bytes");
  }
  return FinishRegistration(memh, addr, bytes, /*allocated=*/false, type);
}

Result<SharedFile> UcxDevice::SharedFileProof() {
  MutexLock l(&proof_mu_);
  if (!proof_fd_) {
    int fd = memfd_create("membox-proof", MFD_CLOEXEC);
    if (fd < 0)
      return InternalError(
          std::string("memfd_create for the shared-file proof: ") +
          std::strerror(errno));
    net::Fd owned(fd);
    std::vector<uint8_t> r = RandomBytes(proof_.size());
    std::copy(r.begin(), r.end(), proof_.begin());
    if (pwrite(fd, proof_.data(), proof_.size(), 0) !=
        static_cast<ssize_t>(proof_.size())) {
      return InternalError(std::string("writing the shared-file proof: ") +
                           std::strerror(errno));
    }
    proof_fd_ = std::move(owned);
  }
  SharedFile f;
  f.pid = static_cast<uint32_t>(getpid());
  f.proof_fd = proof_fd_.get();
  f.proof = proof_;
  return f;
}

Result<std::unique_ptr<MemRegion>> UcxDevice::RegisterSharedMemRegion(
    void* addr, size_t bytes, int fd, uint64_t file_offset) {
  struct stat st {};
  if (fd < 0 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    return InvalidArgumentError(
        "RegisterSharedMemRegion: not an open regular file");
  }
  if (file_offset + bytes < file_offset ||
      static_cast<uint64_t>(st.st_size) < file_offset + bytes) {
    return InvalidArgumentError(
        "RegisterSharedMemRegion: the file is shorter than the range (" +
        std::to_string(st.st_size) + " bytes)");
  }
  ASSIGN_OR_RETURN(SharedFile f, SharedFileProof());
  f.fd = fd;
  f.offset = file_offset;
  ASSIGN_OR_RETURN(auto r, RegisterMemRegion(addr, bytes, MemoryType::kHost));
  static_cast<UcxMemRegion*>(r.get())->set_shared_file(f);
  return r;
}

void UcxDevice::RegisterExport(uint64_t id, const ExportedRegion& r) {
  exports_.Register(id, r);
}

void UcxDevice::UnregisterExport(uint64_t id) { exports_.Unregister(id); }

Status UcxDevice::CheckAccess(uint64_t region_id, const Token128& token,
                              uint64_t addr, uint64_t len, bool host_memory) {
  return exports_.Check(region_id, token, addr, len, host_memory);
}

Result<ExportTable::Lease> UcxDevice::AcquireAccess(uint64_t region_id,
                                                    const Token128& token,
                                                    uint64_t addr, uint64_t len,
                                                    bool host_memory,
                                                    ExportTable::Fence fence) {
  return exports_.Acquire(region_id, token, addr, len, host_memory,
                          std::move(fence));
}

bool UcxDevice::CheckRkeyCrc(uint64_t region_id, uint32_t crc) {
  return exports_.CheckRkeyCrc(region_id, crc);
}

UcxChannel* UcxDevice::ChannelForId(uint64_t id) {
  MutexLock l(&mu_);
  auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : it->second.get();
}

UcxWorker* UcxDevice::NextAcceptWorker() {
  return workers_[static_cast<size_t>(accept_rr_.fetch_add(1)) %
                  workers_.size()]
      .get();
}

int UcxDevice::thread_index() const { return tls_worker_index; }

uint64_t UcxDevice::NewChannelId() {
  MutexLock l(&mu_);
  return next_channel_id_++;
}

Result<std::shared_ptr<Channel>> UcxDevice::Accept(
    std::chrono::nanoseconds timeout) {
  std::shared_ptr<Channel> got;
  bool ok = SpinThenBlock(
      [&] {
        MutexLock l(&mu_);
        if (accept_q_.empty()) return false;
        got = accept_q_.front();
        accept_q_.pop_front();
        return true;
      },
      &accept_ev_, timeout);
  if (!ok)
    return DeadlineExceededError("no incoming channel before the timeout");
  return got;
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
    MutexLock l(&mu_);
    auto it = out_.find(key);
    if (it != out_.end() && it->second->health().ok()) return it->second;
  }
  auto connect = [&]() -> Result<std::shared_ptr<Channel>> {
    const auto deadline =
        std::chrono::steady_clock::now() + options_.connect_timeout;
    ASSIGN_OR_RETURN(net::Fd fd, net::Connect(remote_endpoint, deadline));
    net::ClientHello hello{net::NewNonce()};
    RETURN_IF_ERROR(
        net::SendFrame(fd.get(), net::EncodeClientHello(hello), deadline));
    ASSIGN_OR_RETURN(std::vector<uint8_t> f1,
                     net::RecvFrame(fd.get(), net::kMaxHelloFrame, deadline));
    ASSIGN_OR_RETURN(net::ServerChallenge sp, net::DecodeServerChallenge(f1));
    // Lanes of one peer are spread over the progress threads round-robin.
    UcxWorker* w = workers_[static_cast<size_t>(lane) % workers_.size()].get();
    auto uch =
        std::make_shared<UcxChannel>(this, w, lane, remote_endpoint, false);
    uch->set_id(NewChannelId());
    net::ClientProof cp;
    cp.flags = LocalFlags();
    cp.hello = msg::Hello{uch->id(), static_cast<uint32_t>(lane), options_.name,
                          host_id_, w->address()};
    cp.credential = own_.principal.public_id();
    cp.proof = net::ClientProofFor(own_.key, hello.nonce, sp.nonce, cp);
    {
      // Registered before the proof goes out: the server may send on the
      // data path as soon as it has answered.
      MutexLock l(&mu_);
      by_id_[uch->id()] = uch;
    }
    auto forget = [&] {
      MutexLock l(&mu_);
      by_id_.erase(uch->id());
    };
    Status s = net::SendFrame(fd.get(), net::EncodeClientProof(cp), deadline);
    Result<std::vector<uint8_t>> f2 =
        s.ok() ? net::RecvFrame(fd.get(), net::kMaxProofFrame, deadline)
               : Result<std::vector<uint8_t>>(s);
    Result<net::ServerVerdict> v =
        f2.ok() ? net::DecodeServerVerdict(*f2)
                : Result<net::ServerVerdict>(f2.status());
    if (v.ok() && v->code != 0) {
      v = msg::StatusFromWire(v->code, v->message);
    }
    if (v.ok() && !net::ProofEquals(
                      v->proof, net::ServerProofFor(own_.key, hello.nonce,
                                                    sp.nonce, cp.proof, *v))) {
      v = UnauthenticatedError(
          "wrong secret: the peer proved a different shared secret (check "
          "--secret-file / MEMBOX_SECRET on both sides)");
    }
    if (!v.ok() || v->path != net::DataPath::kUcx) forget();
    if (!v.ok()) {
      if (v.status().code() == StatusCode::kUnavailable) {
        return UnavailableError(
            "the peer closed the connection during the handshake (wrong "
            "secret, or it is not a membox service)");
      }
      return v.status();
    }
    ASSIGN_OR_RETURN(auto ch, MakeChannel(std::move(fd), v->path, v->hello, uch,
                                          lane, remote_endpoint, Principal()));
    if (auto tcp = std::dynamic_pointer_cast<net::TcpChannel>(ch)) {
      tcp->Start();
    }
    return ch;
  };
  auto ch = connect();
  if (!ch.ok()) {
    return ch.status().WithContext("cannot connect to " + remote_endpoint);
  }
  MutexLock l(&mu_);
  out_[key] = *ch;
  return *ch;
}

ucs_status_t UcxDevice::AmHandler(void* arg, const void* header, size_t hlen,
                                  void* data, size_t len,
                                  const ucp_am_recv_param_t* param) {
  auto* a = static_cast<AmHandlerArg*>(arg);
  uint64_t dest = 0;
  auto drop = [&](const char* why) {
    MEMBOX_LOG_WARN("dropping active message {}: {}", static_cast<int>(a->id),
                    why);
    // UCS_OK without a receive: UCX drops a rendezvous message itself.
    return UCS_OK;
  };
  if (hlen < sizeof(dest)) return drop("header too short");
  std::memcpy(&dest, header, sizeof(dest));
  UcxChannel* ch = a->dev->ChannelForId(dest);
  if (ch == nullptr) return drop("unknown channel");
  return ch->OnAm(a->id, static_cast<const uint8_t*>(header) + sizeof(dest),
                  hlen - sizeof(dest), data, len, param);
}

}  // namespace membox::transport::ucx
