// `membox serve`: a memory node -- the memory server, and on its port + 1
// the parameter proxy, on + 2 the embedding server (--emb-dir), with
// Prometheus metrics where asked.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>

#include "membox/base/config.h"
#include "membox/base/credential.h"
#include "membox/base/environment.h"
#include "membox/base/logging.h"
#include "membox/base/secret.h"
#include "membox/embedding/server.h"
#include "membox/memserver/server.h"
#include "membox/node/memory_node.h"
#include "membox/ps/proxy.h"
#include "membox/ps/standby.h"
#include "membox/transport/huge_pages.h"

#include "tools/commands.h"

namespace membox::tools {
namespace {

// Applies a base::ConfigFile to the options of `cmd` that the command line
// did not set. Unknown keys are errors, so a typo never goes unnoticed.
membox::Status ApplyConfigFile(CLI::App* cmd, const std::string& path) {
  auto cfg = membox::ConfigFile::Load(path);
  if (!cfg.ok()) return cfg.status();
  for (const auto& [key, value] : cfg->entries()) {
    CLI::Option* opt = cmd->get_option_no_throw("--" + key);
    if (opt == nullptr || key == "config") {
      return membox::InvalidArgumentError(path + ": unknown setting '" + key +
                                          "'");
    }
    if (opt->count() > 0) continue;  // the command line wins
    try {
      opt->add_result(opt->get_items_expected_max() == 0
                          ? (value == "true" ? "1" : "0")
                          : value);
      opt->run_callback();
    } catch (const CLI::Error& e) {
      return membox::InvalidArgumentError(path + ": bad value for '" + key +
                                          "': " + e.what());
    }
  }
  return membox::Status::Ok();
}

// The embedding server's flags (`membox serve --emb-*`).
struct EmbeddingFlags {
  std::string listen = "auto", dir, budget = "1GiB", file_size = "64MiB";
  int flush_interval_ms = 10000;
  std::string push_log = "on";
  std::string backup, name, backup_lag = "32MiB";
  std::vector<std::string> peers;
};

// Half of MemTotal (/proc/meminfo): the default parameter storage limit.
membox::Result<uint64_t> AutoPsMaxBytes() {
  std::ifstream in("/proc/meminfo");
  std::string key, unit;
  uint64_t kib = 0;
  while (in >> key >> kib >> unit) {
    if (key == "MemTotal:") return kib * 1024 / 2;
  }
  return membox::NotFoundError(
      "--ps-max-bytes auto: no MemTotal in /proc/meminfo; give a size");
}

int Serve(membox::memserver::ServerOptions o, membox::ps::ProxyOptions po,
          const std::string& ps_listen, const std::string& ps_max,
          const std::string& secret, const std::string& secret_file,
          const std::string& pool, const std::string& min_block,
          const std::string& max_block, const std::string& quota,
          int heartbeat_ms, const EmbeddingFlags& ef,
          const std::string& metrics_listen, bool allow_weak_secret,
          const std::string& revoked_file,
          const std::string& metrics_token_file, bool standby) {
  auto choice = membox::ResolveSecretOrEnvironment(secret, secret_file);
  membox::Result<std::string> sec =
      choice.ok() ? membox::Result<std::string>(choice->secret)
                  : membox::Result<std::string>(choice.status());
  if (sec.ok() && membox::Credential::Looks(*sec)) {
    std::fprintf(stderr,
                 "membox serve: the secret is a principal's credential; a "
                 "memory node needs the cluster secret itself\n");
    return 2;
  }
  if (sec.ok()) {
    membox::Status strong = membox::CheckSecretStrength(*sec, choice->file);
    if (!strong.ok()) {
      if (!allow_weak_secret) {
        std::fprintf(stderr, "membox serve: %s\n", strong.ToString().c_str());
        return 2;
      }
      std::fprintf(stderr, "membox serve: warning: %s\n",
                   strong.ToString().c_str());
    }
  }
  auto p = membox::ParseByteSize(pool);
  auto mn = membox::ParseByteSize(min_block);
  auto mx = membox::ParseByteSize(max_block);
  auto q = membox::ParseByteSize(quota);
  // "auto": half of this machine's memory (/proc/meminfo), so by default no
  // job can make the node hold more parameter and optimizer state than the
  // machine has; a credential's quota is a share of it.
  auto pm = ps_max == "auto" ? AutoPsMaxBytes() : membox::ParseByteSize(ps_max);
  auto pl = ServiceListen(ps_listen, o.listen, 1);
  auto el = ServiceListen(ef.listen, o.listen, 2);
  auto eb = membox::ParseByteSize(ef.budget);
  auto efs = membox::ParseByteSize(ef.file_size);
  auto elag = membox::ParseByteSize(ef.backup_lag);
  for (const membox::Status& st :
       {sec.status(), p.status(), mn.status(), mx.status(), q.status(),
        pm.status(), pl.status(), el.status(), eb.status(), efs.status(),
        elag.status()}) {
    if (!st.ok()) {
      std::fprintf(stderr, "membox serve: %s\n", st.ToString().c_str());
      return 2;
    }
  }
  o.secret = *sec;
  o.pool_bytes = *p;
  o.min_block = *mn;
  o.max_block = *mx;
  o.quota_bytes = *q;
  o.heartbeat_timeout = std::chrono::milliseconds(heartbeat_ms);
  // Authenticated clients each hold a connection; let the daemon use every
  // descriptor it is allowed (the handshake cap bounds unauthenticated ones).
  rlimit nofile{};
  if (getrlimit(RLIMIT_NOFILE, &nofile) == 0 &&
      nofile.rlim_cur < nofile.rlim_max) {
    nofile.rlim_cur = nofile.rlim_max;
    setrlimit(RLIMIT_NOFILE, &nofile);
  }
  // Block the stop signals before any thread starts, then wait for them here.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  membox::node::MemoryNodeOptions no;
  no.secret = *sec;
  no.transports = o.transports;
  if (!revoked_file.empty()) {
    auto rl = std::make_shared<membox::RevocationList>(revoked_file);
    membox::Status st = rl->Load();
    if (!st.ok()) {
      std::fprintf(stderr, "membox serve: %s\n", st.ToString().c_str());
      return 2;
    }
    no.admit = [rl](const membox::Principal& p) { return rl->Admit(p); };
  }
  no.memory = o;
  if (standby) {
    // Hold nothing until a node of the job dies; then be its replacement.
    if (*pl == "off") {
      std::fprintf(stderr, "membox serve: --standby needs --ps-listen\n");
      return 2;
    }
    membox::ps::StandbyOptions so;
    so.peers = po.peers;
    so.endpoint = *pl;
    so.secret = *sec;
    so.transports = o.transports;
    so.stop = [&set] {
      timespec now{0, 0};
      return sigtimedwait(&set, nullptr, &now) > 0;
    };
    auto place = membox::ps::AwaitVacancy(so);
    if (!place.ok()) {
      if (place.status().code() == membox::StatusCode::kCancelled) return 0;
      std::fprintf(stderr, "membox serve: %s\n",
                   place.status().ToString().c_str());
      return 1;
    }
    po.rank = *place;
    po.peers[*place] = *pl;
    po.join = true;
    po.replicate = true;
  }
  if (*pl != "off") {
    po.listen = *pl;
    po.sync_cores = o.sync_cores;
    po.max_bytes = *pm;
    no.proxy = po;
  }
  if (!ef.dir.empty() && *el != "off") {
    membox::embedding::EmbeddingServerOptions eo;
    eo.listen = *el;
    eo.dir = ef.dir;
    eo.budget_bytes = *eb;
    eo.file_bytes = *efs;
    eo.flush_interval = std::chrono::milliseconds(ef.flush_interval_ms);
    eo.push_log = ef.push_log == "on";
    std::string backup = ef.backup;
    if (!ef.peers.empty()) {
      if (po.rank >= ef.peers.size()) {
        std::fprintf(stderr,
                     "membox serve: --ps-rank %u is not a place among the %zu "
                     "--emb-peers\n",
                     po.rank, ef.peers.size());
        return 2;
      }
      eo.peers = ef.peers;
      eo.place = static_cast<uint32_t>(po.rank);
      // The next node keeps this one's copy, as `membox launch` sets it.
      if (backup.empty() && ef.peers.size() > 1) {
        backup = ef.peers[(eo.place + 1) % ef.peers.size()];
      }
    }
    if (!backup.empty() && backup != "off") {
      eo.backup = backup;
      eo.backup_lag_bytes = *elag;
      // The backup files this node's rows under a name that outlives its
      // address: its place in the job (a replacement takes the same).
      eo.name = !ef.name.empty() ? ef.name : "node-" + std::to_string(po.rank);
    }
    no.embedding = eo;
  }
  no.metrics_listen = metrics_listen;
  if (!metrics_token_file.empty()) {
    auto t = membox::ReadSecretFile(metrics_token_file);
    if (!t.ok()) {
      std::fprintf(stderr, "membox serve: --metrics-token-file: %s\n",
                   t.status().ToString().c_str());
      return 2;
    }
    no.metrics_token = *t;
  }
  auto node = membox::node::MemoryNode::Start(no);
  if (!node.ok()) {
    std::fprintf(stderr, "membox serve: %s\n",
                 node.status().ToString().c_str());
    return 1;
  }
  std::printf("membox serve: listening on %s\n",
              (*node)->memory().endpoint().c_str());
  // A replacement's copy (and every fresh buffer) faults its memory in
  // 4 KiB pages without them: about twice the failover pause at 1 GiB.
  if (const std::string hp = membox::transport::ShmemHugePagePolicy();
      hp == "never" || hp == "deny") {
    MEMBOX_LOG_INFO(
        "shared-memory huge pages are off (shmem_enabled is {}): a "
        "replacement node copies its state in 4 KiB pages, about twice the "
        "failover pause at 1 GiB; as root, `echo advise > "
        "/sys/kernel/mm/transparent_hugepage/shmem_enabled` gives membox's "
        "nodes 2 MiB pages and nothing else (docs/results/failures.md)",
        hp);
  }
  if ((*node)->proxy()) {
    std::printf("membox serve: parameter proxy on %s\n",
                (*node)->proxy()->endpoint().c_str());
  }
  if ((*node)->embedding()) {
    std::printf("membox serve: embedding server on %s\n",
                (*node)->embedding()->endpoint().c_str());
  }
  if (!(*node)->metrics_endpoint().empty()) {
    std::printf("membox serve: metrics on http://%s/metrics\n",
                (*node)->metrics_endpoint().c_str());
  }
  std::fflush(stdout);
  int sig = 0;
  sigwait(&set, &sig);
  MEMBOX_LOG_INFO("received {}, shutting down",
                  sig == SIGTERM ? "SIGTERM" : "SIGINT");
  (*node)->Stop();  // the embedding server's flush makes updates durable
  return 0;
}

// Every flag of `membox serve`, in the order ServeFlags' binding lists
// them (AddServeCommand).
struct ServeFlags {
  memserver::ServerOptions sopt;
  std::string secret, secret_file, pool = "1GiB", min_block = "4KiB",
                                   max_block = "32GiB", quota = "0";
  int heartbeat_ms = 5000;
  std::string serve_config, revoked_file;
  bool allow_weak_secret = false;
  int64_t orphan_grace_ms = 60000;
  std::string admin_secret_file;
  ps::ProxyOptions popt;
  std::string ps_listen = "auto", ps_max = "auto", ps_sched = "per-client";
  double hang_report_s = 10, failover_s = 60;
  EmbeddingFlags eflags;
  std::string metrics_listen, metrics_token_file;
  bool exit_with_parent = false;
  std::string ps_replicate = "on";
  bool standby = false;
};

}  // namespace

Commands AddServeCommand(CLI::App* app, const std::string* log_level) {
  auto f = std::make_shared<ServeFlags>();
  auto& [sopt, secret, secret_file, pool, min_block, max_block, quota,
         heartbeat_ms, serve_config, revoked_file, allow_weak_secret,
         orphan_grace_ms, admin_secret_file, popt, ps_listen, ps_max, ps_sched,
         hang_report_s, failover_s, eflags, metrics_listen, metrics_token_file,
         exit_with_parent, ps_replicate, standby] = *f;
  auto* serve = app->add_subcommand("serve", "run a memory node");
  serve->add_option("--config", serve_config,
                    "file of 'key = value' lines named like the long flags "
                    "(pool-size = 4GiB); flags on the command line win");
  serve->add_option("--listen", sopt.listen,
                    "address to listen on (host:port)");
  serve->add_option("--transports", sopt.transports,
                    "UCX transports: auto, tcp, ...");
  serve->add_option("--pool-size", pool, "memory pool (e.g. 4GiB)");
  serve->add_option("--min-block", min_block,
                    "smallest buddy block (power of two)");
  serve->add_option("--max-block", max_block,
                    "largest buddy block (power of two)");
  serve->add_option("--secret", secret,
                    "authentication secret (prefer --secret-file)");
  serve->add_option("--secret-file", secret_file,
                    "file whose first line is the secret");
  serve->add_option("--revoked-file", revoked_file,
                    "revoked credentials, one 'NAME [below SERIAL]' per line; "
                    "re-read when it changes (membox credential revoke)");
  serve->add_flag("--allow-weak-secret", allow_weak_secret,
                  "accept a secret under 32 bytes or a secret file that "
                  "group or others may read (tests only)");
  serve->add_option("--sync-cores", sopt.sync_cores,
                    "threads that run accumulates");
  serve->add_option("--handler-threads", sopt.handler_threads,
                    "request handler threads");
  serve->add_option("--heartbeat-timeout-ms", heartbeat_ms,
                    "release clients silent this long");
  serve->add_flag("--release-master-segments", sopt.release_master_segments,
                  "delete the segments of a client that disconnects");
  serve->add_option("--quota-bytes", quota,
                    "per-client bytes of created segments (0: half the pool)");
  serve->add_option("--orphan-grace-ms", orphan_grace_ms,
                    "delete a dead master's segments after this long unless "
                    "it comes back (same client name); 0: keep them");
  serve->add_option("--admin-secret-file", admin_secret_file,
                    "credential for the full `membox status` listing");
  serve->add_option("--quota-segments", sopt.quota_segments,
                    "per-client segments");
  serve->add_option("--ps-listen", ps_listen,
                    "parameter proxy address (auto: --listen port + 1; off)");
  serve
      ->add_option("--ps-peers", popt.peers,
                   "every proxy endpoint in ring order, this one included")
      ->delimiter(',');
  serve->add_option("--ps-rank", popt.rank, "this proxy's index in --ps-peers");
  serve
      ->add_option("--ps-scheduler", ps_sched,
                   "per-client (default) or fcfs (deadlocks; for tests)")
      ->check(CLI::IsMember({"per-client", "fcfs"}));
  serve->add_option("--ps-max-bytes", ps_max,
                    "parameter storage limit (values and optimizer state); "
                    "auto: half of this machine's memory");
  serve
      ->add_option("--ps-read-window", popt.read_window_shards,
                   "shards of a striped key one worker's reads may run ahead "
                   "of the oldest one waiting for its sum (0: no limit)")
      ->check(CLI::Range(0, 1 << 20));
  serve
      ->add_option("--hang-report-s", hang_report_s,
                   "log a round waiting longer than this, with who it waits "
                   "for (0: never)")
      ->check(CLI::Range(0.0, 86400.0));
  serve->add_option("--checkpoint-dir", popt.checkpoint_dir,
                    "where parameter checkpoints are written");
  serve->add_flag("--restore", popt.restore,
                  "load the checkpoint (--restore-name) on start");
  serve->add_option("--restore-name", popt.restore_name,
                    "checkpoint file name (default latest.mbck)");
  serve
      ->add_option("--ps-replicate", ps_replicate,
                   "on (the default with --ps-peers): every shard is on two "
                   "nodes (a striped key's owner copies each round's result "
                   "to a backup before answering; other keys are on every "
                   "node), so any one node can die without losing a round; "
                   "off: one copy (a node's death ends the job) -- it saves "
                   "the backup's memory and copy, measured 1.5-1.9x faster "
                   "syncs on 400 Mbit/s links (docs/results/failures.md)")
      ->expected(0, 1)
      ->default_str("on")
      ->check(CLI::IsMember({"on", "off"}));
  serve
      ->add_option("--ps-failover-s", failover_s,
                   "with replication: how long rounds wait for a dead "
                   "peer's replacement before they fail")
      ->check(CLI::Range(0.1, 86400.0));
  serve->add_flag("--join", popt.join,
                  "replace a proxy that died: copy the state from the "
                  "running --ps-peers (it serves while it copies)");
  serve
      ->add_option("--ps-join-copy-threads", popt.join_copy_threads,
                   "with --join or --standby: threads that copy the state "
                   "side by side (0: --sync-cores). On one host each is a "
                   "core faulting fresh pages in (1 GiB paused 1.6 s with "
                   "1, 0.7 s with 2); they compete with the survivors' "
                   "rounds for the cores, and across hosts the link, not "
                   "the threads, bounds the copy")
      ->envname("MEMBOX_PS_JOIN_COPY_THREADS")
      ->check(CLI::Range(0, 256));
  serve->add_flag("--standby", standby,
                  "wait, holding nothing, for one of the job's nodes "
                  "(--ps-peers, this one not among them) to die, then take "
                  "its place at --ps-listen (which must be the address the "
                  "others reach; --ps-rank is ignored)");
  serve->add_option("--emb-dir", eflags.dir,
                    "run the embedding server; its tables live here");
  serve->add_option("--emb-listen", eflags.listen,
                    "embedding server address (auto: --listen port + 2; off)");
  serve->add_option("--emb-budget", eflags.budget,
                    "memory tier of each embedding table (e.g. 2GiB)");
  serve->add_option("--emb-file-size", eflags.file_size,
                    "size of the SSD tier's parameter files");
  serve->add_option("--emb-flush-interval-ms", eflags.flush_interval_ms,
                    "write and sync changed rows this often (0: on request)");
  serve
      ->add_option("--emb-push-log", eflags.push_log,
                   "on (default): a push is durable when acknowledged (logged "
                   "and synced before the reply); off: after the next flush")
      ->check(CLI::IsMember({"on", "off"}));
  serve->add_option(
      "--emb-backup", eflags.backup,
      "another node's embedding server (host:port) that keeps a copy of "
      "every row this one acknowledges (the copy may lag the answer by "
      "--emb-backup-lag; the clients keep what it does not hold yet). A "
      "node started with no table of its own in --emb-dir (a lost disk) "
      "first takes back what its backup holds, and its clients resend "
      "the rest. off: none (`membox launch` and `membox cluster` name the "
      "next node by default)");
  serve->add_option("--emb-backup-lag", eflags.backup_lag,
                    "bytes of copies the backup may lag behind the answers "
                    "(default 32MiB); past it a push is answered once the "
                    "backup holds its rows. 0: always then");
  serve
      ->add_option(
          "--emb-peers", eflags.peers,
          "every embedding endpoint of the job in --ps-rank order, this "
          "one's included (for a --standby: the place it takes): the node "
          "tells the others where it listens when that is not its entry (a "
          "replacement on another host), answers clients asking where a "
          "node went, and its clients check its place; with two or more, "
          "--emb-backup defaults to the next one (`membox cluster` passes "
          "them)")
      ->delimiter(',');
  serve->add_option("--emb-name", eflags.name,
                    "how the backup files this node's rows (default: "
                    "node-<--ps-rank>)");
  serve->add_option("--metrics-listen", metrics_listen,
                    "serve Prometheus metrics at http://HOST:PORT/metrics "
                    "(off by default)");
  serve->add_option("--metrics-token-file", metrics_token_file,
                    "scrapes must send 'Authorization: Bearer' with the "
                    "first line of this file");
  serve->add_flag("--exit-with-parent", exit_with_parent,
                  "stop when the parent process dies (benchmarks, tests)");
  return {
      {serve, [f, serve, log_level] {
         auto& [sopt, secret, secret_file, pool, min_block, max_block, quota,
                heartbeat_ms, serve_config, revoked_file, allow_weak_secret,
                orphan_grace_ms, admin_secret_file, popt, ps_listen, ps_max,
                ps_sched, hang_report_s, failover_s, eflags, metrics_listen,
                metrics_token_file, exit_with_parent, ps_replicate, standby] =
             *f;
         if (exit_with_parent) prctl(PR_SET_PDEATHSIG, SIGTERM);
         if (!serve_config.empty()) {
           membox::Status st = ApplyConfigFile(serve, serve_config);
           if (!st.ok()) {
             std::fprintf(stderr, "membox serve: %s\n", st.ToString().c_str());
             return 2;
           }
         }
         membox::InitLogging("serve");
         membox::ApplyProcessEnvironment();
         if (!log_level->empty()) {
           if (membox::Status s = membox::SetLogLevel(*log_level); !s.ok()) {
             std::fprintf(stderr, "membox serve: --log-level: %s\n",
                          s.ToString().c_str());
             return 2;
           }
         }
         popt.scheduler = ps_sched == "fcfs"
                              ? membox::ps::Scheduler::kFirstComeFirstServe
                              : membox::ps::Scheduler::kPerClientQueues;
         popt.transports = sopt.transports;
         popt.hang_report = std::chrono::milliseconds(
             static_cast<int64_t>(hang_report_s * 1000));
         popt.failover_timeout =
             std::chrono::milliseconds(static_cast<int64_t>(failover_s * 1000));
         // A bare --ps-replicate (older scripts) means on.
         popt.replicate = ps_replicate != "off" && popt.peers.size() > 1;
         sopt.orphan_grace = std::chrono::milliseconds(orphan_grace_ms);
         if (!ReadAdminSecret(admin_secret_file, "serve", &sopt.admin_secret)) {
           return 2;
         }
         if (standby && (popt.join || popt.restore)) {
           std::fprintf(stderr,
                        "membox serve: --standby joins when a node dies; "
                        "it takes neither --join nor --restore\n");
           return 2;
         }
         return Serve(sopt, popt, ps_listen, ps_max, secret, secret_file, pool,
                      min_block, max_block, quota, heartbeat_ms, eflags,
                      metrics_listen, allow_weak_secret, revoked_file,
                      metrics_token_file, standby);
       }}};
}

}  // namespace membox::tools
