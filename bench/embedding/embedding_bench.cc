#include "bench/embedding/embedding_bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <unordered_set>

#include <unistd.h>

#include "membox/embedding/client.h"
#include "membox/embedding/mem_tier.h"
#include "membox/embedding/pipeline.h"
#include "membox/embedding/ssd_store.h"

#include "bench/common/server_process.h"
#include "bench/embedding/rocksdb_store.h"

namespace membox::bench {
namespace {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

double Sec(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

// Zipf(alpha) over ranks 0..n-1 by inverse CDF; ranks are scattered over
// the key space so hot keys are not neighbours.
class Zipf {
 public:
  Zipf(uint64_t n, double alpha) : cdf_(n) {
    double sum = 0;
    for (uint64_t i = 0; i < n; ++i) {
      sum += 1.0 / std::pow(double(i + 1), alpha);
      cdf_[i] = sum;
    }
    for (auto& c : cdf_) c /= sum;
  }
  uint64_t Next(std::mt19937_64& rng) {
    double u = std::uniform_real_distribution<double>(0, 1)(rng);
    uint64_t rank =
        std::lower_bound(cdf_.begin(), cdf_.end(), u) - cdf_.begin();
    return (rank + 1) * 0x9E3779B97F4A7C15ull;
  }

 private:
  std::vector<double> cdf_;
};

std::vector<std::vector<uint64_t>> Trace(const EmbeddingBenchOptions& o,
                                         uint64_t keys, int steps) {
  Zipf z(keys, 1.05);
  std::mt19937_64 rng(42);
  std::vector<std::vector<uint64_t>> t(steps);
  for (auto& b : t) {
    std::unordered_set<uint64_t> u;
    for (int i = 0; i < o.batch; ++i) u.insert(z.Next(rng));
    b.assign(u.begin(), u.end());  // keys deduplicated per batch
  }
  return t;
}

// Adagrad on the pulled rows with a made-up gradient (the push).
void Update(std::vector<uint8_t*>& rows, int dim) {
  for (uint8_t* r : rows) {
    float* w = reinterpret_cast<float*>(r);
    float* acc = w + dim;
    for (int i = 0; i < dim; ++i) {
      float g = 0.01f * float(i + 1);
      acc[i] += g * g;
      w[i] -= 0.05f * g / (std::sqrt(acc[i]) + 1e-6f);
    }
  }
}

struct TierResult {
  double pull_seconds = 0, rows = 0, lookups = 0;
  // Apply + unpin, and every 20 batches the flush (and compaction) that
  // writes the updated rows to the SSD tier.
  double push_seconds = 0;
  embedding::SsdStats ssd;
  embedding::MemTierStats mem;
  double mean_fetch_s = 0;
};

Result<TierResult> RunTier(embedding::SsdStore* ssd,
                           const EmbeddingBenchOptions& o, uint64_t keys,
                           const std::vector<std::vector<uint64_t>>& trace) {
  const uint32_t row = static_cast<uint32_t>(2 * o.dim * sizeof(float));
  embedding::MemTierOptions mo;
  mo.budget_bytes = static_cast<uint64_t>(keys * row * o.budget_fraction);
  mo.initializer = [dim = o.dim](uint64_t key, std::span<uint8_t> r) {
    std::mt19937 g(static_cast<uint32_t>(key));
    float* w = reinterpret_cast<float*>(r.data());
    for (int i = 0; i < dim; ++i)
      w[i] = std::uniform_real_distribution<float>(-0.01f, 0.01f)(g);
    std::memset(w + dim, 0, dim * sizeof(float));
  };
  ASSIGN_OR_RETURN(auto tier, embedding::MemTier::Create(mo, ssd));
  TierResult r;
  for (size_t s = 0; s < trace.size(); ++s) {
    auto t0 = Clock::now();
    ASSIGN_OR_RETURN(auto rows, tier->Acquire(trace[s], s));
    r.pull_seconds += Sec(Clock::now() - t0);
    r.rows += rows.size();
    r.lookups += o.batch;
    t0 = Clock::now();
    Update(rows, o.dim);
    tier->MarkDirty(trace[s]);
    RETURN_IF_ERROR(tier->Release(s));
    if (s % 20 == 19) {
      RETURN_IF_ERROR(tier->Flush());
      RETURN_IF_ERROR(ssd->Compact());
    }
    r.push_seconds += Sec(Clock::now() - t0);
  }
  RETURN_IF_ERROR(tier->Flush());
  r.ssd = ssd->Stats();
  r.mem = tier->Stats();
  r.mean_fetch_s = r.pull_seconds / trace.size();
  return r;
}

// The pipeline: batches fetched `depth` ahead by a prefetch thread while
// "training" (sleep of compute_s) runs; returns blocked seconds per batch.
Result<double> RunPipeline(embedding::SsdStore* ssd,
                           const EmbeddingBenchOptions& o, uint64_t keys,
                           const std::vector<std::vector<uint64_t>>& trace,
                           int depth, double compute_s) {
  const uint32_t row = static_cast<uint32_t>(2 * o.dim * sizeof(float));
  embedding::MemTierOptions mo;
  mo.budget_bytes = static_cast<uint64_t>(keys * row * o.budget_fraction);
  ASSIGN_OR_RETURN(auto tier, embedding::MemTier::Create(mo, ssd));
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::pair<size_t, std::vector<uint8_t*>>> ready;
  size_t consumed = 0;
  Status failure;
  std::thread prefetch;
  if (depth > 0) {
    prefetch = std::thread([&] {
      for (size_t s = 0; s < trace.size(); ++s) {
        {
          std::unique_lock<std::mutex> l(mu);
          cv.wait(l, [&] { return s < consumed + depth || !failure.ok(); });
          if (!failure.ok()) return;
        }
        auto rows = tier->Acquire(trace[s], s);
        std::lock_guard<std::mutex> l(mu);
        if (!rows.ok()) {
          failure = rows.status();
        } else {
          ready.emplace_back(s, std::move(*rows));
        }
        cv.notify_all();
      }
    });
  }
  double blocked = 0;
  for (size_t s = 0; s < trace.size(); ++s) {
    auto t0 = Clock::now();
    std::vector<uint8_t*> rows;
    if (depth > 0) {
      std::unique_lock<std::mutex> l(mu);
      cv.wait(l, [&] { return !ready.empty() || !failure.ok(); });
      if (!failure.ok()) break;
      rows = std::move(ready.front().second);
      ready.pop_front();
    } else {
      ASSIGN_OR_RETURN(rows, tier->Acquire(trace[s], s));
    }
    blocked += Sec(Clock::now() - t0);
    std::this_thread::sleep_for(std::chrono::duration<double>(compute_s));
    Update(rows, o.dim);
    tier->MarkDirty(trace[s]);
    RETURN_IF_ERROR(tier->Release(s));
    {
      std::lock_guard<std::mutex> l(mu);
      consumed = s + 1;
    }
    cv.notify_all();
  }
  if (prefetch.joinable()) prefetch.join();
  RETURN_IF_ERROR(failure);
  return blocked / trace.size();
}

// The cross-process path: two memory-node processes with embedding servers
// (memory tier + SSD tier each), this process as the worker. Without
// prefetch each batch is pulled (pinned), "trained" for compute_s and
// pushed; with it, EmbeddingPipeline fetches `depth` batches ahead.
struct RemoteResult {
  double mean_pull_s = 0;      // warm-up: pull time per batch, nothing else
  double mean_push_s = 0;      // warm-up: push time per batch
  double rows_per_s = 0;       // pulls of the no-prefetch run
  double push_rows_per_s = 0;  // pushes of the no-prefetch run
  double compute_s = 0;
  double blocked_off_s = 0, blocked_on_s = 0;  // per batch
};

// `push_log`: the nodes make every push durable before answering it
// (their default); `replicate`: each node's rows are copied to the other
// (the default of `membox launch` with 2 nodes), lagging the answers by
// the nodes' default allowance or, with `copy_first`, before it answers;
// `pipeline`: also run the prefetch pipeline.
Result<RemoteResult> RunRemote(const EmbeddingBenchOptions& o, uint64_t keys,
                               std::vector<std::vector<uint64_t>> trace,
                               const fs::path& base, bool push_log,
                               bool replicate, bool pipeline,
                               bool copy_first = false) {
  const uint32_t row = static_cast<uint32_t>(2 * o.dim * sizeof(float));
  std::random_device rd;
  std::string secret = "bench-" + std::to_string(rd()) + std::to_string(rd()) +
                       std::to_string(rd()) + std::to_string(rd());
  std::vector<ServerProcess> nodes;
  embedding::EmbeddingClientOptions co;
  std::vector<std::string> eps;
  for (int i = 0; i < 2; ++i) {
    eps.push_back(replicate
                      ? "127.0.0.1:" + std::to_string(ServerProcess::FreePort())
                      : "127.0.0.1:0");
  }
  for (int i = 0; i < 2; ++i) {
    fs::path d = base / ("node" + std::to_string(i));
    fs::create_directories(d);
    ASSIGN_OR_RETURN(
        auto s,
        ServerProcess::StartEmbeddingNode(
            d.string(),
            static_cast<uint64_t>(keys * row * o.budget_fraction / 2), secret,
            push_log, eps[i], replicate ? eps[1 - i] : std::string(),
            "node-" + std::to_string(i),
            copy_first ? std::vector<std::string>{"--emb-backup-lag", "0"}
                       : std::vector<std::string>{}));
    co.nodes.push_back(s.embedding_endpoint());
    nodes.push_back(std::move(s));
  }
  co.secret = secret;
  co.name = "bench-embedding";
  ASSIGN_OR_RETURN(auto client, embedding::EmbeddingClient::Connect(co));
  auto open = [&](const std::string& name) {
    embedding::TableConfig c;
    c.name = name;
    c.dim = static_cast<uint32_t>(o.dim);
    c.optimizer = embedding::RowOptimizer::kAdagrad;
    c.lr = 0.05;
    return client->OpenTable(c);
  };
  const size_t dim = o.dim;
  std::vector<float> grads;
  auto grads_for = [&](size_t n) -> std::span<const float> {
    if (grads.size() < n * dim) grads.assign(n * dim, 0.01f);
    return {grads.data(), n * dim};
  };
  // Pulls (pinned) and pushes `batches` batches of the trace on a fresh
  // table without prefetch, running `between` after each pull.
  struct Loop {
    double pull = 0, push = 0, rows = 0;
  };
  auto run_loop = [&](const std::string& table, size_t batches,
                      const std::function<void()>& between) -> Result<Loop> {
    ASSIGN_OR_RETURN(uint32_t t, open(table));
    Loop l;
    std::vector<float> out;
    for (size_t s = 0; s < batches; ++s) {
      out.resize(trace[s].size() * dim);
      auto t0 = Clock::now();
      RETURN_IF_ERROR(client->Pull(t, trace[s], out.data(), s + 1));
      l.pull += Sec(Clock::now() - t0);
      l.rows += trace[s].size();
      between();
      t0 = Clock::now();
      RETURN_IF_ERROR(
          client->Push(t, trace[s], grads_for(trace[s].size()), s + 1, true));
      l.push += Sec(Clock::now() - t0);
    }
    return l;
  };
  RemoteResult r;
  // Warm-up table: pull and push time per batch.
  size_t warm = std::min<size_t>(trace.size(), 40);
  ASSIGN_OR_RETURN(Loop w, run_loop("warmup", warm, [] {}));
  r.mean_pull_s = w.pull / warm;
  r.mean_push_s = w.push / warm;
  // Compute per batch >= the batch's communication (pull + push): on two
  // cores the nodes' push work competes with the next pulls.
  r.compute_s = std::max(0.001, (r.mean_pull_s + r.mean_push_s) * 1.2);
  auto compute = [&] {
    std::this_thread::sleep_for(std::chrono::duration<double>(r.compute_s));
  };
  // No prefetch: the trainer blocks for every pull.
  ASSIGN_OR_RETURN(Loop off, run_loop("no-prefetch", trace.size(), compute));
  r.blocked_off_s = off.pull / trace.size();
  r.rows_per_s = off.rows / off.pull;
  r.push_rows_per_s = off.rows / off.push;
  if (pipeline) {  // the 4-stage pipeline, depth 2
    ASSIGN_OR_RETURN(uint32_t t, open("prefetch"));
    size_t next = 0;
    embedding::PipelineOptions po;
    po.depth = 2;
    po.partitions = 2;
    ASSIGN_OR_RETURN(auto p, embedding::EmbeddingPipeline::Start(
                                 client.get(), t,
                                 [&](std::vector<uint64_t>* k) -> Result<bool> {
                                   if (next == trace.size()) return false;
                                   *k = trace[next++];
                                   return true;
                                 },
                                 po));
    for (;;) {
      ASSIGN_OR_RETURN(auto b, p->Next());
      if (!b) break;
      compute();
      auto& ws = *b->working_set;
      std::vector<float> one(dim, 0.01f);
      for (size_t i = 0; i < b->keys.size(); ++i) ws.AddGradient(i, one);
      RETURN_IF_ERROR(p->Complete(std::move(b)));
    }
    RETURN_IF_ERROR(p->Finish());
    r.blocked_on_s = p->Stats().blocked_seconds / trace.size();
  }
  return r;
}

}  // namespace

int RunEmbeddingBench(const EmbeddingBenchOptions& o) {
  const bool q = o.common.quick;
  uint64_t keys = o.keys ? o.keys : (q ? 1000000 : 10000000);
  int steps = o.steps ? o.steps : (q ? 120 : 600);
  const uint32_t row = static_cast<uint32_t>(2 * o.dim * sizeof(float));
  std::fprintf(stderr,
               "table %llu keys x %u B = %.0f MB, memory budget %.0f MB; %d "
               "batches of %d Zipf(1.05) lookups\n",
               (unsigned long long)keys, row, keys * row / 1e6,
               keys * row * o.budget_fraction / 1e6, steps, o.batch);
  auto trace = Trace(o, keys, steps);
  Report report("embedding");
  auto add = [&](const std::string& variant, const std::string& metric,
                 double v, const std::string& unit) {
    Record r;
    r.bench = "embedding";
    r.variant = variant;
    r.size_bytes = keys * row;
    r.workers = 1;
    r.metric = metric;
    r.value = v;
    r.unit = unit;
    r.case_name = metric;
    report.Add(r);
  };
  fs::path base =
      fs::path(o.dir) / ("membox-embedding-" + std::to_string(getpid()));
  std::map<std::string, TierResult> res;
  for (std::string variant : {"membox", "rocksdb"}) {
    Progress(variant == "membox" ? 0 : 1, 4, variant + " SSD tier");
    fs::remove_all(base);
    std::unique_ptr<embedding::SsdStore> ssd;
    if (variant == "membox") {
      embedding::SsdOptions so;
      so.dir = base.string();
      so.row_bytes = row;
      auto s = embedding::SsdStore::Open(so);
      if (!s.ok()) {
        std::fprintf(stderr, "error: %s\n", s.status().ToString().c_str());
        return 1;
      }
      ssd = std::move(*s);
    } else {
      fs::create_directories(base);
      // As much memory as membox's SSD tier keeps for its key map: an
      // unordered_map node per key (next pointer, key, 32-byte location,
      // allocator header) and its bucket -- about 64 bytes.
      auto s = OpenRocksDbStore(base.string(), row, keys * 64);
      if (!s.ok()) {
        std::fprintf(stderr, "error: %s\n", s.status().ToString().c_str());
        return 1;
      }
      ssd = std::move(*s);
    }
    auto r = RunTier(ssd.get(), o, keys, trace);
    if (!r.ok()) {
      std::fprintf(stderr, "error: %s\n", r.status().ToString().c_str());
      return 1;
    }
    res[variant] = *r;
    add(variant, "pulls_per_s", r->rows / r->pull_seconds, "rows/s");
    add(variant, "pull_GBps", r->rows * row / r->pull_seconds / 1e9, "GB/s");
    add(variant, "pushes_per_s", r->rows / r->push_seconds, "rows/s");
    add(variant, "push_GBps", r->rows * row / r->push_seconds / 1e9, "GB/s");
    add(variant, "write_amplification", r->ssd.write_amplification(), "x");
    add(variant, "ssd_rows_read", double(r->mem.ssd_reads), "rows");
    ssd.reset();
    fs::remove_all(base);
  }
  // Prefetch on vs off, membox tier, compute per batch = the mean fetch.
  double compute = std::max(0.001, res["membox"].mean_fetch_s * 1.2);
  double blocked[2] = {0, 0};
  for (int depth : {0, 2}) {
    Progress(depth ? 3 : 2, 4, depth ? "prefetch on" : "prefetch off");
    fs::remove_all(base);
    embedding::SsdOptions so;
    so.dir = base.string();
    so.row_bytes = row;
    auto s = embedding::SsdStore::Open(so);
    if (!s.ok()) return 1;
    auto b = RunPipeline(s->get(), o, keys, trace, depth, compute);
    if (!b.ok()) {
      std::fprintf(stderr, "error: %s\n", b.status().ToString().c_str());
      return 1;
    }
    blocked[depth ? 1 : 0] = *b;
    add(depth ? "membox-prefetch" : "membox-no-prefetch", "blocked_ms",
        *b * 1e3, "ms/batch");
    s->reset();
    fs::remove_all(base);
  }
  // Through real memory-node processes.
  Progress(4, 5, "remote: 2 memory nodes, prefetch off / on");
  fs::remove_all(base);
  std::vector<std::vector<uint64_t>> remote_trace(
      trace.begin(),
      trace.begin() + std::min<size_t>(trace.size(), q ? 60 : 200));
  auto rr = RunRemote(o, keys, remote_trace, base, /*push_log=*/true,
                      /*replicate=*/true, /*pipeline=*/true);
  fs::remove_all(base);
  if (!rr.ok()) {
    std::fprintf(stderr, "error: %s\n", rr.status().ToString().c_str());
    return 1;
  }
  // The cost of durable acknowledgements: the same loop on nodes whose
  // pushes are durable only after a flush.
  auto nolog = RunRemote(o, keys, remote_trace, base, /*push_log=*/false,
                         /*replicate=*/false, /*pipeline=*/false);
  fs::remove_all(base);
  if (!nolog.ok()) {
    std::fprintf(stderr, "error: %s\n", nolog.status().ToString().c_str());
    return 1;
  }
  // The cost of the copy on the other node: the push log alone (each
  // node's acknowledged rows survive its process, not its disk).
  auto norep = RunRemote(o, keys, remote_trace, base, /*push_log=*/true,
                         /*replicate=*/false, /*pipeline=*/true);
  fs::remove_all(base);
  if (!norep.ok()) {
    std::fprintf(stderr, "error: %s\n", norep.status().ToString().c_str());
    return 1;
  }
  // The copy before the answer (`--emb-backup-lag 0`), as before the
  // backup could lag.
  auto first = RunRemote(o, keys, remote_trace, base, /*push_log=*/true,
                         /*replicate=*/true, /*pipeline=*/false,
                         /*copy_first=*/true);
  fs::remove_all(base);
  if (!first.ok()) {
    std::fprintf(stderr, "error: %s\n", first.status().ToString().c_str());
    return 1;
  }
  add("remote-membox-copy-first", "pulls_per_s", first->rows_per_s, "rows/s");
  add("remote-membox-copy-first", "pushes_per_s", first->push_rows_per_s,
      "rows/s");
  add("remote-membox-unreplicated", "pulls_per_s", norep->rows_per_s, "rows/s");
  add("remote-membox-unreplicated", "pushes_per_s", norep->push_rows_per_s,
      "rows/s");
  add("remote-unreplicated-prefetch", "blocked_ms", norep->blocked_on_s * 1e3,
      "ms/batch");
  add("remote-membox-flush-only", "pulls_per_s", nolog->rows_per_s, "rows/s");
  add("remote-membox-flush-only", "pushes_per_s", nolog->push_rows_per_s,
      "rows/s");
  add("remote-membox", "pulls_per_s", rr->rows_per_s, "rows/s");
  add("remote-membox", "pushes_per_s", rr->push_rows_per_s, "rows/s");
  add("remote-no-prefetch", "blocked_ms", rr->blocked_off_s * 1e3, "ms/batch");
  add("remote-prefetch", "blocked_ms", rr->blocked_on_s * 1e3, "ms/batch");
  Progress(5, 5, "done");
  auto& m = res["membox"];
  auto& r = res["rocksdb"];
  std::printf("\n%-9s %12s %8s %12s %8s %10s %14s\n", "SSD tier", "pulls/s",
              "GB/s", "pushes/s", "GB/s", "write amp", "SSD rows read");
  for (auto& [name, t] : res) {
    std::printf("%-9s %12.0f %8.3f %12.0f %8.3f %10.2f %14.0f\n", name.c_str(),
                t.rows / t.pull_seconds, t.rows * row / t.pull_seconds / 1e9,
                t.rows / t.push_seconds, t.rows * row / t.push_seconds / 1e9,
                t.ssd.write_amplification(), double(t.mem.ssd_reads));
  }
  std::printf(
      "membox / rocksdb pulls per second: %.2fx; write amplification "
      "%.2f vs %.2f\n",
      (m.rows / m.pull_seconds) / (r.rows / r.pull_seconds),
      m.ssd.write_amplification(), r.ssd.write_amplification());
  std::printf(
      "prefetch (depth 2, compute %.2f ms/batch): blocked %.3f ms vs "
      "%.3f ms without = %.2fx\n",
      compute * 1e3, blocked[1] * 1e3, blocked[0] * 1e3,
      blocked[1] / std::max(1e-12, blocked[0]));
  std::printf(
      "remote (2 memory-node processes, worker pipeline depth 2; pull "
      "%.2f + push %.2f ms/batch, compute %.2f ms/batch): pulls %.0f "
      "rows/s, pushes %.0f rows/s; blocked %.3f ms vs %.3f ms without = "
      "%.2fx\n",
      rr->mean_pull_s * 1e3, rr->mean_push_s * 1e3, rr->compute_s * 1e3,
      rr->rows_per_s, rr->push_rows_per_s, rr->blocked_on_s * 1e3,
      rr->blocked_off_s * 1e3,
      rr->blocked_on_s / std::max(1e-12, rr->blocked_off_s));
  std::printf(
      "push log (durable when acknowledged) vs flush-only: pushes %.0f vs "
      "%.0f rows/s = %.2fx; push %.2f vs %.2f ms/batch\n",
      rr->push_rows_per_s, nolog->push_rows_per_s,
      rr->push_rows_per_s / std::max(1e-12, nolog->push_rows_per_s),
      rr->mean_push_s * 1e3, nolog->mean_push_s * 1e3);
  std::printf(
      "replicated (the default with 2+ nodes) vs push log alone: pushes %.0f "
      "vs %.0f rows/s = %.2fx; push %.2f vs %.2f ms/batch; with the "
      "pipeline the trainer is blocked %.3f vs %.3f ms/batch\n",
      rr->push_rows_per_s, norep->push_rows_per_s,
      rr->push_rows_per_s / std::max(1e-12, norep->push_rows_per_s),
      rr->mean_push_s * 1e3, norep->mean_push_s * 1e3, rr->blocked_on_s * 1e3,
      norep->blocked_on_s * 1e3);
  std::printf(
      "replicated, copy before the answer (--emb-backup-lag 0) vs push log "
      "alone: pushes %.0f vs %.0f rows/s = %.2fx; push %.2f ms/batch\n",
      first->push_rows_per_s, norep->push_rows_per_s,
      first->push_rows_per_s / std::max(1e-12, norep->push_rows_per_s),
      first->mean_push_s * 1e3);
  Status st = report.Finish(o.common, "pulls_per_s",
                            "embedding tiers: pulls per second", false, "case");
  if (!st.ok()) {
    std::fprintf(stderr, "error: %s\n", st.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace membox::bench
