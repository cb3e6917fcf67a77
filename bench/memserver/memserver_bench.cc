#include "bench/memserver/memserver_bench.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <sstream>
#include <thread>

#include "membox/base/config.h"
#include "membox/base/copy.h"
#include "membox/base/subprocess.h"
#include "membox/memserver/client.h"

#include "bench/common/server_process.h"

namespace membox::bench {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

double Seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

std::string ReadSecret(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "r");
  if (!f) return "";
  char buf[1024] = {0};
  if (!std::fgets(buf, sizeof(buf), f)) buf[0] = 0;
  std::fclose(f);
  std::string s(buf);
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
  return s;
}

// Aggregate GB/s of two threads each copying `bytes` repeatedly for `secs`,
// with glibc's memcpy (the bound) or with streaming stores (the best
// copy this machine does, membox::StreamingCopy; what the clients' syncs use
// for large segments).
double TwoThreadCopy(size_t bytes, double secs, bool streaming) {
  std::vector<double> gbps(2);
  std::vector<std::thread> t;
  for (int i = 0; i < 2; ++i) {
    t.emplace_back([&, i] {
      std::vector<uint8_t> a(bytes, 1), b(bytes, 2);
      uint64_t moved = 0;
      auto t0 = Clock::now();
      while (Seconds(Clock::now() - t0) < secs) {
        if (streaming) {
          StreamingCopy(b.data(), a.data(), bytes);
        } else {
          std::memcpy(b.data(), a.data(), bytes);
        }
        asm volatile("" ::: "memory");
        moved += bytes;
      }
      gbps[static_cast<size_t>(i)] =
          static_cast<double>(moved) / Seconds(Clock::now() - t0) / 1e9;
    });
  }
  for (auto& th : t) th.join();
  return gbps[0] + gbps[1];
}

// Seconds for dst += src over `count` floats with two threads (the bound for
// the server's accumulate on its two sync cores).
double TwoThreadReduce(std::vector<float>& d, const std::vector<float>& s) {
  auto run = [&](size_t begin, size_t end) {
    float* __restrict dp = d.data();
    const float* __restrict sp = s.data();
    for (size_t i = begin; i < end; ++i) dp[i] += sp[i];
  };
  std::vector<double> times;
  for (int rep = 0; rep < 5; ++rep) {
    auto t0 = Clock::now();
    std::thread a(run, 0, d.size() / 2);
    run(d.size() / 2, d.size());
    a.join();
    times.push_back(Seconds(Clock::now() - t0));
  }
  std::sort(times.begin(), times.end());
  return times[2];
}

struct Peer {
  Subprocess proc;
};

}  // namespace

int RunMemserverPeer(const std::vector<std::string>& args) {
  if (args.size() != 4) {
    std::fprintf(
        stderr,
        "usage: bench-peer memserver ENDPOINT SECRET_FILE BYTES TRANSPORTS\n");
    return 2;
  }
  memserver::ClientOptions o;
  o.server = args[0];
  o.secret = ReadSecret(args[1]);
  o.transports = args[3];
  o.name = "bench-client-" + std::to_string(getpid());
  size_t bytes = std::stoull(args[2]);
  auto c = memserver::Client::Connect(o);
  if (!c.ok()) {
    std::fprintf(stderr, "peer: %s\n", c.status().ToString().c_str());
    return 1;
  }
  auto seg = (*c)->Create(0, bytes);
  if (!seg.ok()) {
    std::fprintf(stderr, "peer: %s\n", seg.status().ToString().c_str());
    return 1;
  }
  std::memset((*seg)->data(), 1, bytes);
  (void)(*c)->WriteSync(*seg, 0, bytes);
  std::printf("READY\n");
  std::fflush(stdout);
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd, mode;
    double secs = 0;
    long long start_ns = 0;
    in >> cmd >> mode >> secs >> start_ns;
    if (cmd != "GO") break;
    // Every client starts at the same instant (steady_clock is the
    // system-wide CLOCK_MONOTONIC) and counts only the transfers that
    // finish inside [start, start + secs], while it keeps transferring
    // until past the end: all clients run during the whole window.
    const auto start = Clock::time_point(std::chrono::nanoseconds(start_ns));
    const auto end = start + std::chrono::duration_cast<Clock::duration>(
                                 std::chrono::duration<double>(secs));
    std::this_thread::sleep_until(start);
    double moved = 0;
    for (int i = 0; Clock::now() < end; ++i) {
      bool write = mode == "write" || (mode == "mixed" && i % 2 == 1);
      const auto a = Clock::now();
      Status s = write ? (*c)->WriteSync(*seg, 0, bytes)
                       : (*c)->ReadSync(*seg, 0, bytes);
      if (!s.ok()) {
        std::fprintf(stderr, "peer: %s\n", s.ToString().c_str());
        return 1;
      }
      const auto b = Clock::now();
      // A transfer that ends past the window counts for its share inside.
      moved += b <= end ? double(bytes)
                        : double(bytes) * Seconds(end - a) / Seconds(b - a);
    }
    std::printf("DONE %llu %.6f\n", static_cast<unsigned long long>(moved),
                secs);  // bytes inside the common window, its length
    std::fflush(stdout);
  }
  (void)(*c)->Delete(*seg);
  return 0;
}

int RunMemserverBench(const MemserverBenchOptions& opt) {
  const bool quick = opt.common.quick;
  std::vector<int> counts =
      quick ? std::vector<int>{2, 4, 8} : std::vector<int>{2, 4, 8, 16, 32};
  const size_t seg = quick ? (32u << 20) : (64u << 20);
  const double secs = quick ? 0.6 : 1.5;
  const uint64_t pool =
      static_cast<uint64_t>(counts.back()) * seg + (512ull << 20);
  auto server = ServerProcess::Start(pool, opt.transports);
  if (!server.ok()) {
    std::fprintf(stderr, "%s\n", server.status().ToString().c_str());
    return 1;
  }
  Report rep("memserver");
  const char* modes[] = {"read", "write", "mixed"};
  int step = 0, total = static_cast<int>(counts.size()) + 2;
  for (int n : counts) {
    Progress(
        ++step, total,
        std::to_string(n) + " client processes, " + SizeLabel(seg) + " each");
    std::vector<Subprocess> peers;
    for (int i = 0; i < n; ++i) {
      auto p = Subprocess::Start({"/proc/self/exe", "bench-peer", "memserver",
                                  server->endpoint(), server->secret_file(),
                                  std::to_string(seg), opt.transports});
      if (!p) return 1;
      peers.push_back(std::move(*p));
    }
    for (auto& p : peers) {
      if (!p.WaitFor("READY", 120s)) {
        std::fprintf(stderr, "a client process did not start\n");
        return 1;
      }
    }
    for (const char* mode : modes) {
      // The window in which all clients run together (issue 47: dividing
      // every byte by the longest client's own window overstated the
      // aggregate when the windows were staggered).
      const auto start = Clock::now() + std::chrono::milliseconds(300);
      char cmd[96];
      std::snprintf(cmd, sizeof(cmd), "GO %s %.3f %lld", mode, secs,
                    static_cast<long long>(
                        std::chrono::duration_cast<std::chrono::nanoseconds>(
                            start.time_since_epoch())
                            .count()));
      for (auto& p : peers) p.WriteLine(cmd);
      double bytes = 0, longest = 0;
      for (auto& p : peers) {
        auto done = p.WaitFor("DONE ", 120s);
        if (!done) {
          std::fprintf(stderr, "a client process failed\n");
          return 1;
        }
        unsigned long long b = 0;
        double t = 0;
        std::sscanf(done->c_str(), "%llu %lf", &b, &t);
        bytes += static_cast<double>(b);
        longest = std::max(longest, t);
      }
      rep.Add({"", "membox", seg, n, std::string(mode) + "_bandwidth",
               bytes / longest / 1e9, "GB/s", ""});
    }
    for (auto& p : peers) p.CloseStdin();
    for (auto& p : peers) p.Wait(30s);
  }
  double bound = TwoThreadCopy(seg, secs * 2, false);
  double stream_bound = TwoThreadCopy(seg, secs * 2, true);
  for (int n : counts) {
    rep.Add({"", "memcpy-bound", seg, n, "bandwidth", bound, "GB/s", ""});
    rep.Add({"", "streaming-copy-bound", seg, n, "bandwidth", stream_bound,
             "GB/s", ""});
  }

  // Attach latency and accumulate from this process.
  Progress(++step, total, "attach latency and 64 MiB accumulate");
  memserver::ClientOptions o;
  o.server = server->endpoint();
  o.secret = server->secret();
  o.transports = opt.transports;
  o.name = "bench-driver";
  auto master = memserver::Client::Connect(o);
  o.name = "bench-attacher";
  auto other = memserver::Client::Connect(o);
  if (!master.ok() || !other.ok()) {
    std::fprintf(stderr, "cannot connect\n");
    return 1;
  }
  auto s = (*master)->Create(0, 1 << 20);
  if (!s.ok()) return 1;
  std::vector<double> lat;
  for (int i = 0; i < (quick ? 100 : 500); ++i) {
    auto t0 = Clock::now();
    auto a = (*other)->Attach((*s)->key(), 1 << 20);
    lat.push_back(Seconds(Clock::now() - t0) * 1e6);
    if (!a.ok() || !(*other)->Detach(*a).ok()) {
      std::fprintf(stderr, "attach failed\n");
      return 1;
    }
  }
  std::sort(lat.begin(), lat.end());
  rep.Add({"", "membox", 1 << 20, 2, "attach_latency", lat[lat.size() / 2],
           "us", ""});
  rep.Add({"", "membox", 1 << 20, 2, "attach_latency_p99",
           lat[lat.size() * 99 / 100], "us", ""});

  const size_t acc_bytes = 64 << 20;
  auto d = (*master)->Create(0, acc_bytes);
  auto g = (*master)->Create(0, acc_bytes);
  if (!d.ok() || !g.ok()) return 1;
  std::vector<double> acc;
  for (int i = 0; i < 7; ++i) {
    auto t0 = Clock::now();
    if (!(*master)->Accumulate(*d, *g, DType::kFloat32).ok()) return 1;
    acc.push_back(Seconds(Clock::now() - t0));
  }
  std::sort(acc.begin(), acc.end());
  std::vector<float> dv(acc_bytes / 4, 1.0f), sv(acc_bytes / 4, 2.0f);
  double reduce = TwoThreadReduce(dv, sv);
  rep.Add({"", "membox", acc_bytes, 2, "accumulate_bandwidth",
           acc_bytes / acc[3] / 1e9, "GB/s", ""});
  rep.Add({"", "reduce-bound", acc_bytes, 2, "accumulate_bandwidth",
           acc_bytes / reduce / 1e9, "GB/s", ""});
  Progress(++step, total, "done");

  std::printf(
      "\nmembox bench memserver: %s per client process, aggregate GB/s "
      "(bounds, same run: 2-thread memcpy %.2f GB/s = mc; 2-thread streaming "
      "copy %.2f GB/s = sc)\n\n",
      SizeLabel(seg).c_str(), bound, stream_bound);
  std::printf("%8s %10s %10s %10s | %8s %8s %8s | %8s %8s %8s\n", "clients",
              "read", "write", "mixed", "rd/mc", "wr/mc", "mix/mc", "rd/sc",
              "wr/sc", "mix/sc");
  for (int n : counts) {
    auto r = rep.Find("membox", seg, "read_bandwidth");
    double rv = 0, wv = 0, mv = 0;
    for (const auto& x : rep.records()) {
      if (x.variant != "membox" || x.workers != n) continue;
      if (x.metric == "read_bandwidth") rv = x.value;
      if (x.metric == "write_bandwidth") wv = x.value;
      if (x.metric == "mixed_bandwidth") mv = x.value;
    }
    (void)r;
    std::printf(
        "%8d %10.2f %10.2f %10.2f | %7.2fx %7.2fx %7.2fx | %7.2fx %7.2fx "
        "%7.2fx\n",
        n, rv, wv, mv, rv / bound, wv / bound, mv / bound, rv / stream_bound,
        wv / stream_bound, mv / stream_bound);
  }
  std::printf("\nattach latency: median %.1f us, p99 %.1f us\n",
              lat[lat.size() / 2], lat[lat.size() * 99 / 100]);
  std::printf(
      "accumulate 64MiB fp32 on the server: %.2f GB/s; same-run 2-thread "
      "reduce "
      "%.2f GB/s; ratio %.2fx\n",
      acc_bytes / acc[3] / 1e9, acc_bytes / reduce / 1e9, reduce / acc[3]);
  Status st = rep.Finish(
      opt.common, "read_bandwidth,write_bandwidth,mixed_bandwidth,bandwidth",
      "membox bench memserver: aggregate GB/s vs 2-thread memcpy and streaming "
      "copy",
      false, "workers");
  if (!st.ok()) {
    std::fprintf(stderr, "%s\n", st.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace membox::bench
