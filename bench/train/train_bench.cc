#include "bench/train/train_bench.h"

#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <future>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include <arpa/inet.h>
#include <mpi.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "membox/base/subprocess.h"
#include "membox/collective/ring_allreduce.h"
#include "membox/ps/client_environment.h"
#include "membox/ps/param_client.h"

#include "bench/common/local_address.h"
#include "bench/common/mpi_launch.h"
#include "bench/common/mpi_routing.h"
#include "bench/common/server_process.h"
#include "bench/train/models.h"

namespace membox::bench {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kBucketBytes = 25u << 20;  // PyTorch DDP's default
// Iterations not measured: connection set-up, first touch of the buffers.
constexpr int kWarmup = 2;

double Ms(Clock::duration d) {
  return std::chrono::duration<double, std::milli>(d).count();
}

void Compute(double ms) {
  std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms));
}

std::vector<std::string> Split(const std::string& s, char sep = ',') {
  std::vector<std::string> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, sep)) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

// Tensor t of the model: byte offset in the flat buffer and its layer.
struct Flat {
  std::vector<uint64_t> offset, bytes;
  std::vector<int> layer;
  uint64_t total = 0;
};

Flat Flatten(const Model& m) {
  Flat f;
  for (size_t l = 0; l < m.layers.size(); ++l) {
    for (uint64_t n : m.layers[l].tensors) {
      f.offset.push_back(f.total);
      f.bytes.push_back(4 * n);
      f.layer.push_back(static_cast<int>(l));
      f.total += 4 * n;
    }
  }
  return f;
}

struct WorkerResult {
  double iteration_ms = 0, blocked_ms = 0;
};

// ---------------------------------------------------------------- MPI

// DDP's pattern with MPI_Allreduce: buckets in backward order, each reduced
// by a communication thread as soon as its last gradient is ready; the
// iteration ends when every bucket is reduced.
WorkerResult RunMpi(const Model& m, int iters) {
  Flat f = Flatten(m);
  std::vector<float> buf(f.total / 4, 1.0f);
  struct Bucket {
    uint64_t lo, hi;
    int ready_layer;
  };
  std::vector<Bucket> buckets;
  {
    uint64_t acc = 0, lo = 0, hi = 0;
    int ready = 0;
    for (size_t t = f.offset.size(); t-- > 0;) {
      if (acc == 0) hi = f.offset[t] + f.bytes[t];
      lo = f.offset[t];
      ready = f.layer[t];
      acc += f.bytes[t];
      if (acc >= kBucketBytes || t == 0) {
        buckets.push_back({lo, hi, ready});
        acc = 0;
      }
    }
  }
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Bucket> q;
  size_t done = 0;
  bool stop = false;
  std::thread comm([&] {
    for (;;) {
      Bucket b;
      {
        std::unique_lock<std::mutex> l(mu);
        cv.wait(l, [&] { return stop || !q.empty(); });
        if (q.empty()) return;
        b = q.front();
        q.pop_front();
      }
      MPI_Allreduce(MPI_IN_PLACE, buf.data() + b.lo / 4,
                    static_cast<int>((b.hi - b.lo) / 4), MPI_FLOAT, MPI_SUM,
                    MPI_COMM_WORLD);
      {
        std::lock_guard<std::mutex> l(mu);
        ++done;
      }
      cv.notify_all();
    }
  });
  const int L = static_cast<int>(m.layers.size());
  double fp = m.forward_ms / L, bp = m.backward_ms / L;
  WorkerResult r;
  for (int it = 0; it < iters; ++it) {
    auto t0 = Clock::now();
    for (int l = 0; l < L; ++l) Compute(fp);
    size_t issued = 0;
    for (int l = L - 1; l >= 0; --l) {
      Compute(bp);
      std::lock_guard<std::mutex> g(mu);
      for (auto& b : buckets) {
        if (b.ready_layer == l) {
          q.push_back(b);
          ++issued;
        }
      }
      cv.notify_all();
    }
    {
      std::unique_lock<std::mutex> g(mu);
      cv.wait(g, [&] { return done == issued; });
      done = 0;
    }
    Compute(m.step_ms);  // the optimizer step, every bucket reduced
    double iter = Ms(Clock::now() - t0);
    if (it >= kWarmup) {
      r.iteration_ms += iter / (iters - kWarmup);
      r.blocked_ms +=
          (iter - m.forward_ms - m.backward_ms - m.step_ms) / (iters - kWarmup);
    }
  }
  {
    std::lock_guard<std::mutex> g(mu);
    stop = true;
  }
  cv.notify_all();
  comm.join();
  return r;
}

// ---------------------------------------------------------------- membox

struct MemboxConfig {
  std::vector<std::string> proxies;
  std::string secret;
  bool routing = true, partition = true, dual = true;
};

Result<WorkerResult> RunMembox(const Model& m, int iters,
                               const MemboxConfig& cfg, int rank, int world) {
  Flat f = Flatten(m);
  ps::ParamClientOptions o;
  o.proxies = cfg.proxies;
  o.secret = cfg.secret;
  o.rank = rank;
  o.world = world;
  o.name = "train";
  // Without the profiler: each worker uses the proxy "next to it".
  o.routing.lat_proxy = o.routing.bw_proxy =
      static_cast<uint32_t>(rank % cfg.proxies.size());
  RETURN_IF_ERROR(ps::ApplyClientEnvironment(&o));  // `membox cluster`'s
  ASSIGN_OR_RETURN(auto client, ps::ParamClient::Connect(o));
  if (cfg.routing) {
    // The profiler picks routing, striping and shard sizes. Rank 0 measures
    // alone (workers probing the same links at once measure each other)
    // and every rank uses its table: workers routing the same key
    // differently make the proxies fall back to their ring.
    ps::RoutingTable t;
    BarrierAsleep();
    if (rank == 0) {
      ASSIGN_OR_RETURN(t, client->Profile());
    }
    BroadcastRouting(&t);
    client->SetRouting(t);
  }
  if (!cfg.partition) {
    ps::RoutingTable t = client->routing();
    t.partition_bytes = uint64_t{1} << 40;
    t.pipeline_bytes = 0;
    client->SetRouting(t);
  }
  ASSIGN_OR_RETURN(void* mem, client->AllocateTensor(f.total));
  auto* base = static_cast<uint8_t*>(mem);
  std::memset(base, 0, f.total);
  // One key per layer: a layer's tensors are contiguous in the buffer and
  // become ready together (the fusion DDP does with its buckets, at layer
  // granularity so the first layers can still go first).
  const int L = static_cast<int>(m.layers.size());
  std::vector<uint64_t> layer_off(L + 1, 0);
  for (size_t t = 0; t < f.bytes.size(); ++t) {
    layer_off[f.layer[t] + 1] = f.offset[t] + f.bytes[t];
  }
  for (int l = 0; l < L; ++l) {
    ASSIGN_OR_RETURN(auto v,
                     client->Declare(l + 1, layer_off[l + 1] - layer_off[l],
                                     DType::kFloat32));
    (void)v;
  }
  // Dual synchronisation: measure both paths on 16 MiB, apply the cost
  // model, give the first layers (n - m bytes) to the workers' ring.
  int ring_layers = 0;
  std::unique_ptr<collective::RingAllreduce> ring;
  if (cfg.dual && world > 1) {
    const uint64_t probe = std::min<uint64_t>(16u << 20, f.total);
    collective::RingOptions ro;
    ro.rank = rank;
    ro.world = world;
    ro.listen = LocalAddressToward(cfg.proxies[0]) + ":0";
    ro.max_bytes = f.total;
    ASSIGN_OR_RETURN(ring, collective::RingAllreduce::Create(ro));
    RETURN_IF_ERROR(ring->Connect(AllgatherEndpoints(ring->endpoint())));
    ASSIGN_OR_RETURN(void* pm, client->AllocateTensor(probe));
    RETURN_IF_ERROR(client->Declare(1u << 30, probe, DType::kFloat32).status());
    double f2 = 2.0 * (world - 1) / world;
    auto time_it = [&](auto&& fn) -> Result<double> {
      double best = 1e9;
      for (int i = 0; i < 3; ++i) {
        MPI_Barrier(MPI_COMM_WORLD);
        auto t0 = Clock::now();
        RETURN_IF_ERROR(fn());
        best = std::min(
            best, std::chrono::duration<double>(Clock::now() - t0).count());
      }
      return best;
    };
    ASSIGN_OR_RETURN(double tw, time_it([&] {
                       return ring->Allreduce(static_cast<float*>(pm),
                                              probe / 4);
                     }));
    ASSIGN_OR_RETURN(double tp, time_it([&] {
                       return client->PushPull(1u << 30, pm, pm).Wait();
                     }));
    // The two paths may share their bottleneck -- across hosts a worker's
    // one link carries both its ring traffic and its pushes -- and then
    // splitting the bytes between them adds less bandwidth than the paper's
    // model (independent paths, as NVLink and the network are) assumes.
    // Half the probe on each at once measures how much (ps::SharingFromProbe)
    // and the cost model charges it for the time both paths run.
    const uint64_t half = (probe / 2) & ~uint64_t{3};
    RETURN_IF_ERROR(
        client->Declare((1u << 30) + 1, half, DType::kFloat32).status());
    auto* pb = static_cast<uint8_t*>(pm);
    ASSIGN_OR_RETURN(double tboth, time_it([&]() -> Status {
                       auto r = std::async(std::launch::async, [&] {
                         return ring->Allreduce(
                             reinterpret_cast<float*>(pb + half), half / 4);
                       });
                       Status s =
                           client->PushPull((1u << 30) + 1, pb, pb).Wait();
                       Status rs = r.get();
                       return s.ok() ? rs : s;
                     }));
    const double sharing = ps::SharingFromProbe(tw, tp, tboth);
    double bw_worker = f2 * probe / tw, bw_proxy = f2 * probe / tp;
    // Under DDP's semantics nothing overlaps the next forward pass: the
    // cost model gets no forward time to hide communication in.
    const double t_forward = 0;
    auto plan =
        ps::ChooseDualSync(f.total, world, t_forward, m.backward_ms / 1e3,
                           bw_proxy, bw_worker, sharing);
    std::vector<uint64_t> layer_bytes(L, 0);
    for (int l = 0; l < L; ++l) {
      for (auto n : m.layers[l].tensors) layer_bytes[l] += 4 * n;
    }
    ring_layers =
        ps::ChooseRingLayers(layer_bytes, plan, world, t_forward,
                             m.backward_ms / 1e3, bw_proxy, bw_worker, sharing);
    // Every rank must pick the same split: use rank 0's.
    MPI_Bcast(&ring_layers, 1, MPI_INT, 0, MPI_COMM_WORLD);
    uint64_t acc = 0;
    for (int l = 0; l < ring_layers; ++l) acc += layer_bytes[l];
    if (rank == 0) {
      std::fprintf(stderr,
                   "  dual sync: worker ring %.2f GB/s, proxies %.2f GB/s, "
                   "half on each at once %.2fx the slower half (sharing "
                   "%.2f) -> first %d layers (%.1f MB) by the workers\n",
                   bw_worker / 1e9, bw_proxy / 1e9,
                   tboth / (std::max(tw, tp) / 2), sharing, ring_layers,
                   acc / 1e6);
    }
  }
  // Tensors of the ring's layers are contiguous at the start of the buffer.
  uint64_t ring_bytes = 0;
  for (size_t t = 0; t < f.bytes.size(); ++t) {
    if (f.layer[t] < ring_layers) ring_bytes += f.bytes[t];
  }
  double fp = m.forward_ms / L, bp = m.backward_ms / L;
  std::vector<std::vector<ps::PsHandle>> pending(L);
  const bool trace = std::getenv("MEMBOX_TRAIN_TRACE") != nullptr;
  std::future<Status> ring_done;
  WorkerResult r;
  Status failure;
  auto t_prev = Clock::now();
  // DDP's semantics, the same schedule as the MPI and Gloo schemes (issue
  // 47): every layer's result is back before the optimizer step, and the
  // step ends the iteration. (Forward used to wait only for each layer's
  // own result, overlapping one iteration's communication with the next
  // one's forward, which a DDP job cannot do.)
  for (int it = 0; it <= iters; ++it) {
    auto t0 = Clock::now();
    if (it > kWarmup) {  // iteration it-1 ended here
      double iter = Ms(t0 - t_prev);
      r.iteration_ms += iter / (iters - kWarmup);
      r.blocked_ms +=
          (iter - m.forward_ms - m.backward_ms - m.step_ms) / (iters - kWarmup);
    }
    t_prev = t0;
    if (it == iters) break;
    for (int l = 0; l < L; ++l) Compute(fp);
    // Backward: gradients ready in reverse layer order, pushed at once
    // with the first layers' priority highest.
    for (int l = L - 1; l >= 0; --l) {
      Compute(bp);
      if (l < ring_layers) continue;
      pending[l].push_back(
          client->PushPull(l + 1, base + layer_off[l], base + layer_off[l], l));
    }
    if (ring_layers > 0) {
      ring_done = std::async(std::launch::async, [&] {
        return ring->Allreduce(reinterpret_cast<float*>(base), ring_bytes / 4);
      });
    }
    // Every bucket reduced, then the optimizer step.
    auto w0 = Clock::now();
    for (auto& p : pending) {
      for (auto& h : p) RETURN_IF_ERROR(h.Wait());
      p.clear();
    }
    if (ring_done.valid()) RETURN_IF_ERROR(ring_done.get());
    if (trace && rank == 0 && it > 0) {
      std::fprintf(stderr, "  it %d waited %.2f ms after backward\n", it,
                   Ms(Clock::now() - w0));
    }
    Compute(m.step_ms);
  }
  return r;
}

std::map<std::string, std::string> ParseArgs(
    const std::vector<std::string>& a) {
  std::map<std::string, std::string> kv;
  for (auto& s : a) {
    auto eq = s.find('=');
    if (eq != std::string::npos) kv[s.substr(0, eq)] = s.substr(eq + 1);
  }
  return kv;
}

}  // namespace

int RunTrainWorker(const std::vector<std::string>& a) {
  auto kv = ParseArgs(a);
  Model m = MakeModel(kv["model"]);
  if (m.name.empty()) {
    std::fprintf(stderr, "unknown model '%s'\n", kv["model"].c_str());
    return 2;
  }
  double scale = kv.count("scale") ? std::stod(kv["scale"]) : 1.0;
  m.forward_ms *= scale;
  m.backward_ms *= scale;
  m.step_ms *= scale;
  // size_scale: every tensor scaled (at least one element), for links too
  // slow to move the real model in a short run (`membox bench cluster`).
  if (kv.count("size_scale")) {
    double ss = std::stod(kv["size_scale"]);
    for (auto& layer : m.layers) {
      for (auto& n : layer.tensors) {
        n = std::max<uint64_t>(1, static_cast<uint64_t>(n * ss));
      }
    }
  }
  if (kv["scheme"] == "describe") {
    // For `membox bench cluster`'s Gloo scheme: the Gloo script, the
    // compute times and the (scaled) layers in gloo_train.py's format.
    std::printf("SCRIPT %s/bench/train/gloo_train.py\nTIMES %.6f %.6f %.6f\n",
                MEMBOX_SOURCE_DIR, m.forward_ms, m.backward_ms, m.step_ms);
    for (size_t l = 0; l < m.layers.size(); ++l)
      for (auto n : m.layers[l].tensors)
        std::printf("%zu %llu\n", l, static_cast<unsigned long long>(n));
    return 0;
  }
  int provided;
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
  int rank, world;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  int iters = kv.count("iters") ? std::stoi(kv["iters"]) : 6;
  WorkerResult r;
  MPI_Barrier(MPI_COMM_WORLD);
  if (kv["scheme"] == "mpi") {
    r = RunMpi(m, iters);
  } else {
    MemboxConfig c;
    c.proxies = Split(kv["proxies"]);
    std::ifstream in(kv["secret_file"]);
    std::getline(in, c.secret);
    c.routing = kv["routing"] != "0";
    c.partition = kv["partition"] != "0";
    c.dual = kv["dual"] != "0";
    auto res = RunMembox(m, iters, c, rank, world);
    if (!res.ok()) {
      std::fprintf(stderr, "rank %d: error: %s\n", rank,
                   res.status().ToString().c_str());
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    r = *res;
  }
  double mine[2] = {r.iteration_ms, r.blocked_ms}, sum[2] = {0, 0};
  MPI_Reduce(mine, sum, 2, MPI_DOUBLE, MPI_SUM, 0, MPI_COMM_WORLD);
  if (rank == 0) {
    std::printf("RESULT %.3f %.3f\n", sum[0] / world, sum[1] / world);
    std::fflush(stdout);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  MPI_Finalize();
  return 0;
}

int RunTrainBench(const TrainOptions& opt) {
  const bool q = opt.common.quick;
  std::vector<std::string> models = opt.models;
  if (models.empty()) {
    models = q ? std::vector<std::string>{"resnet50"}
               : std::vector<std::string>{"resnet50", "vgg16", "bert-large"};
  }
  int p = opt.workers > 0 ? opt.workers : (q ? 2 : 4);
  int iters = opt.iterations > 0 ? opt.iterations : (q ? 4 : 7);
  if (iters <= kWarmup) {
    std::fprintf(stderr,
                 "error: --iterations must exceed the %d warm-up "
                 "iterations\n",
                 kWarmup);
    return 2;
  }
  struct Scheme {
    const char* name;
    int nodes;  // 0: MPI / Gloo
    bool routing, partition, dual;
  };
  const std::vector<Scheme> schemes = {
      {"mpi", 0, false, false, false},
      {"gloo", 0, false, false, false},
      {"dense", 1, false, false, false},
      {"membox", 2, true, true, true},
      {"membox-1node", 1, true, true, true},
      {"membox-no-routing", 2, false, true, true},
      {"membox-no-partition", 2, true, false, true},
      {"membox-no-dual", 2, true, true, false},
  };
  Report report("train");
  int total = static_cast<int>(models.size() * schemes.size()), done = 0;
  std::map<std::pair<std::string, std::string>, std::pair<double, double>> res;
  for (const auto& name : models) {
    Model m = MakeModel(name);
    if (m.name.empty()) {
      std::fprintf(stderr, "error: unknown model '%s'\n", name.c_str());
      return 2;
    }
    std::fprintf(stderr,
                 "%s: %zu tensors in %zu layers, %.1f MB, compute "
                 "%.0f + %.0f ms, optimizer step %.1f ms\n",
                 name.c_str(), m.tensors(), m.layers.size(), m.bytes() / 1e6,
                 m.forward_ms * opt.compute_scale,
                 m.backward_ms * opt.compute_scale,
                 m.step_ms * opt.compute_scale);
    for (const auto& s : schemes) {
      Progress(done++, total, name + " " + s.name);
      if (std::string(s.name) == "gloo" && !opt.with_gloo) continue;
      std::optional<Subprocess> proc;
      std::vector<ServerProcess> servers;
      std::string model_file;  // the layer list for the Gloo script
      if (std::string(s.name) == "gloo") {
        std::string file =
            "/tmp/membox-train-model-" + std::to_string(getpid());
        model_file = file;
        {
          std::ofstream out(file);
          for (size_t l = 0; l < m.layers.size(); ++l)
            for (auto n : m.layers[l].tensors) out << l << " " << n << "\n";
        }
        proc = Subprocess::Start(
            {BaselinePython(),
             std::string(MEMBOX_SOURCE_DIR) + "/bench/train/gloo_train.py",
             "--workers", std::to_string(p), "--model", file, "--forward-ms",
             std::to_string(m.forward_ms * opt.compute_scale), "--backward-ms",
             std::to_string(m.backward_ms * opt.compute_scale), "--step-ms",
             std::to_string(m.step_ms * opt.compute_scale), "--iters",
             std::to_string(iters), "--port",
             std::to_string(ServerProcess::FreePort())});
      } else {
        std::vector<std::string> args = {
            "scheme=" + std::string(s.nodes ? "membox" : "mpi"),
            "model=" + name, "iters=" + std::to_string(iters),
            "scale=" + std::to_string(opt.compute_scale)};
        if (s.nodes > 0) {
          std::vector<std::string> peers;
          auto cluster = ServerProcess::StartProxyCluster(s.nodes, 2, &peers);
          if (!cluster.ok()) {
            std::fprintf(stderr, "error: %s\n",
                         cluster.status().ToString().c_str());
            return 1;
          }
          servers = std::move(*cluster);
          std::string list;
          for (auto& pe : peers) list += (list.empty() ? "" : ",") + pe;
          args.push_back("proxies=" + list);
          args.push_back("secret_file=" + servers[0].secret_file());
          args.push_back(std::string("routing=") + (s.routing ? "1" : "0"));
          args.push_back(std::string("partition=") + (s.partition ? "1" : "0"));
          args.push_back(std::string("dual=") + (s.dual ? "1" : "0"));
        }
        std::vector<std::string> peer = {"train", "worker"};
        peer.insert(peer.end(), args.begin(), args.end());
        proc = StartMpiRanks(p, peer);
      }
      if (!proc) return 1;
      bool got = false;
      for (const std::string& line :
           ReadResultLines(*proc, 1, std::chrono::minutes(10))) {
        double it_ms, bl_ms;
        if (std::sscanf(line.c_str(), "%lf %lf", &it_ms, &bl_ms) == 2) {
          res[{name, s.name}] = {it_ms, bl_ms};
          got = true;
        }
      }
      proc->Wait(std::chrono::minutes(2));
      if (!model_file.empty()) std::remove(model_file.c_str());
      if (!got) {
        std::fprintf(stderr, "error: %s %s produced no result\n", name.c_str(),
                     s.name);
        return 1;
      }
      auto [it_ms, bl_ms] = res[{name, s.name}];
      for (auto [metric, v] : {std::make_pair("iteration", it_ms),
                               std::make_pair("blocked", bl_ms)}) {
        Record r;
        r.bench = "train";
        r.variant = s.name;
        r.size_bytes = m.bytes();
        r.workers = p;
        r.metric = metric;
        r.value = v;
        r.unit = "ms";
        r.case_name = name;
        report.Add(r);
      }
    }
  }
  Progress(total, total, "done");
  std::printf(
      "\n%d workers; compute emulated; ms per iteration (blocked "
      "communication in parentheses); ratios vs the best AllReduce\n",
      p);
  for (const auto& name : models) {
    double best_it = 1e300, best_bl = 1e300;
    for (const char* b : {"mpi", "gloo"}) {
      auto it = res.find({name, b});
      if (it != res.end()) {
        best_it = std::min(best_it, it->second.first);
        best_bl = std::min(best_bl, it->second.second);
      }
    }
    std::printf("%-11s", name.c_str());
    for (const auto& s : schemes) {
      auto it = res.find({name, s.name});
      if (it == res.end()) continue;
      std::printf("  %s %.0f (%.0f) x%.2f/x%.2f", s.name, it->second.first,
                  it->second.second, it->second.first / best_it,
                  it->second.second / std::max(best_bl, 1e-9));
    }
    std::printf("\n");
  }
  Status st = report.Finish(
      opt.common, "iteration,blocked",
      "emulated training, " + std::to_string(p) +
          " workers: iteration time (hatched: blocked communication)",
      false, "case");
  if (!st.ok()) {
    std::fprintf(stderr, "error: %s\n", st.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace membox::bench
