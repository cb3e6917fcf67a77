#include "bench/allreduce/allreduce_bench.h"

#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <thread>

#include <fmt/format.h>
#include <mpi.h>
#include <unistd.h>

#include "membox/base/config.h"
#include "membox/base/subprocess.h"
#include "membox/collective/hierarchical_allreduce.h"
#include "membox/collective/ring_allreduce.h"
#include "membox/ps/client_environment.h"
#include "membox/ps/param_client.h"
#include "membox/sync/split_allreduce.h"

#include "bench/common/local_address.h"
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
  return fmt::format("{}", fmt::join(v, ","));
}

int ItersFor(uint64_t size, int asked) {
  if (asked > 0) return asked;
  if (size >= (256u << 20)) return 3;
  if (size >= (32u << 20)) return 5;
  return 20;
}

// The correctness check of every run (issue 47): rank r's element i is
// (r + 1) * (i mod 4093 + 1), so a shard that is dropped, duplicated or
// lands at the wrong offset changes some element's sum (4093 is prime, so
// no power-of-two shard shift maps the pattern onto itself), and every sum
// stays an integer below 2^24 (exact in float) up to 8,000 ranks.
constexpr uint64_t kRampPeriod = 4093;
float RampInput(int rank, uint64_t i) {
  return float(rank + 1) * float(i % kRampPeriod + 1);
}
// Checks all `count` elements of an allreduce of RampInput over `world`
// ranks; the first wrong one is named.
Status CheckRampSum(const float* y, uint64_t count, int world) {
  const float ranks = float(world) * float(world + 1) / 2;
  for (uint64_t i = 0; i < count; ++i) {
    const float want = ranks * float(i % kRampPeriod + 1);
    if (y[i] != want) {
      return DataLossError("wrong sum at element " + std::to_string(i) +
                           " of " + std::to_string(count) + ": " +
                           std::to_string(y[i]) + ", expected " +
                           std::to_string(want));
    }
  }
  return Status::Ok();
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

// The machine's streaming-copy bandwidth for `n`-byte copies with every
// core copying its own part at once (a bound must not be beatable: one
// thread's 256 MiB memcpy was, by up to 2.7x at cache-resident sizes).
// Best of several rounds, ~0.2 s or 5 rounds at least.
double StreamingCopyBandwidth(size_t n) {
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const size_t part = (n / cores + 63) / 64 * 64;
  std::vector<std::vector<char>> src(cores), dst(cores);
  for (unsigned c = 0; c < cores; ++c) {
    src[c].assign(part, 1);
    dst[c].assign(part, 2);
  }
  double best = 0;
  const auto deadline = Clock::now() + std::chrono::milliseconds(200);
  for (int round = 0; round < 5 || Clock::now() < deadline; ++round) {
    std::atomic<int> ready{0};
    std::atomic<bool> go{false};
    std::vector<double> took(cores);
    std::vector<std::thread> threads;
    for (unsigned c = 0; c < cores; ++c) {
      threads.emplace_back([&, c] {
        ready.fetch_add(1);
        while (!go.load()) {
        }
        auto t0 = Clock::now();
        std::memcpy(dst[c].data(), src[c].data(), part);
        took[c] = std::chrono::duration<double>(Clock::now() - t0).count();
      });
    }
    while (ready.load() < static_cast<int>(cores)) {
    }
    go.store(true);
    for (auto& t : threads) t.join();
    const double slowest = *std::max_element(took.begin(), took.end());
    if (slowest > 0) best = std::max(best, double(part) * cores / slowest);
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
                 "SIZES ITERS PARTITION [stripe|profile|profile-nodes|ring]\n");
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
    if (Status s = ps::ApplyClientEnvironment(&o); !s.ok()) return fail(s);
    auto c = ps::ParamClient::Connect(o);
    if (!c.ok()) return fail(c.status());
    auto& client = *c;
    // "profile": what membox's default does -- the profiler measures the
    // nodes and picks routing, striping and shard sizes. Rank 0 measures
    // alone (workers probing the same links at once measure each other)
    // and every rank uses its table.
    const bool profile =
        a.size() > 5 && (a[5] == "profile" || a[5] == "profile-nodes");
    if (profile) {
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
    // membox's default where the nodes are reached over links and have
    // fewer of them than the workers (FirstSplitShare > 0): each tensor
    // split between the workers' ring and the nodes (sync::SplitAllreduce),
    // as the torch backend and the DDP hook do; "profile-nodes" keeps the
    // nodes alone, to compare. On one host the nodes map the workers'
    // memory and stay alone.
    std::unique_ptr<collective::RingAllreduce> ring;
    std::unique_ptr<sync::SplitAllreduce> split;
    const int nodes = static_cast<int>(o.proxies.size());
    const std::string here = LocalAddressToward(o.proxies[0]);
    // Rank 0's view, so that every rank decides alike.
    int use_split = profile && a[5] == "profile" && !IsLoopbackAddress(here) &&
                    sync::FirstSplitShare(world, nodes) > 0;
    MPI_Bcast(&use_split, 1, MPI_INT, 0, MPI_COMM_WORLD);
    if (use_split) {
      collective::RingOptions ro;
      ro.rank = rank;
      ro.world = world;
      ro.listen = here + ":0";
      ro.secret = o.secret;
      ro.max_bytes = largest;
      // Each ring step goes in 1 MiB segments, forwarded as they arrive
      // (the torch backend's choice across hosts, RING_SEGMENT_BYTES).
      ro.segment_bytes = 1 << 20;
      auto r = collective::RingAllreduce::Create(ro);
      if (!r.ok()) return fail(r.status());
      ring = std::move(*r);
      if (Status s = ring->Connect(AllgatherEndpoints(ring->endpoint()));
          !s.ok())
        return fail(s);
      sync::SplitOptions so;
      so.rank = rank;
      so.world = world;
      so.nodes = nodes;
      so.ring_max_bytes = largest;
      auto sp = sync::SplitAllreduce::Create(client.get(), ring.get(), so);
      if (!sp.ok()) return fail(sp.status());
      split = std::move(*sp);
      if (rank == 0) {
        std::fprintf(stderr, "split: %d/16 of each tensor over the ring\n",
                     split->share());
      }
    }
    auto in = client->AllocateTensor(largest);
    auto out = client->AllocateTensor(largest);
    if (!in.ok() || !out.ok())
      return fail(in.ok() ? out.status() : in.status());
    float* x = static_cast<float*>(*in);
    float* y = static_cast<float*>(*out);
    for (uint64_t i = 0; i < largest / 4; ++i) x[i] = RampInput(rank, i);
    for (size_t i = 0; i < sizes.size(); ++i) {
      uint64_t n = sizes[i];
      if (!split) {
        auto d = client->Declare(i + 1, n, DType::kFloat32);
        if (!d.ok()) return fail(d.status());
      }
      // A result that is never written shows as NaN, not as an old sum.
      std::fill(y, y + n / 4, std::nanf(""));
      Status err;
      double t = TimeCollective(ItersFor(n, iters), [&] {
        Status s = split ? split->Allreduce(i + 1, x, y, n / 4)
                         : client->PushPull(i + 1, x, y).Wait();
        if (!s.ok()) err = s;
      });
      if (split && rank == 0) {
        std::fprintf(stderr, "split %s: now %d/16 over the ring\n",
                     SizeLabel(n).c_str(), split->share());
      }
      if (!err.ok()) return fail(err);
      Status sum = CheckRampSum(y, n / 4, world);
      if (!sum.ok()) return fail(sum);
      if (rank == 0) {
        std::printf("RESULT membox %llu %.9f\n", (unsigned long long)n, t);
        std::fflush(stdout);
      }
    }
    MPI_Barrier(MPI_COMM_WORLD);
  } else {
    std::vector<float> x(largest / 4), y(largest / 4);
    for (uint64_t i = 0; i < largest / 4; ++i) x[i] = RampInput(rank, i);
    for (uint64_t n : sizes) {
      std::fill(y.begin(), y.begin() + n / 4, std::nanf(""));
      double t = TimeCollective(ItersFor(n, iters), [&] {
        MPI_Allreduce(x.data(), y.data(), static_cast<int>(n / 4), MPI_FLOAT,
                      MPI_SUM, MPI_COMM_WORLD);
      });
      Status sum = CheckRampSum(y.data(), n / 4, world);
      if (!sum.ok()) return fail(sum);
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
  // The bound: whatever the scheme, every rank's n input bytes are read
  // once and its n result bytes written once -- the traffic of copying p n
  // bytes -- at the all-core streaming copy rate measured here for a copy of
  // p n bytes (the working set, so a cache-resident n does not flatter it).
  // (The old (2p + 1) n / one thread's 256 MiB memcpy assumed a push and a
  // pull copy per rank; membox's mapped pool skips the push copy and beat
  // it.)
  std::map<uint64_t, double> bw;  // by p n
  for (int p : workers) {
    for (uint64_t n : sizes) {
      const uint64_t bytes = uint64_t(p) * n;
      if (bw.count(bytes)) continue;
      bw[bytes] = StreamingCopyBandwidth(bytes);
      std::fprintf(stderr, "streaming copy, all %u cores, %s: %.2f GB/s\n",
                   std::max(1u, std::thread::hardware_concurrency()),
                   SizeLabel(bytes).c_str(), bw[bytes] / 1e9);
    }
  }
  const int repeats = std::max(1, opt.repeats);
  int total =
      repeats * static_cast<int>(workers.size() *
                                 (nodes.size() +
                                  std::count_if(nodes.begin(), nodes.end(),
                                                [](int m) { return m > 1; }) +
                                  1 + (opt.with_gloo ? 1 : 0)));
  int done = 0;
  // Every variant's time per (p, size) over the repeats; the repeats are
  // interleaved (every variant once per repeat), so what the machine does
  // meanwhile falls on every variant alike.
  std::map<std::tuple<std::string, int, uint64_t>, std::vector<double>> runs;
  auto add = [&](const std::string& variant, int p, uint64_t n, double sec) {
    runs[{variant, p, n}].push_back(sec);
  };
  auto record = [&](const std::string& variant, int p, uint64_t n,
                    const std::string& metric, double ms) {
    Record r;
    r.bench = "allreduce";
    r.variant = variant;
    r.size_bytes = n;
    r.workers = p;
    r.metric = metric;
    r.value = ms;
    r.unit = "ms";
    report.Add(r);
  };
  auto mpirun = [&](int p, const std::vector<std::string>& args) {
    std::vector<std::string> peer = {"allreduce", "worker"};
    peer.insert(peer.end(), args.begin(), args.end());
    return StartMpiRanks(p, peer);
  };
  const std::string iters_s = std::to_string(iters);
  // Reads one run's results into `variant`; false (after saying so) when
  // the run did not report every size.
  auto collect = [&](std::optional<Subprocess>& proc,
                     const std::string& variant, int p) {
    if (!proc) return false;
    auto res = ReadResults(*proc, sizes.size());
    proc->Wait(std::chrono::minutes(2));
    if (res.size() != sizes.size()) {
      std::fprintf(stderr, "error: the %s run p=%d is incomplete\n",
                   variant.c_str(), p);
      return false;
    }
    for (auto& [k, sec] : res) add(variant, p, k.second, sec);
    return true;
  };
  for (int rep = 0; rep < repeats; ++rep) {
    const std::string tag =
        repeats > 1 ? " repeat " + std::to_string(rep + 1) : "";
    for (int p : workers) {
      // MPI_Allreduce.
      Progress(done++, total, "mpi p=" + std::to_string(p) + tag);
      {
        auto proc = mpirun(p, {"-", "-", Join(sizes), iters_s,
                               std::to_string(opt.partition_bytes)});
        if (!collect(proc, "mpi", p)) return 1;
      }
      // membox through 1 and 2 memory nodes; with 2+, the default
      // (replicated: every shard on two nodes) and --ps-replicate off.
      std::vector<std::pair<int, bool>> node_runs;
      for (int m : nodes) {
        node_runs.push_back({m, true});
        if (m > 1) node_runs.push_back({m, false});
      }
      for (auto [m, replicated] : node_runs) {
        const std::string variant =
            "membox-" + std::to_string(m) + "node" +
            (replicated || m == 1 ? "" : "-unreplicated");
        Progress(done++, total,
                 "membox p=" + std::to_string(p) +
                     " nodes=" + std::to_string(m) +
                     (replicated || m == 1 ? "" : " unreplicated") + tag);
        std::vector<std::string> peers;
        auto cluster =
            ServerProcess::StartProxyCluster(m, 2, &peers, replicated);
        if (!cluster.ok()) {
          std::fprintf(stderr, "error: %s\n",
                       cluster.status().ToString().c_str());
          return 1;
        }
        std::vector<ServerProcess> servers = std::move(*cluster);
        std::string list;
        for (auto& pe : peers) list += (list.empty() ? "" : ",") + pe;
        // "profile": what a job does by default (the profiler picks
        // routing, striping and shard sizes; on one host it stripes).
        auto proc =
            mpirun(p, {list, servers[0].secret_file(), Join(sizes), iters_s,
                       std::to_string(opt.partition_bytes), "profile"});
        if (!collect(proc, variant, p)) return 1;
      }
      if (opt.with_gloo) {
        Progress(done++, total, "gloo p=" + std::to_string(p) + tag);
        auto proc = Subprocess::Start(
            {BaselinePython(),
             std::string(MEMBOX_SOURCE_DIR) +
                 "/bench/allreduce/gloo_allreduce.py",
             "--workers", std::to_string(p), "--sizes", Join(sizes), "--iters",
             iters_s, "--port", std::to_string(ServerProcess::FreePort())});
        if (!collect(proc, "gloo", p)) return 1;
      }
    }
  }
  // Records: the median over the repeats ("time"), and its spread
  // ("time-min", "time-max").
  for (auto& [key, v] : runs) {
    auto& [variant, p, n] = key;
    std::sort(v.begin(), v.end());
    record(variant, p, n, "time", 1e3 * v[v.size() / 2]);
    if (v.size() > 1) {
      record(variant, p, n, "time-min", 1e3 * v.front());
      record(variant, p, n, "time-max", 1e3 * v.back());
    }
  }
  for (int p : workers) {
    for (uint64_t n : sizes) {
      record("memcpy-bound", p, n, "time",
             1e3 * double(p) * n / bw[uint64_t(p) * n]);
    }
  }
  Progress(total, total, "done");

  // Table with the ratios of membox's default (`membox launch`: 2 memory
  // nodes) to each baseline; the 1-node run is its own column, never a
  // "faster of the two" (issue 47).
  std::printf(
      "\n%-4s %-9s %11s %11s %11s %11s %11s %11s | %8s %8s %8s %8s %8s\n", "p",
      "size", "membox-1", "membox-2", "2-unrepl", "mpi", "gloo", "bound",
      "2n/mpi", "2n/gloo", "2n/bnd", "1n/mpi", "2n/unrep");
  for (int p : workers) {
    for (uint64_t n : sizes) {
      auto get = [&](const std::string& v) {
        for (auto& r : report.records()) {
          if (r.variant == v && r.size_bytes == n && r.workers == p &&
              r.metric == "time")
            return r.value;
        }
        return std::nan("");
      };
      double m1 = get("membox-1node"), m2 = get("membox-2node"),
             m2u = get("membox-2node-unreplicated"), mpi = get("mpi"),
             gloo = get("gloo"), bound = get("memcpy-bound");
      std::printf(
          "%-4d %-9s %9.3fms %9.3fms %9.3fms %9.3fms %9.3fms %9.3fms | %8.2f "
          "%8.2f %8.2f %8.2f %8.2f\n",
          p, SizeLabel(n).c_str(), m1, m2, m2u, mpi, gloo, bound, m2 / mpi,
          m2 / gloo, m2 / bound, m1 / mpi, m2 / m2u);
    }
  }
  std::printf(
      "(ratios: membox's time / the baseline's; < 1 is membox faster. 2n: "
      "the default's 2 memory nodes, replicated (every shard on two nodes); "
      "2-unrepl: the same with --ps-replicate off; 1n: one node. bound: p n "
      "bytes copied at "
      "the all-core streaming copy rate of p n bytes; times: the median over "
      "%d interleaved repeats, each the median over iterations of the "
      "slowest rank)\n",
      repeats);
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
  collective::RingOptions ro;
  ro.rank = rank;
  ro.world = world;
  ro.listen = "127.0.0.1:0";
  ro.max_bytes = largest;
  auto ring = collective::RingAllreduce::Create(ro);
  if (!ring.ok()) return fail(ring.status());
  Status st = (*ring)->Connect(AllgatherEndpoints((*ring)->endpoint()));
  if (!st.ok()) return fail(st);
  collective::HierarchicalOptions ho;
  ho.rank = rank;
  ho.world = world;
  ho.local_size = local;
  ho.listen = "127.0.0.1:0";
  ho.max_bytes = largest;
  auto hier = collective::HierarchicalAllreduce::Create(ho);
  if (!hier.ok()) return fail(hier.status());
  st = (*hier)->Connect(AllgatherEndpoints((*hier)->endpoint()));
  if (!st.ok()) return fail(st);
  std::vector<float> buf(largest / 4);
  auto verify = [&](auto& collective, uint64_t n, const char* name) {
    // One more run from the ramp, untimed, and every element checked.
    for (uint64_t i = 0; i < n / 4; ++i) buf[i] = RampInput(rank, i);
    Status s = collective->Allreduce(buf.data(), n / 4);
    if (s.ok()) s = CheckRampSum(buf.data(), n / 4, world);
    return s.WithContext(name);
  };
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
    if (Status v = verify(*ring, n, "ring"); !v.ok()) return fail(v);
    if (Status v = verify(*hier, n, "hierarchical"); !v.ok()) return fail(v);
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
