#include "bench/async_sgd/async_sgd_bench.h"

// The C bindings only: the deprecated C++ bindings are not linked.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <future>
#include <map>
#include <thread>

#include <mpi.h>
#include <unistd.h>

#include "membox/base/config.h"
#include "membox/base/subprocess.h"
#include "membox/base/wait.h"
#include "membox/memserver/client.h"

#include "bench/common/mpi_launch.h"
#include "bench/common/server_process.h"

namespace membox::bench {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

struct Model {
  const char* name;
  double megabytes;  // parameter bytes / 1e6 (Table 2)
  int compute_ms;
};
// seed 003 Table 2.
constexpr Model kModels[] = {
    {"inception_v1", 51.09, 189}, {"inception_v3", 94.30, 445},
    {"resnet_50", 121.13, 233},   {"inception_resnet_v2", 214.08, 294},
    {"resnet_152", 253.63, 218},  {"vgg16", 527.79, 190},
};

double Ms(Clock::duration d) {
  return std::chrono::duration<double, std::milli>(d).count();
}

std::string ReadLine(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "r");
  char buf[1024] = {0};
  if (f) {
    if (!std::fgets(buf, sizeof(buf), f)) buf[0] = 0;
    std::fclose(f);
  }
  std::string s(buf);
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
  return s;
}

// Runs `iters` iterations: compute is a sleep of compute_ms (the emulation of
// the paper); `comm` exchanges one gradient for new weights. Sequential:
// compute then communicate. Overlapped: the previous iteration's exchange
// runs in a second thread while this one computes.
template <typename Comm>
void Loop(bool overlapped, int compute_ms, int iters, Comm&& comm,
          double* comm_ms, double* iter_ms) {
  std::vector<double> c, it;
  auto compute = [&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(compute_ms));
  };
  for (int i = 0; i <= iters; ++i) {  // iteration 0 warms up
    auto t0 = Clock::now();
    double this_comm = 0;
    if (overlapped) {
      auto f = std::async(std::launch::async, [&] {
        auto a = Clock::now();
        comm();
        return Ms(Clock::now() - a);
      });
      compute();
      this_comm = f.get();
    } else {
      compute();
      auto a = Clock::now();
      comm();
      this_comm = Ms(Clock::now() - a);
    }
    if (i > 0) {
      c.push_back(this_comm);
      it.push_back(Ms(Clock::now() - t0));
    }
  }
  double sc = 0, si = 0;
  for (double x : c) sc += x;
  for (double x : it) si += x;
  *comm_ms = sc / static_cast<double>(c.size());
  *iter_ms = si / static_cast<double>(it.size());
}

// The exchange's pieces: kChunks page-aligned (offset, length) ranges.
// membox pipelines its exchange over them, and so does the MPI server.
std::vector<std::pair<size_t, size_t>> Chunks(size_t bytes) {
  constexpr size_t kChunks = 4;
  size_t chunk = (bytes / kChunks + 4095) & ~size_t{4095};
  std::vector<std::pair<size_t, size_t>> parts;
  for (size_t off = 0; off < bytes; off += chunk) {
    parts.emplace_back(off, std::min(chunk, bytes - off));
  }
  return parts;
}

// w[i] -= 0.01 g[i] over [lo, hi), split over every core.
void ApplySgd(float* w, const float* g, size_t lo, size_t hi) {
  const size_t threads =
      std::max<size_t>(1, std::thread::hardware_concurrency());
  const size_t step = (hi - lo + threads - 1) / threads;
  auto part = [&](size_t a, size_t b) {
    for (size_t i = a; i < b; ++i) w[i] -= 0.01f * g[i];
  };
  std::vector<std::future<void>> rest;
  for (size_t t = 1; t < threads && lo + t * step < hi; ++t) {
    rest.push_back(std::async(std::launch::async, part, lo + t * step,
                              std::min(hi, lo + (t + 1) * step)));
  }
  part(lo, std::min(hi, lo + step));
  for (auto& f : rest) f.get();
}

// The MPI baseline as a competent MPI programmer writes a parameter server
// (issue 47; it was one blocking Recv/apply/Send at a time): every worker's
// gradient chunks have receives posted at once (MPI_Irecv), the server
// applies whichever chunk arrives first (MPI_Waitany) on every core, and
// answers that chunk with MPI_Isend of a copy while later chunks are still
// arriving -- the pipeline membox's exchange has. Workers send and receive
// all chunks non-blocking. Async SGD: a worker gets the weights as they are
// after its own update.
int MpiWorker(bool overlapped, size_t bytes, int compute_ms, int iters) {
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const size_t n = bytes / 4;
  const auto parts = Chunks(bytes);
  const int K = static_cast<int>(parts.size());
  auto count = [&](int c) { return static_cast<int>(parts[c].second / 4); };
  auto first = [&](int c) { return parts[c].first / 4; };
  if (rank == 0) {  // the parameter server
    const int workers = size - 1;
    std::vector<float> w(n, 1.0f);
    std::vector<std::vector<float>> g(workers, std::vector<float>(n)),
        out(workers, std::vector<float>(n));
    // Request slot (worker, chunk) -> receive; sends likewise.
    std::vector<MPI_Request> recv(workers * K, MPI_REQUEST_NULL),
        send(workers * K, MPI_REQUEST_NULL);
    // Times each (worker, chunk) slot was served: every worker exchanges
    // iters + 1 times (the first warms up).
    std::vector<int> served(workers * K, 0);
    auto post = [&](int v, int c) {
      MPI_Irecv(g[v].data() + first(c), count(c), MPI_FLOAT, v + 1, 1 + c,
                MPI_COMM_WORLD, &recv[v * K + c]);
    };
    for (int v = 0; v < workers; ++v)
      for (int c = 0; c < K; ++c) post(v, c);
    long remaining = static_cast<long>(workers) * (iters + 1) * K;
    while (remaining-- > 0) {
      int idx = MPI_UNDEFINED;
      MPI_Waitany(static_cast<int>(recv.size()), recv.data(), &idx,
                  MPI_STATUS_IGNORE);
      if (idx == MPI_UNDEFINED) break;
      const int v = idx / K, c = idx % K;
      const size_t lo = first(c), hi = lo + count(c);
      ApplySgd(w.data(), g[v].data(), lo, hi);
      MPI_Wait(&send[idx], MPI_STATUS_IGNORE);  // its previous answer left
      std::memcpy(out[v].data() + lo, w.data() + lo, (hi - lo) * 4);
      MPI_Isend(out[v].data() + lo, count(c), MPI_FLOAT, v + 1, 100 + c,
                MPI_COMM_WORLD, &send[idx]);
      // The worker's next exchange sends this chunk again.
      if (++served[idx] < iters + 1) post(v, c);
    }
    MPI_Waitall(static_cast<int>(send.size()), send.data(),
                MPI_STATUSES_IGNORE);
    return 0;
  }
  std::vector<float> buf(n, 0.001f), w(n, 1.0f);
  double comm = 0, iter = 0;
  std::vector<MPI_Request> reqs(2 * K);
  Loop(
      overlapped, compute_ms, iters,
      [&] {
        for (int c = 0; c < K; ++c) {
          MPI_Irecv(w.data() + first(c), count(c), MPI_FLOAT, 0, 100 + c,
                    MPI_COMM_WORLD, &reqs[K + c]);
          MPI_Isend(buf.data() + first(c), count(c), MPI_FLOAT, 0, 1 + c,
                    MPI_COMM_WORLD, &reqs[c]);
        }
        MPI_Waitall(2 * K, reqs.data(), MPI_STATUSES_IGNORE);
      },
      &comm, &iter);
  std::printf("RESULT %d %.3f %.3f\n", rank, comm, iter);
  std::fflush(stdout);
  return 0;
}

// One exchange: write-sync the gradient, accumulate it into the weights on
// the memory node, read-sync the weights -- pipelined over the chunks from
// one thread with AccumulateAsync: chunk i is accumulated on the node while
// the worker writes chunk i+1 and then reads chunk i-1 back, as COARSE
// pipelines shards over both directions of a link. `mapped`: the gradient
// is already in the node's pool (produced in Segment::Map()), so there is no
// write-sync and every accumulate goes out at once.
Status PipelinedExchange(memserver::Client& c, memserver::Segment* w,
                         memserver::Segment* g, size_t bytes, bool mapped) {
  const auto parts = Chunks(bytes);
  std::vector<service::Call> acc(parts.size());
  Status err;
  auto read_back = [&](size_t i) {
    Status a = acc[i].Wait(std::chrono::minutes(5));
    if (err.ok() && !a.ok()) err = a;
    if (err.ok()) err = c.ReadSync(w, parts[i].first, parts[i].second);
  };
  for (size_t i = 0; i < parts.size(); ++i) {
    if (!mapped && err.ok()) {
      err = c.WriteSync(g, parts[i].first, parts[i].second);
    }
    acc[i] = err.ok() ? c.AccumulateAsync(w, g, DType::kFloat32, -0.01,
                                          parts[i].first, parts[i].second)
                      : service::Call::Done(err);
    if (!mapped && i > 0) read_back(i - 1);
  }
  for (size_t i = mapped ? 0 : parts.size() - 1; i < parts.size(); ++i) {
    read_back(i);
  }
  return err;
}

int MemboxWorker(bool overlapped, bool mapped, size_t bytes, int compute_ms,
                 int iters, const std::string& server,
                 const std::string& secret_file) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  memserver::ClientOptions o;
  o.server = server;
  o.secret = ReadLine(secret_file);
  o.name = "sgd-worker-" + std::to_string(rank);
  o.timeout = std::chrono::milliseconds(120000);
  auto c = memserver::Client::Connect(o);
  if (!c.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", rank, c.status().ToString().c_str());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  const uint64_t kWeights = 0x5347440000000001ull;
  Result<memserver::Segment*> w = InternalError("unset");
  if (rank == 0) {
    w = (*c)->Create(kWeights, bytes);
    if (w.ok()) {
      std::fill_n(static_cast<float*>((*w)->data()), bytes / 4, 1.0f);
      (void)(*c)->WriteSync(*w, 0, bytes);
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank != 0) w = (*c)->Attach(kWeights, bytes);
  auto g = (*c)->Create(0, bytes);
  if (!w.ok() || !g.ok()) {
    std::fprintf(stderr, "rank %d: %s %s\n", rank,
                 w.status().ToString().c_str(), g.status().ToString().c_str());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  std::fill_n(static_cast<float*>((*g)->data()), bytes / 4, 0.001f);
  if (mapped) {
    // The gradient lives in the node's pool; "computing" it writes there.
    auto* in_pool = static_cast<float*>((*g)->Map());
    if (in_pool == nullptr) {
      std::fprintf(stderr, "rank %d: the segment cannot be mapped here\n",
                   rank);
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    std::fill_n(in_pool, bytes / 4, 0.001f);
  }
  double comm = 0, iter = 0;
  Status err;
  Loop(
      overlapped, compute_ms, iters,
      [&] {
        Status s = PipelinedExchange(**c, *w, *g, bytes, mapped);
        if (!s.ok()) err = s;
      },
      &comm, &iter);
  if (!err.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", rank, err.ToString().c_str());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  std::printf("RESULT %d %.3f %.3f\n", rank, comm, iter);
  std::fflush(stdout);
  (void)(*c)->Delete(*g);
  if (rank != 0) (void)(*c)->Detach(*w);
  MPI_Barrier(
      MPI_COMM_WORLD);  // nobody deletes the weights while others use them
  if (rank == 0) (void)(*c)->Delete(*w);
  return 0;
}

struct Outcome {
  double comm_ms = 0;
  double iter_ms = 0;
};

// Runs one configuration under mpirun; returns the mean over workers.
Result<Outcome> Launch(int ranks, const std::vector<std::string>& worker_args,
                       int expect_results) {
  std::vector<std::string> peer = {"async-sgd"};
  peer.insert(peer.end(), worker_args.begin(), worker_args.end());
  auto p = StartMpiRanks(ranks, peer);
  if (!p) return InternalError("cannot start mpirun");
  Outcome o;
  int got = 0;
  for (const std::string& line : ReadResultLines(
           *p, static_cast<size_t>(expect_results), std::chrono::minutes(10))) {
    int rank;
    double c, i;
    if (std::sscanf(line.c_str(), "%d %lf %lf", &rank, &c, &i) == 3) {
      o.comm_ms += c;
      o.iter_ms += i;
      ++got;
    }
  }
  auto rc = p->Wait(std::chrono::minutes(2));
  if (got != expect_results || !rc || *rc != 0) {
    return InternalError("mpirun run failed (" + std::to_string(got) + "/" +
                         std::to_string(expect_results) + " results)");
  }
  o.comm_ms /= got;
  o.iter_ms /= got;
  return o;
}

}  // namespace

int RunAsyncSgdWorker(const std::vector<std::string>& a) {
  if (a.size() < 5) {
    std::fprintf(
        stderr,
        "usage: bench-peer async-sgd SYSTEM SCENARIO BYTES COMPUTE_MS ITERS "
        "[SERVER SECRET_FILE]\n");
    return 2;
  }
  int provided = 0;
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
  bool overlapped = a[1] == "overlapped";
  size_t bytes = std::stoull(a[2]) / 4 * 4;
  int compute = std::stoi(a[3]), iters = std::stoi(a[4]);
  int rc = a[0] == "mpi"
               ? MpiWorker(overlapped, bytes, compute, iters)
               : MemboxWorker(overlapped, a[0] == "membox-mapped", bytes,
                              compute, iters, a.at(5), a.at(6));
  MPI_Finalize();
  return rc;
}

int RunAsyncSgdBench(const AsyncSgdOptions& opt) {
  const bool quick = opt.common.quick;
  std::vector<int> workers = quick
                                 ? std::vector<int>{2, 4}
                                 : std::vector<int>{2, 4, 6, 8, 12, 18, 24, 32};
  if (!opt.workers.empty()) workers = opt.workers;
  std::vector<Model> models;
  for (const std::string& name : opt.models) {
    if (std::none_of(std::begin(kModels), std::end(kModels),
                     [&](const Model& m) { return name == m.name; })) {
      std::fprintf(stderr,
                   "unknown model '%s' (seed 003 Table 2: inception_v1, "
                   "inception_v3, resnet_50, inception_resnet_v2, resnet_152, "
                   "vgg16)\n",
                   name.c_str());
      return 2;
    }
  }
  for (const Model& m : kModels) {
    bool wanted = opt.models.empty()
                      ? !quick || std::string(m.name) == "inception_v1" ||
                            std::string(m.name) == "vgg16"
                      : std::find(opt.models.begin(), opt.models.end(),
                                  m.name) != opt.models.end();
    if (wanted) models.push_back(m);
  }
  const int iters = opt.iterations > 0 ? opt.iterations : (quick ? 3 : 5);
  const char* scenarios[] = {"sequential", "overlapped"};
  Report rep("async-sgd");
  int total = static_cast<int>(models.size() * workers.size()), step = 0;
  std::vector<std::string> skipped;
  for (const Model& m : models) {
    const uint64_t bytes = static_cast<uint64_t>(m.megabytes * 1e6);
    for (int w : workers) {
      Progress(++step, total,
               std::string(m.name) + ", " + std::to_string(w) + " workers");
      // The memory node's buddy allocator rounds segments up to powers of two.
      const uint64_t block = std::bit_ceil(bytes);
      const uint64_t pool =
          (static_cast<uint64_t>(w) + 2) * block + (256ull << 20);
      // membox: pool + two caches per worker; MPI: two buffers per rank.
      const uint64_t mem = std::max(pool + 2 * static_cast<uint64_t>(w) * bytes,
                                    (static_cast<uint64_t>(w) + 1) * 2 * bytes);
      if (mem > opt.memory_budget) {
        skipped.push_back(std::string(m.name) + "/" + std::to_string(w));
        continue;
      }
      auto server = ServerProcess::Start(pool, "auto");
      if (!server.ok()) {
        std::fprintf(stderr, "%s\n", server.status().ToString().c_str());
        return 1;
      }
      for (const char* sc : scenarios) {
        std::vector<std::string> common = {sc, std::to_string(bytes),
                                           std::to_string(m.compute_ms),
                                           std::to_string(iters)};
        std::vector<std::string> mpi_args = {"mpi"}, mbx_args = {"membox"},
                                 map_args = {"membox-mapped"};
        mpi_args.insert(mpi_args.end(), common.begin(), common.end());
        for (auto* a : {&mbx_args, &map_args}) {
          a->insert(a->end(), common.begin(), common.end());
          a->push_back(server->endpoint());
          a->push_back(server->secret_file());
        }
        auto mpi = Launch(w + 1, mpi_args, w);
        auto mbx = Launch(w, mbx_args, w);
        auto map = Launch(w, map_args, w);
        if (!mpi.ok() || !mbx.ok() || !map.ok()) {
          std::fprintf(stderr, "%s: mpi %s, membox %s, membox-mapped %s\n",
                       m.name, mpi.status().ToString().c_str(),
                       mbx.status().ToString().c_str(),
                       map.status().ToString().c_str());
          return 1;
        }
        for (auto& [variant, out] :
             {std::pair<const char*, Outcome>{"mpi", *mpi},
              std::pair<const char*, Outcome>{"membox", *mbx},
              std::pair<const char*, Outcome>{"membox-mapped", *map}}) {
          rep.Add({"", variant, bytes, w, std::string(sc) + "_comm_time",
                   out.comm_ms, "ms", m.name});
          rep.Add({"", variant, bytes, w, std::string(sc) + "_iteration_time",
                   out.iter_ms, "ms", m.name});
        }
      }
    }
  }

  double ratio_sum = 0, map_ratio_sum = 0;
  int ratio_n = 0;
  for (const char* sc : scenarios) {
    std::printf(
        "\nmembox bench async-sgd, %s scenario: per-iteration times (ms), mean "
        "over "
        "workers\n\n",
        sc);
    std::printf("%-20s %4s | %9s %9s %7s %9s %7s | %9s %9s %7s %9s %7s\n",
                "model", "W", "mpi comm", "mbx comm", "ratio", "map comm",
                "ratio", "mpi iter", "mbx iter", "ratio", "map iter", "ratio");
    for (const Model& m : models) {
      const uint64_t bytes = static_cast<uint64_t>(m.megabytes * 1e6);
      for (int w : workers) {
        auto get = [&](const char* v, const std::string& metric) -> double {
          for (const auto& r : rep.records()) {
            if (r.variant == v && r.workers == w && r.case_name == m.name &&
                r.metric == metric && r.size_bytes == bytes) {
              return r.value;
            }
          }
          return NAN;
        };
        double mc = get("mpi", std::string(sc) + "_comm_time");
        double bc = get("membox", std::string(sc) + "_comm_time");
        double pc = get("membox-mapped", std::string(sc) + "_comm_time");
        double mi = get("mpi", std::string(sc) + "_iteration_time");
        double bi = get("membox", std::string(sc) + "_iteration_time");
        double pi = get("membox-mapped", std::string(sc) + "_iteration_time");
        if (std::isnan(mc)) continue;
        std::printf(
            "%-20s %4d | %9.1f %9.1f %6.2fx %9.1f %6.2fx | %9.1f %9.1f %6.2fx "
            "%9.1f %6.2fx\n",
            m.name, w, mc, bc, mc / bc, pc, mc / pc, mi, bi, mi / bi, pi,
            mi / pi);
        if (std::string(sc) == "sequential") {
          ratio_sum += mc / bc;
          map_ratio_sum += mc / pc;
          ++ratio_n;
        }
      }
    }
  }
  if (ratio_n > 0) {
    std::printf(
        "\nsequential communication time, MPI / membox, mean over models and "
        "worker "
        "counts: %.2fx (write-sync, accumulate, read-sync); %.2fx with the "
        "gradient produced in the mapped segment (accumulate, read-sync)\n",
        ratio_sum / ratio_n, map_ratio_sum / ratio_n);
  }
  if (!skipped.empty()) {
    std::printf("skipped (memory budget %s): ",
                FormatByteSize(opt.memory_budget).c_str());
    for (auto& s : skipped) std::printf("%s ", s.c_str());
    std::printf("\n");
  }
  Status st = rep.Finish(
      opt.common, "sequential_comm_time",
      "membox bench async-sgd: sequential communication time per iteration",
      true, "workers");
  if (!st.ok()) {
    std::fprintf(stderr, "%s\n", st.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace membox::bench
