#include "bench/transfer/transfer_bench.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <immintrin.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include "membox/base/logging.h"
#include "membox/base/subprocess.h"
#include "membox/base/wire.h"
#include "membox/service/client.h"
#include "membox/service/server.h"
#include "membox/transport/device.h"
#include "membox/transport/tensor_transfer.h"

#include "bench/transfer/tensor_service.grpc.pb.h"

namespace membox::bench {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using transport::Device;
using transport::DeviceOptions;

// The receiver's consumer, as the paper's reduce_max: one pass over the
// tensor as float32 with SSE max.
float ReduceMax(const void* data, size_t bytes) {
  const float* f = static_cast<const float*>(data);
  size_t n = bytes / 4;
  __m128 m0 = _mm_set1_ps(-3.0e38f), m1 = m0, m2 = m0, m3 = m0;
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    m0 = _mm_max_ps(m0, _mm_loadu_ps(f + i));
    m1 = _mm_max_ps(m1, _mm_loadu_ps(f + i + 4));
    m2 = _mm_max_ps(m2, _mm_loadu_ps(f + i + 8));
    m3 = _mm_max_ps(m3, _mm_loadu_ps(f + i + 12));
  }
  m0 = _mm_max_ps(_mm_max_ps(m0, m1), _mm_max_ps(m2, m3));
  float lanes[4];
  _mm_storeu_ps(lanes, m0);
  float m =
      std::max(std::max(lanes[0], lanes[1]), std::max(lanes[2], lanes[3]));
  for (; i < n; ++i) m = std::max(m, f[i]);
  return m;
}

// ------------------------------------------------------------ peer side

class TensorServiceImpl final : public TensorService::Service {
  grpc::Status Send(grpc::ServerContext*, const Tensor* req,
                    Ack* resp) override {
    resp->set_max(ReduceMax(req->data().data(), req->data().size()));
    resp->set_bytes(req->data().size());
    return grpc::Status::OK;
  }
};

int RunGrpcPeer() {
  TensorServiceImpl service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                           &port);
  builder.SetMaxReceiveMessageSize(-1);
  builder.SetMaxSendMessageSize(-1);
  builder.RegisterService(&service);
  auto server = builder.BuildAndStart();
  if (!server || port == 0) {
    std::fprintf(stderr, "grpc peer: cannot start server\n");
    return 1;
  }
  std::printf("READY 127.0.0.1:%d\n", port);
  std::fflush(stdout);
  // The driver closes our stdin when it is done.
  char c;
  while (read(0, &c, 1) > 0) {
  }
  server->Shutdown();
  return 0;
}

// The service layer's echo: a request's body comes back as the reply
// (`membox bench-peer transfer service-auto|service-tcp`). The serial loop
// polls its channels before blocking, as the parameter proxy does.
class EchoService final : public service::Service {
 public:
  service::Server* server = nullptr;
  void OnConnect(service::ConnectionId conn, const std::string&) override {
    server->Establish(conn);
  }
  void OnRequest(const service::Request& r) override {
    std::vector<uint8_t> body = service::NewMessage(r.body.size());
    body.insert(body.end(), r.body.begin(), r.body.end());
    server->Reply(r, Status::Ok(), std::move(body));
  }
};

int RunServicePeer(const std::string& transports) {
  EchoService svc;
  service::ServerOptions o;
  o.device.listen_address = "127.0.0.1:0";
  o.device.transports = transports;
  o.device.name = "bench-echo";
  o.service = "echo";
  o.poll_before_block = 300us;
  auto server = service::Server::Create(o, &svc);
  if (!server.ok()) {
    std::fprintf(stderr, "peer: %s\n", server.status().ToString().c_str());
    return 1;
  }
  svc.server = server->get();
  if (Status s = (*server)->Serve(); !s.ok()) {
    std::fprintf(stderr, "peer: %s\n", s.ToString().c_str());
    return 1;
  }
  std::printf("READY %s\n", (*server)->endpoint().c_str());
  std::fflush(stdout);
  char c;
  while (read(0, &c, 1) > 0) {
  }
  (*server)->Stop();
  return 0;
}

// Request/reply round trips of a `bytes`-byte body through the service
// layer: (p50, p99) in seconds.
Result<std::pair<double, double>> ServiceRoundTrips(const std::string& ep,
                                                    const std::string& trans,
                                                    size_t bytes, int n) {
  DeviceOptions o;
  o.transports = trans;
  o.name = "bench-rtt";
  ASSIGN_OR_RETURN(auto dev, Device::Create(o));
  service::ClientOptions co;
  co.node_kind = "echo node";
  ASSIGN_OR_RETURN(auto c, service::Client::Connect(*dev, ep, co));
  std::vector<double> t;
  t.reserve(n);
  for (int i = 0; i < n + n / 10; ++i) {  // the first tenth warms up
    std::vector<uint8_t> m = service::NewMessage(bytes);
    m.resize(service::kHeaderBytes + bytes, static_cast<uint8_t>(i));
    auto t0 = Clock::now();
    ASSIGN_OR_RETURN(auto reply, c->Call(1, std::move(m), 10s));
    double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    if (reply.size() != bytes) return DataLossError("echo changed the size");
    if (i >= n / 10) t.push_back(dt);
  }
  std::sort(t.begin(), t.end());
  return std::make_pair(t[t.size() / 2], t[t.size() * 99 / 100]);
}

int RunMemboxPeer(const std::string& transports) {
  DeviceOptions o;
  o.listen_address = "127.0.0.1:0";
  o.transports = transports;
  o.name = "bench-recv";
  auto dev = Device::Create(o);
  if (!dev.ok()) {
    std::fprintf(stderr, "peer: %s\n", dev.status().ToString().c_str());
    return 1;
  }
  std::printf("READY %s\n", (*dev)->listen_endpoint().c_str());
  std::fflush(stdout);
  auto ch = (*dev)->Accept(120s);
  if (!ch.ok()) {
    std::fprintf(stderr, "peer: %s\n", ch.status().ToString().c_str());
    return 1;
  }
  for (;;) {
    auto msg = (*ch)->RecvControl(600s);
    if (!msg.ok()) {
      std::fprintf(stderr, "peer: %s\n", msg.status().ToString().c_str());
      return 1;
    }
    wire::Reader r(*msg);
    uint8_t type = 0;
    uint64_t size = 0, iters = 0;
    uint8_t consume = 0;
    if (!r.U8(&type) || type == 'Q') return 0;
    if (type != 'R' || !r.U64(&size) || !r.U64(&iters) || !r.U8(&consume)) {
      std::fprintf(stderr, "peer: bad round message\n");
      return 1;
    }
    auto recv = transport::StaticTensorReceiver::Create(**dev, *ch, size, 60s);
    if (!recv.ok()) {
      std::fprintf(stderr, "peer: %s\n", recv.status().ToString().c_str());
      return 1;
    }
    volatile float sink = 0;
    for (uint64_t i = 0; i < iters; ++i) {
      Status s = (*recv)->Wait(120s);
      if (!s.ok()) {
        std::fprintf(stderr, "peer: %s\n", s.ToString().c_str());
        return 1;
      }
      if (consume) sink = sink + ReduceMax((*recv)->data(), size);
      s = (*recv)->Release();
      if (!s.ok()) {
        std::fprintf(stderr, "peer: %s\n", s.ToString().c_str());
        return 1;
      }
    }
  }
}

// ------------------------------------------------------------ driver side

// A receiver process: `membox bench-peer transfer MODE`, which prints
// "READY host:port" and serves until told to quit or its stdin closes.
struct Child {
  std::optional<Subprocess> proc;
  std::string endpoint;

  static Result<Child> Spawn(const std::vector<std::string>& args) {
    std::vector<std::string> argv = args;
    argv[0] = "/proc/self/exe";
    Child c;
    c.proc = Subprocess::Start(argv);
    if (!c.proc) return InternalError("cannot spawn the receiver process");
    auto ep = c.proc->WaitFor("READY ", std::chrono::seconds(30));
    if (!ep) return UnavailableError("receiver process did not start");
    c.endpoint = *ep;
    return c;
  }

  void Stop() {
    if (!proc) return;
    proc->CloseStdin();
    if (!proc->Wait(std::chrono::seconds(2))) {
      proc->Kill(9);
      (void)proc->Wait(std::chrono::seconds(5));
    }
  }
};

// Per-tensor time of a measured loop: the loop runs in kBatches batches and
// the median batch is reported, so a burst of interference from the other
// processes on this 2-core machine does not decide the figure.
constexpr int kBatches = 5;

template <typename Fn>
Result<double> MedianPerOp(uint64_t iters, Fn&& batch) {
  uint64_t per = std::max<uint64_t>(1, iters / kBatches);
  std::vector<double> t;
  for (int b = 0; b < kBatches; ++b) {
    auto t0 = Clock::now();
    RETURN_IF_ERROR(batch(per));
    t.push_back(std::chrono::duration<double>(Clock::now() - t0).count() /
                static_cast<double>(per));
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

uint64_t Iterations(uint64_t size, bool quick, uint64_t cap) {
  uint64_t budget = quick ? (96ull << 20) : (1ull << 30);
  uint64_t it = budget / size;
  return std::clamp<uint64_t>(it, kBatches, cap);
}

void Touch(void* p, size_t n) { std::memset(p, 1, n); }

// One membox variant against one receiver process.
class MemboxSender {
 public:
  static Result<std::unique_ptr<MemboxSender>> Connect(
      const std::string& transports, const std::string& endpoint) {
    auto s = std::make_unique<MemboxSender>();
    DeviceOptions o;
    o.transports = transports;
    o.name = "bench-send";
    ASSIGN_OR_RETURN(s->dev_, Device::Create(o));
    ASSIGN_OR_RETURN(s->ch_, s->dev_->GetChannel(endpoint, 0));
    return s;
  }

  // Seconds per tensor: send + the receiver consuming and releasing it.
  Result<double> Run(uint64_t size, uint64_t iters, bool consume, bool copy) {
    const uint64_t warm = 1;
    const uint64_t per = std::max<uint64_t>(1, iters / kBatches);
    wire::Writer w;
    w.U8('R');
    w.U64(size);
    w.U64(warm + per * kBatches);
    w.U8(consume ? 1 : 0);
    RETURN_IF_ERROR(ch_->SendControl(w.buffer()));
    ASSIGN_OR_RETURN(auto sender,
                     transport::StaticTensorSender::Create(*dev_, ch_, 60s));
    ASSIGN_OR_RETURN(auto region, dev_->AllocateMemRegion(size));
    Touch(region->data(), size);
    std::vector<uint8_t> heap;
    if (copy) {
      heap.resize(size);
      Touch(heap.data(), size);
    }
    auto one = [&]() -> Status {
      if (copy)
        std::memcpy(region->data(), heap.data(), size);  // the paper's RDMA.cp
      return sender->Send(region->data(), *region, size, 120s);
    };
    for (uint64_t i = 0; i < warm; ++i) RETURN_IF_ERROR(one());
    RETURN_IF_ERROR(sender->WaitReleased(120s));
    return MedianPerOp(iters, [&](uint64_t n) -> Status {
      for (uint64_t i = 0; i < n; ++i) RETURN_IF_ERROR(one());
      return sender->WaitReleased(120s);
    });
  }

  void Quit() {
    uint8_t q = 'Q';
    (void)ch_->SendControl({&q, 1});
  }

  std::string protocol() const {
    return transport::ProtocolName(ch_->protocol());
  }

 private:
  std::unique_ptr<Device> dev_;
  std::shared_ptr<transport::Channel> ch_;
};

Result<double> RunGrpc(TensorService::Stub& stub, uint64_t size,
                       uint64_t iters) {
  std::vector<uint8_t> src(size);
  Touch(src.data(), size);
  auto one = [&]() -> Status {
    Tensor req;
    req.set_data(src.data(), size);
    Ack resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + 300s);
    grpc::Status s = stub.Send(&ctx, req, &resp);
    if (!s.ok()) return UnavailableError("grpc: " + s.error_message());
    if (resp.bytes() != size)
      return DataLossError("grpc: wrong size acknowledged");
    return Status::Ok();
  };
  RETURN_IF_ERROR(one());
  return MedianPerOp(iters, [&](uint64_t n) -> Status {
    for (uint64_t i = 0; i < n; ++i) RETURN_IF_ERROR(one());
    return Status::Ok();
  });
}

double MemcpySeconds(uint64_t size, uint64_t iters) {
  std::vector<uint8_t> a(size), b(size);
  Touch(a.data(), size);
  Touch(b.data(), size);
  std::memcpy(b.data(), a.data(), size);
  auto r = MedianPerOp(iters, [&](uint64_t n) -> Status {
    for (uint64_t i = 0; i < n; ++i) {
      std::memcpy(b.data(), a.data(), size);
      asm volatile("" ::: "memory");
    }
    return Status::Ok();
  });
  return *r;
}

// Single-stream loopback iperf3 throughput in bytes/s, or nullopt if iperf3
// is missing.
std::optional<double> Iperf3BytesPerSecond(bool quick) {
  if (access("/usr/bin/iperf3", X_OK) != 0) return std::nullopt;
  int port = 15201 + static_cast<int>(getpid() % 1000);
  std::string server =
      "/usr/bin/iperf3 -s -1 -p " + std::to_string(port) + " >/dev/null 2>&1 &";
  if (std::system(server.c_str()) != 0) return std::nullopt;
  std::this_thread::sleep_for(300ms);
  std::string client = "/usr/bin/iperf3 -c 127.0.0.1 -p " +
                       std::to_string(port) + " -t " + (quick ? "1" : "3") +
                       " -J 2>/dev/null";
  FILE* p = popen(client.c_str(), "r");
  if (!p) return std::nullopt;
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  pclose(p);
  auto pos = out.find("\"sum_received\"");
  if (pos == std::string::npos) return std::nullopt;
  pos = out.find("\"bits_per_second\"", pos);
  if (pos == std::string::npos) return std::nullopt;
  pos = out.find(':', pos);
  return std::strtod(out.c_str() + pos + 1, nullptr) / 8.0;
}

void AddTiming(Report& rep, const std::string& variant, uint64_t size,
               double secs, const std::string& metric_prefix = "") {
  Record t;
  t.variant = variant;
  t.size_bytes = size;
  t.workers = 2;
  t.metric = metric_prefix + "time_per_tensor";
  t.value = secs * 1e6;
  t.unit = "us";
  rep.Add(t);
  Record g = t;
  g.metric = metric_prefix + "throughput";
  g.value = static_cast<double>(size) / secs / 1e9;
  g.unit = "GB/s";
  rep.Add(g);
}

// Request/reply round trips through the service layer (the envelope, the
// server's serial loop, the client's pending map and Call) with bodies of
// each of `bodies` bytes: what every memory-server, proxy and embedding
// request pays.
Status ServiceRtts(const TransferOptions& opt, int& step, int total,
                   Report& rep, const std::vector<uint64_t>& bodies) {
  Progress(++step, total, "service round trip");
  for (const char* trans : {"auto", "tcp"}) {
    ASSIGN_OR_RETURN(auto child,
                     Child::Spawn({"membox", "bench-peer", "transfer",
                                   std::string("service-") + trans}));
    std::string variant = std::string("service-") + trans;
    for (uint64_t body : bodies) {
      int n = opt.common.quick ? 2000 : 20000;
      auto r = ServiceRoundTrips(child.endpoint, trans, body, n);
      if (!r.ok()) {
        child.Stop();
        return r.status();
      }
      rep.Add({"", variant, body, 2, "rtt_p50", r->first * 1e6, "us", ""});
      rep.Add({"", variant, body, 2, "rtt_p99", r->second * 1e6, "us", ""});
      std::printf(
          "service round trip, %s, %6s body: p50 %8.2f us  p99 %8.2f us\n",
          trans, SizeLabel(body).c_str(), r->first * 1e6, r->second * 1e6);
    }
    child.Stop();
  }
  return Status::Ok();
}

std::string Ratio(std::optional<double> a, std::optional<double> b) {
  if (!a || !b || *b == 0) return "-";
  char s[32];
  std::snprintf(s, sizeof(s), "%.2fx", *a / *b);
  return s;
}

std::string Num(std::optional<double> v) {
  if (!v) return "-";
  char s[32];
  std::snprintf(s, sizeof(s), "%.3f", *v);
  return s;
}

}  // namespace

int RunTransferPeer(const std::string& mode) {
  if (mode == "grpc") return RunGrpcPeer();
  if (mode == "auto" || mode == "tcp") return RunMemboxPeer(mode);
  if (mode == "service-auto") return RunServicePeer("auto");
  if (mode == "service-tcp") return RunServicePeer("tcp");
  std::fprintf(stderr, "unknown peer mode '%s'\n", mode.c_str());
  return 2;
}

int RunTransferBench(const TransferOptions& opt) {
  std::vector<uint64_t> sizes;
  if (opt.common.quick) {
    for (uint64_t s :
         {1ull << 10, 64ull << 10, 1ull << 20, 16ull << 20, 64ull << 20}) {
      if (s >= opt.min_size && s <= opt.max_size) sizes.push_back(s);
    }
  } else {
    for (uint64_t s = opt.min_size; s <= opt.max_size; s *= 4)
      sizes.push_back(s);
  }
  if (sizes.empty()) {
    std::fprintf(stderr, "no sizes in [%s, %s]\n",
                 SizeLabel(opt.min_size).c_str(),
                 SizeLabel(opt.max_size).c_str());
    return 2;
  }
  Report rep("transfer");
  if (opt.rtt_only) {
    int step = 0;
    if (Status rs = ServiceRtts(opt, step, 1, rep, {64, 1024, 16384, 65536});
        !rs.ok()) {
      std::fprintf(stderr, "service round trip failed: %s\n",
                   rs.ToString().c_str());
      return 1;
    }
    Status s = rep.Finish(opt.common, "rtt_p50",
                          "membox bench transfer --rtt-only", true);
    if (!s.ok()) {
      std::fprintf(stderr, "%s\n", s.ToString().c_str());
      return 1;
    }
    return 0;
  }
  auto shm_child = Child::Spawn({"membox", "bench-peer", "transfer", "auto"});
  auto tcp_child = Child::Spawn({"membox", "bench-peer", "transfer", "tcp"});
  if (!shm_child.ok() || !tcp_child.ok()) {
    std::fprintf(stderr, "cannot start receivers\n");
    return 1;
  }
  auto shm = MemboxSender::Connect("auto", shm_child->endpoint);
  auto tcp = MemboxSender::Connect("tcp", tcp_child->endpoint);
  if (!shm.ok() || !tcp.ok()) {
    std::fprintf(stderr, "cannot connect: %s %s\n",
                 shm.status().ToString().c_str(),
                 tcp.status().ToString().c_str());
    return 1;
  }
  std::fprintf(stderr,
               "membox over shared memory uses protocol '%s'; over TCP '%s'\n",
               (*shm)->protocol().c_str(), (*tcp)->protocol().c_str());
  std::optional<Child> grpc_child;
  std::unique_ptr<TensorService::Stub> stub;
  if (opt.with_grpc) {
    auto c = Child::Spawn({"membox", "bench-peer", "transfer", "grpc"});
    if (!c.ok()) {
      std::fprintf(stderr, "cannot start the gRPC receiver\n");
      return 1;
    }
    grpc_child = std::move(*c);
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    args.SetMaxSendMessageSize(-1);
    stub = TensorService::NewStub(grpc::CreateCustomChannel(
        grpc_child->endpoint, grpc::InsecureChannelCredentials(), args));
  }

  int total = static_cast<int>(sizes.size()) + 2;
  int step = 0;
  auto fail = [&](const Status& s, const char* what) {
    std::fprintf(stderr, "%s failed: %s\n", what, s.ToString().c_str());
    return 1;
  };
  for (uint64_t size : sizes) {
    Progress(++step, total, "size " + SizeLabel(size));
    uint64_t iters = Iterations(size, opt.common.quick, 20000);
    auto zc = (*shm)->Run(size, iters, true, false);
    if (!zc.ok()) return fail(zc.status(), "membox-zerocopy");
    AddTiming(rep, "membox-zerocopy", size, *zc);
    auto zx = (*shm)->Run(size, iters, false, false);
    if (!zx.ok()) return fail(zx.status(), "membox-zerocopy transfer");
    AddTiming(rep, "membox-zerocopy", size, *zx, "transfer_");
    auto cp = (*shm)->Run(size, iters, true, true);
    if (!cp.ok()) return fail(cp.status(), "membox-copy");
    AddTiming(rep, "membox-copy", size, *cp);
    auto tc = (*tcp)->Run(size, Iterations(size, opt.common.quick, 5000), true,
                          false);
    if (!tc.ok()) return fail(tc.status(), "membox-tcp");
    AddTiming(rep, "membox-tcp", size, *tc);
    if (stub) {
      auto g = RunGrpc(*stub, size, Iterations(size, opt.common.quick, 3000));
      if (!g.ok()) return fail(g.status(), "grpc-tcp");
      AddTiming(rep, "grpc-tcp", size, *g);
    }
    AddTiming(rep, "memcpy-bound", size, MemcpySeconds(size, iters),
              "transfer_");
  }
  // One-way latency of a 64-byte tensor: half the send -> release round trip.
  Progress(++step, total, "64-byte latency");
  auto lat = (*shm)->Run(64, opt.common.quick ? 20000 : 100000, false, false);
  if (!lat.ok()) return fail(lat.status(), "latency");
  rep.Add({"", "membox-zerocopy", 64, 2, "one_way_latency", *lat / 2 * 1e6,
           "us", ""});
  auto tlat = (*tcp)->Run(64, opt.common.quick ? 2000 : 10000, false, false);
  if (tlat.ok())
    rep.Add({"", "membox-tcp", 64, 2, "one_way_latency", *tlat / 2 * 1e6, "us",
             ""});
  if (Status rs = ServiceRtts(opt, step, total, rep, {64}); !rs.ok()) {
    return fail(rs, "service round trip");
  }
  std::optional<double> iperf;
  if (opt.with_iperf) {
    iperf = Iperf3BytesPerSecond(opt.common.quick);
    if (iperf)
      rep.Add({"", "iperf3-tcp", 64ull << 20, 2, "throughput", *iperf / 1e9,
               "GB/s", ""});
  }
  (*shm)->Quit();
  (*tcp)->Quit();
  shm_child->Stop();
  tcp_child->Stop();
  if (grpc_child) grpc_child->Stop();

  std::printf(
      "\nmembox bench transfer: one tensor sent and consumed (reduce_max) "
      "between two "
      "processes; GB/s\n\n");
  std::printf("%8s %10s %10s %10s %10s | %10s %10s | %8s %8s %8s %8s\n", "size",
              "zerocopy", "copy", "tcp", "grpc", "zc-xfer", "memcpy", "zc/grpc",
              "zc/copy", "xfer/mc", "tcp/grpc");
  for (uint64_t size : sizes) {
    auto zc = rep.Find("membox-zerocopy", size, "throughput");
    auto cp = rep.Find("membox-copy", size, "throughput");
    auto tc = rep.Find("membox-tcp", size, "throughput");
    auto gr = rep.Find("grpc-tcp", size, "throughput");
    auto zx = rep.Find("membox-zerocopy", size, "transfer_throughput");
    auto mc = rep.Find("memcpy-bound", size, "transfer_throughput");
    std::printf("%8s %10s %10s %10s %10s | %10s %10s | %8s %8s %8s %8s\n",
                SizeLabel(size).c_str(), Num(zc).c_str(), Num(cp).c_str(),
                Num(tc).c_str(), Num(gr).c_str(), Num(zx).c_str(),
                Num(mc).c_str(), Ratio(zc, gr).c_str(), Ratio(zc, cp).c_str(),
                Ratio(zx, mc).c_str(), Ratio(tc, gr).c_str());
  }
  std::printf("\none-way 64-byte latency: shared memory %.2f us, TCP %s us\n",
              *lat / 2 * 1e6, tlat.ok() ? Num(*tlat / 2 * 1e6).c_str() : "-");
  if (iperf) {
    auto tc64 = rep.Find("membox-tcp", 64ull << 20, "throughput");
    std::printf(
        "single-stream iperf3 loopback: %.3f GB/s; membox-tcp at 64MiB / "
        "iperf3 = %s\n",
        *iperf / 1e9, Ratio(tc64, *iperf / 1e9).c_str());
  }
  Status s = rep.Finish(opt.common, "throughput",
                        "membox bench transfer (send + reduce_max)", true);
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace membox::bench
