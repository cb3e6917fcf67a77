#include "bench/allreduce/allreduce_bench.h"

#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <sstream>

#include <mpi.h>
#include <unistd.h>

#include "membox/base/config.h"
#include "membox/base/subprocess.h"
#include "membox/collective/hierarchical_allreduce.h"
#include "membox/collective/ring_allreduce.h"
#include "membox/ps/param_client.h"

#include "bench/common/mpi_launch.h"
#include "bench/common/mpi_routing.h"
#include "bench/common/server_process.h"

namespace membox::bench {
namespace {

using Clock = std::chrono::steady_clock;

std::vector<std::string> Split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

std::string Join(const std::vector<uint64_t>& v) {
  std::string s;
  for (auto x : v) s += (s.empty() ? "" : ",") + std::to_string(x);
  return s;
}

int ItersFor(uint64_t size, int asked) {
  if (asked > 0) return asked;
  if (size >= (256u << 20)) return 3;
  if (size >= (32u << 20)) return 5;
  return 20;
}

// Median over iterations of the slowest rank's time.
template <typename Fn>
double TimeCollective(int iters, Fn&& fn) {
  std::vector<double> t;
  for (int i = 0; i <= iters; ++i) {  // the first is a warm-up
    MPI_Barrier(MPI_COMM_WORLD);
    auto t0 = Clock::now();
    fn();
    double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    double worst = 0;
    MPI_Allreduce(&dt, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (i > 0) t.push_back(worst);
  }
  std::nth_element(t.begin(), t.begin() + t.size() / 2, t.end());
  return t[t.size() / 2];
}

// Single-thread memcpy bandwidth, best of 3 over 256 MiB.
double MemcpyBandwidth() {
  const size_t n = 256u << 20;
  std::vector<char> a(n, 1), b(n, 2);
  double best = 0;
  for (int i = 0; i < 3; ++i) {
    auto t0 = Clock::now();
    std::memcpy(b.data(), a.data(), n);
    double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    best = std::max(best, n / dt);
  }
  return best;
}

std::map<std::pair<std::string, uint64_t>, double> ReadResults(Subprocess& p,
                                                               size_t expect) {
  std::map<std::pair<std::string, uint64_t>, double> out;
  for (const std::string& line :
       ReadResultLines(p, expect, std::chrono::minutes(10))) {
    char variant[64];
    unsigned long long size;
    double sec;
    if (std::sscanf(line.c_str(), "%63s %llu %lf", variant, &size, &sec) == 3) {
      out[{variant, size}] = sec;
    }
  }
  return out;
}

}  // namespace

int RunAllreduceWorker(const std::vector<std::string>& a) {
  if (a.size() < 5) {
    std::fprintf(stderr,
                 "usage: bench-peer allreduce worker PROXIES|- SECRET_FILE "
                 "SIZES ITERS PARTITION [stripe|profile]\n");
    return 2;
  }
  int provided;
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
  int rank, world;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  std::vector<uint64_t> sizes;
  for (auto& s : Split(a[2])) sizes.push_back(std::stoull(s));
  int iters = std::stoi(a[3]);
  uint64_t partition = std::stoull(a[4]);
  uint64_t largest = *std::max_element(sizes.begin(), sizes.end());
  auto fail = [&](const Status& s) {
    std::fprintf(stderr, "rank %d: error: %s\n", rank, s.ToString().c_str());
    MPI_Abort(MPI_COMM_WORLD, 1);
    return 1;
  };

  if (a[0] != "-") {
    ps::ParamClientOptions o;
    o.proxies = Split(a[0]);
    std::FILE* f = std::fopen(a[1].c_str(), "r");
    char buf[1024] = {0};
    if (!f || !std::fgets(buf, sizeof buf, f)) return fail(NotFoundError(a[1]));
    std::fclose(f);
    o.secret = buf;
    while (!o.secret.empty() && o.secret.back() == '\n') o.secret.pop_back();
    o.rank = rank;
    o.world = world;
    o.name = "bench";
    // Each worker uses the proxy next to it (rank modulo the nodes).
    uint32_t mine = static_cast<uint32_t>(rank % o.proxies.size());
    o.routing.lat_proxy = o.routing.bw_proxy = mine;
    o.routing.threshold = 0;
    o.routing.partition_bytes = partition;
    // "stripe": shards spread over all proxies (routing.h) instead of each
    // worker using the one next to it and the proxies' ring.
    o.routing.stripe = a.size() > 5 && a[5] == "stripe";
    auto c = ps::ParamClient::Connect(o);
    if (!c.ok()) return fail(c.status());
    auto& client = *c;
    // "profile": what membox's default does -- the profiler measures the
    // nodes and picks routing, striping and shard sizes. Rank 0 measures
    // alone (workers probing the same links at once measure each other)
    // and every rank uses its table.
    if (a.size() > 5 && a[5] == "profile") {
      ps::RoutingTable t;
      BarrierAsleep();
      if (rank == 0) {
        auto r = client->Profile();
        if (!r.ok()) return fail(r.status());
        t = *r;
        std::fprintf(stderr, "routing: %s\n", t.ToString().c_str());
      }
      BroadcastRouting(&t);
      client->SetRouting(t);
    }
    auto in = client->AllocateTensor(largest);
    auto out = client->AllocateTensor(largest);
    if (!in.ok() || !out.ok())
      return fail(in.ok() ? out.status() : in.status());
    float* x = static_cast<float*>(*in);
    float* y = static_cast<float*>(*out);
    std::fill(x, x + largest / 4, float(rank + 1));
    for (size_t i = 0; i < sizes.size(); ++i) {
      uint64_t n = sizes[i];
      auto d = client->Declare(i + 1, n, DType::kFloat32);
      if (!d.ok()) return fail(d.status());
      Status err;
      double t = TimeCollective(ItersFor(n, iters), [&] {
        Status s = client->PushPull(i + 1, x, y).Wait();
        if (!s.ok()) err = s;
      });
      if (!err.ok()) return fail(err);
      float want = float(world) * float(world + 1) / 2;
      if (y[0] != want || y[n / 4 - 1] != want) {
        return fail(DataLossError("wrong sum: " + std::to_string(y[0])));
      }
      if (rank == 0) {
        std::printf("RESULT membox %llu %.9f\n", (unsigned long long)n, t);
        std::fflush(stdout);
      }
    }
    MPI_Barrier(MPI_COMM_WORLD);
  } else {
    std::vector<float> x(largest / 4, float(rank + 1)), y(largest / 4);
    for (uint64_t n : sizes) {
      double t = TimeCollective(ItersFor(n, iters), [&] {
        MPI_Allreduce(x.data(), y.data(), static_cast<int>(n / 4), MPI_FLOAT,
                      MPI_SUM, MPI_COMM_WORLD);
      });
      if (rank == 0) {
        std::printf("RESULT mpi %llu %.9f\n", (unsigned long long)n, t);
        std::fflush(stdout);
      }
    }
  }
  MPI_Finalize();
  return 0;
}

int RunAllreduceBench(const AllreduceOptions& opt) {
  const bool q = opt.common.quick;
  std::vector<int> workers = opt.workers;
  if (workers.empty())
    workers = q ? std::vector<int>{2, 4} : std::vector<int>{2, 4, 8};
  std::vector<uint64_t> sizes = opt.sizes;
  if (sizes.empty()) {
    sizes = q ? std::vector<uint64_t>{4 << 10, 1 << 20, 32 << 20}
              : std::vector<uint64_t>{4 << 10,  64 << 10,  1 << 20,   8 << 20,
                                      32 << 20, 128 << 20, 512u << 20};
  }
  std::vector<int> nodes = opt.nodes;
  if (nodes.empty()) nodes = {1, 2};
  int iters = opt.iterations > 0 ? opt.iterations : (q ? 5 : 0);

  Report report("allreduce");
  double bw = MemcpyBandwidth();
  std::fprintf(stderr, "memcpy bandwidth (1 thread): %.2f GB/s\n", bw / 1e9);
  int total = static_cast<int>(workers.size() *
                               (nodes.size() + 1 + (opt.with_gloo ? 1 : 0)));
  int done = 0;
  auto add = [&](const std::string& variant, int p, uint64_t n, double sec) {
    Record r;
    r.bench = "allreduce";
    r.variant = variant;
    r.size_bytes = n;
    r.workers = p;
    r.metric = "time";
    r.value = sec * 1e3;
    r.unit = "ms";
    report.Add(r);
  };
  auto mpirun = [&](int p, const std::vector<std::string>& args) {
    std::vector<std::string> peer = {"allreduce", "worker"};
    peer.insert(peer.end(), args.begin(), args.end());
    return StartMpiRanks(p, peer);
  };
  const std::string iters_s = std::to_string(iters);
  for (int p : workers) {
    for (uint64_t n : sizes) {
      add("memcpy-bound", p, n, (2.0 * p + 1) * n / bw);
    }
    // MPI_Allreduce.
    Progress(done++, total, "mpi p=" + std::to_string(p));
    {
      auto proc = mpirun(p, {"-", "-", Join(sizes), iters_s,
                             std::to_string(opt.partition_bytes)});
      if (!proc) return 1;
      auto res = ReadResults(*proc, sizes.size());
      proc->Wait(std::chrono::minutes(2));
      for (auto& [k, sec] : res) add("mpi", p, k.second, sec);
    }
    // membox through 1 and 2 memory nodes.
    for (int m : nodes) {
      Progress(done++, total,
               "membox p=" + std::to_string(p) + " nodes=" + std::to_string(m));
      std::vector<std::string> peers;
      auto cluster = ServerProcess::StartProxyCluster(m, 2, &peers);
      if (!cluster.ok()) {
        std::fprintf(stderr, "error: %s\n",
                     cluster.status().ToString().c_str());
        return 1;
      }
      std::vector<ServerProcess> servers = std::move(*cluster);
      std::string list;
      for (auto& pe : peers) list += (list.empty() ? "" : ",") + pe;
      auto proc = mpirun(p, {list, servers[0].secret_file(), Join(sizes),
                             iters_s, std::to_string(opt.partition_bytes)});
      if (!proc) return 1;
      auto res = ReadResults(*proc, sizes.size());
      proc->Wait(std::chrono::minutes(2));
      if (res.size() != sizes.size()) {
        std::fprintf(stderr, "error: membox run p=%d nodes=%d incomplete\n", p,
                     m);
        return 1;
      }
      for (auto& [k, sec] : res) {
        add("membox-" + std::to_string(m) + "node", p, k.second, sec);
      }
    }
    if (opt.with_gloo) {
      Progress(done++, total, "gloo p=" + std::to_string(p));
      auto proc = Subprocess::Start(
          {BaselinePython(),
           std::string(MEMBOX_SOURCE_DIR) +
               "/bench/allreduce/gloo_allreduce.py",
           "--workers", std::to_string(p), "--sizes", Join(sizes), "--iters",
           iters_s, "--port", std::to_string(ServerProcess::FreePort())});
      if (!proc) return 1;
      auto res = ReadResults(*proc, sizes.size());
      proc->Wait(std::chrono::minutes(2));
      for (auto& [k, sec] : res) add("gloo", p, k.second, sec);
    }
  }
  Progress(total, total, "done");

  // Table with the ratios.
  std::printf("\n%-4s %-9s %11s %11s %11s %11s %11s | %8s %8s %8s %8s\n", "p",
              "size", "membox-1", "membox-2", "mpi", "gloo", "bound",
              "best/mpi", "best/gloo", "best/bnd", "2n/1n");
  for (int p : workers) {
    for (uint64_t n : sizes) {
      auto get = [&](const std::string& v) {
        for (auto& r : report.records()) {
          if (r.variant == v && r.size_bytes == n && r.workers == p)
            return r.value;
        }
        return std::nan("");
      };
      double m1 = get("membox-1node"), m2 = get("membox-2node"),
             mpi = get("mpi"), gloo = get("gloo"), bound = get("memcpy-bound");
      double best = std::fmin(m1, m2);
      std::printf(
          "%-4d %-9s %9.3fms %9.3fms %9.3fms %9.3fms %9.3fms | %8.2f %8.2f "
          "%8.2f %8.2f\n",
          p, SizeLabel(n).c_str(), m1, m2, mpi, gloo, bound, best / mpi,
          best / gloo, best / bound, m2 / m1);
    }
  }
  std::printf(
      "(ratios: time of the faster membox variant / baseline; < 1 is "
      "membox faster)\n");
  Status s = report.Finish(opt.common, "time",
                           "allreduce: membox PushPull vs MPI vs Gloo", true);
  if (!s.ok()) {
    std::fprintf(stderr, "error: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}

int RunCollectiveWorker(const std::vector<std::string>& a) {
  if (a.size() < 3) {
    std::fprintf(stderr,
                 "usage: bench-peer collective worker LOCAL SIZES ITERS\n");
    return 2;
  }
  int provided;
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
  int rank, world;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  int local = std::stoi(a[0]);
  std::vector<uint64_t> sizes;
  for (auto& s : Split(a[1])) sizes.push_back(std::stoull(s));
  int iters = std::stoi(a[2]);
  uint64_t largest = *std::max_element(sizes.begin(), sizes.end());
  auto fail = [&](const Status& s) {
    std::fprintf(stderr, "rank %d: error: %s\n", rank, s.ToString().c_str());
    MPI_Abort(MPI_COMM_WORLD, 1);
    return 1;
  };
  auto exchange = [&](const std::string& ep) {
    char mine[128] = {0};
    std::snprintf(mine, sizeof mine, "%s", ep.c_str());
    std::vector<char> all(128 * world);
    MPI_Allgather(mine, 128, MPI_CHAR, all.data(), 128, MPI_CHAR,
                  MPI_COMM_WORLD);
    std::vector<std::string> eps;
    for (int i = 0; i < world; ++i) eps.emplace_back(&all[128 * i]);
    return eps;
  };
  collective::RingOptions ro;
  ro.rank = rank;
  ro.world = world;
  ro.listen = "127.0.0.1:0";
  ro.max_bytes = largest;
  auto ring = collective::RingAllreduce::Create(ro);
  if (!ring.ok()) return fail(ring.status());
  Status st = (*ring)->Connect(exchange((*ring)->endpoint()));
  if (!st.ok()) return fail(st);
  collective::HierarchicalOptions ho;
  ho.rank = rank;
  ho.world = world;
  ho.local_size = local;
  ho.listen = "127.0.0.1:0";
  ho.max_bytes = largest;
  auto hier = collective::HierarchicalAllreduce::Create(ho);
  if (!hier.ok()) return fail(hier.status());
  st = (*hier)->Connect(exchange((*hier)->endpoint()));
  if (!st.ok()) return fail(st);
  std::vector<float> buf(largest / 4, 1.0f);
  for (uint64_t n : sizes) {
    Status err;
    double tr = TimeCollective(ItersFor(n, iters), [&] {
      Status s = (*ring)->Allreduce(buf.data(), n / 4);
      if (!s.ok()) err = s;
    });
    double th = TimeCollective(ItersFor(n, iters), [&] {
      Status s = (*hier)->Allreduce(buf.data(), n / 4);
      if (!s.ok()) err = s;
    });
    if (!err.ok()) return fail(err);
    if (rank == 0) {
      std::printf("RESULT ring %llu %.9f\nRESULT hierarchical %llu %.9f\n",
                  (unsigned long long)n, tr, (unsigned long long)n, th);
      std::fflush(stdout);
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
  MPI_Finalize();
  return 0;
}

int RunCollectiveBench(const CollectiveBenchOptions& opt) {
  const bool q = opt.common.quick;
  int p = opt.workers > 0 ? opt.workers : (q ? 4 : 8);
  std::vector<uint64_t> sizes =
      q ? std::vector<uint64_t>{4 << 10, 1 << 20, 16 << 20}
        : std::vector<uint64_t>{4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20};
  Progress(0, 1, "ring and hierarchical, p=" + std::to_string(p));
  auto proc =
      StartMpiRanks(p, {"collective", "worker", std::to_string(opt.local),
                        Join(sizes), q ? "5" : "0"});
  if (!proc) return 1;
  auto res = ReadResults(*proc, 2 * sizes.size());
  proc->Wait(std::chrono::minutes(2));
  if (res.size() != 2 * sizes.size()) {
    std::fprintf(stderr, "error: the collective run failed\n");
    return 1;
  }
  Progress(1, 1, "done");
  Report report("collective");
  std::printf("\n%d workers in nodes of %d\n%-9s %12s %14s %8s\n", p, opt.local,
              "size", "ring ms", "hierarchical", "h/ring");
  for (uint64_t n : sizes) {
    double r = res[{"ring", n}], h = res[{"hierarchical", n}];
    for (auto [v, t] :
         {std::make_pair("ring", r), std::make_pair("hierarchical", h)}) {
      Record rec;
      rec.bench = "collective";
      rec.variant = v;
      rec.size_bytes = n;
      rec.workers = p;
      rec.metric = "time";
      rec.value = t * 1e3;
      rec.unit = "ms";
      report.Add(rec);
    }
    std::printf("%-9s %12.3f %14.3f %8.2f\n", SizeLabel(n).c_str(), r * 1e3,
                h * 1e3, h / r);
  }
  Status s = report.Finish(opt.common, "time",
                           "worker collectives: hierarchical vs ring", true);
  return s.ok() ? 0 : 1;
}

}  // namespace membox::bench
