// The `membox` command: one binary, one subcommand per job.
//   membox serve  [--listen H:P] [--pool-size S] [--secret-file F] [--config F]
//   ... membox status --server H:P [--secret-file F] membox bench
//   transfer|memserver|async-sgd [--quick] [--csv F] [--plot F.png] [--json F]
//   membox version
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <unistd.h>

#include "membox/base/config.h"
#include "membox/base/credential.h"
#include "membox/base/logging.h"
#include "membox/base/secret.h"
#include "membox/base/subprocess.h"
#include "membox/embedding/client.h"
#include "membox/embedding/server.h"
#include "membox/memserver/client.h"
#include "membox/memserver/server.h"
#include "membox/node/memory_node.h"
#include "membox/ps/param_client.h"
#include "membox/ps/proxy.h"

#ifdef MEMBOX_WITH_BENCH
#include "bench/allreduce/allreduce_bench.h"
#include "bench/async_sgd/async_sgd_bench.h"
#include "bench/embedding/embedding_bench.h"
#include "bench/memserver/memserver_bench.h"
#include "bench/train/train_bench.h"
#include "bench/transfer/transfer_bench.h"
#endif

namespace {

#ifdef MEMBOX_WITH_BENCH
void AddCommonFlags(CLI::App* cmd, membox::bench::CommonFlags* f) {
  cmd->add_flag("--quick", f->quick, "reduced sweep (under a minute here)");
  cmd->add_option("--csv", f->csv, "write the records as CSV");
  cmd->add_option("--plot", f->plot, "write a PNG plot");
  cmd->add_option("--json", f->json, "write the records as a JSON list");
}
#endif

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

// "auto": the memory server's port + `offset` on the same host (+1 the
// parameter proxy, +2 the embedding server); "off": none.
membox::Result<std::string> ServiceListen(const std::string& ps_listen,
                                          const std::string& listen,
                                          int offset) {
  if (ps_listen != "auto") return ps_listen;
  auto colon = listen.rfind(':');
  if (colon == std::string::npos) {
    return membox::InvalidArgumentError("--listen must be host:port");
  }
  int port = std::atoi(listen.c_str() + colon + 1);
  if (port == 0) return listen.substr(0, colon) + ":0";
  return listen.substr(0, colon) + ":" + std::to_string(port + offset);
}

// The embedding server's flags (`membox serve --emb-*`).
struct EmbeddingFlags {
  std::string listen = "auto", dir, budget = "1GiB", file_size = "64MiB";
  int flush_interval_ms = 10000;
  std::string push_log = "on";
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

// `membox credential issue`: the credential of `name` under the cluster
// secret, written to `out` (created, mode 0600).
int IssueCredential(const std::string& secret_file, const std::string& name,
                    const std::string& rights, const std::string& quota,
                    uint64_t serial, const std::string& out) {
  auto fail = [](const membox::Status& s) {
    std::fprintf(stderr, "membox credential issue: %s\n", s.ToString().c_str());
    return 1;
  };
  auto sec = membox::ResolveSecret("", secret_file);
  if (!sec.ok()) return fail(sec.status());
  if (membox::Credential::Looks(*sec)) {
    return fail(membox::InvalidArgumentError(
        "issuing needs the cluster secret, not a credential"));
  }
  membox::Principal p;
  p.cluster = false;
  p.name = name;
  p.serial = serial;
  auto r = membox::ParseRights(rights);
  if (!r.ok()) return fail(r.status());
  p.rights = *r;
  if (!quota.empty() && quota.back() == '%') {
    auto pct = membox::ParseByteSize(quota.substr(0, quota.size() - 1));
    if (!pct.ok() || *pct == 0 || *pct > 100) {
      return fail(membox::InvalidArgumentError("--quota: 1..100%"));
    }
    p.quota_percent = static_cast<uint32_t>(*pct);
  } else {
    auto b = membox::ParseByteSize(quota);
    if (!b.ok()) return fail(b.status());
    p.quota_bytes = *b;
  }
  auto c = membox::Credential::Issue(*sec, p);
  if (!c.ok()) return fail(c.status());
  int fd = ::open(out.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    return fail(membox::PermissionDeniedError("cannot create '" + out +
                                              "': " + std::strerror(errno)));
  }
  std::string line = c->Encode() + "\n";
  bool ok = ::write(fd, line.data(), line.size()) ==
            static_cast<ssize_t>(line.size());
  ok = ::close(fd) == 0 && ok;
  if (!ok) return fail(membox::InternalError("cannot write '" + out + "'"));
  std::printf("credential for %s written to %s\n", c->principal.label().c_str(),
              out.c_str());
  return 0;
}

int Serve(membox::memserver::ServerOptions o, membox::ps::ProxyOptions po,
          const std::string& ps_listen, const std::string& ps_max,
          const std::string& secret, const std::string& secret_file,
          const std::string& pool, const std::string& min_block,
          const std::string& max_block, const std::string& quota,
          int heartbeat_ms, const EmbeddingFlags& ef,
          const std::string& metrics_listen, bool allow_weak_secret,
          const std::string& revoked_file,
          const std::string& metrics_token_file) {
  auto sec = membox::ResolveSecret(secret, secret_file);
  if (sec.ok() && membox::Credential::Looks(*sec)) {
    std::fprintf(stderr,
                 "membox serve: the secret is a principal's credential; a "
                 "memory node needs the cluster secret itself\n");
    return 2;
  }
  if (sec.ok()) {
    // The file the secret came from (ResolveSecret's order), if any.
    std::string file = secret_file;
    if (!secret.empty()) {
      file.clear();
    } else if (file.empty() &&
               !membox::GetEnv("MEMBOX_SECRET").value_or("").empty()) {
      file.clear();
    } else if (file.empty()) {
      file = membox::GetEnv("MEMBOX_SECRET_FILE").value_or("");
    }
    membox::Status strong = membox::CheckSecretStrength(*sec, file);
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
  for (const membox::Status& st :
       {sec.status(), p.status(), mn.status(), mx.status(), q.status(),
        pm.status(), pl.status(), el.status(), eb.status(), efs.status()}) {
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

// The admin secret of `--admin-secret-file` (empty when not given); false
// after printing why the file cannot be used.
bool ReadAdminSecret(const std::string& file, const char* command,
                     std::string* out) {
  if (file.empty()) return true;
  auto a = membox::ReadSecretFile(file);
  if (!a.ok()) {
    std::fprintf(stderr, "membox %s: %s\n", command,
                 a.status().ToString().c_str());
    return false;
  }
  *out = *a;
  return true;
}

// `membox status`: for each memory node, the memory server's status (this
// client's view, or every client's with the admin secret) and, with
// `services`, the parameter proxy's and the embedding server's at the
// node's default ports (+1, +2), or a line saying they do not answer.
// Exit 1 when a memory server cannot be asked.
int PrintStatus(const std::vector<std::string>& servers,
                const std::string& secret, const std::string& secret_file,
                const std::string& admin_file, bool services) {
  auto sec = membox::ResolveSecret(secret, secret_file);
  std::string admin;
  if (!ReadAdminSecret(admin_file, "status", &admin)) return 2;
  if (!sec.ok()) {
    std::fprintf(stderr, "membox status: %s\n",
                 sec.status().ToString().c_str());
    return 2;
  }
  int rc = 0;
  for (size_t i = 0; i < servers.size(); ++i) {
    const std::string& server = servers[i];
    if (servers.size() > 1 || services) {
      std::printf("%s== node %zu: %s ==\n", i ? "\n" : "", i, server.c_str());
    }
    membox::memserver::ClientOptions o;
    o.server = server;
    o.secret = *sec;
    o.name = "membox-status";
    o.timeout = std::chrono::milliseconds(10000);
    auto c = membox::memserver::Client::Connect(o);
    auto text = c.ok() ? (*c)->ServerStatus(admin)
                       : membox::Result<std::string>(c.status());
    if (!text.ok()) {
      std::fprintf(stderr, "membox status: %s: %s\n", server.c_str(),
                   text.status().ToString().c_str());
      rc = 1;
      continue;
    }
    std::fputs(text->c_str(), stdout);
    if (!services) continue;
    std::fflush(stdout);
    if (auto ps = ServiceListen("auto", server, 1); ps.ok()) {
      auto t = membox::ps::QueryProxyStatus(*ps, *sec,
                                            std::chrono::milliseconds(5000));
      if (t.ok()) {
        std::printf("-- parameter proxy %s --\n%s", ps->c_str(), t->c_str());
      } else {
        std::printf("-- parameter proxy %s: not answering (%s)\n", ps->c_str(),
                    t.status().ToString().c_str());
      }
    }
    if (auto es = ServiceListen("auto", server, 2); es.ok()) {
      membox::embedding::EmbeddingClientOptions eo;
      eo.nodes = {*es};
      eo.secret = *sec;
      eo.name = "membox-status";
      eo.timeout = std::chrono::milliseconds(5000);
      auto ec = membox::embedding::EmbeddingClient::Connect(eo);
      auto t = ec.ok() ? (*ec)->NodeStatus(0)
                       : membox::Result<std::string>(ec.status());
      if (t.ok()) {
        std::printf("-- embedding server %s --\n%s", es->c_str(), t->c_str());
      } else {
        std::printf("-- embedding server %s: not answering (%s)\n", es->c_str(),
                    t.status().ToString().c_str());
      }
    }
    std::fflush(stdout);
  }
  return rc;
}

// `membox launch` is membox/launch.py (Python's subprocess and threads make
// a simpler supervisor than C++ here) and `membox bench gpu` is
// membox/gpu_bench.py (it drives torch): this execs the module with
// MEMBOX_PYTHON (default: the interpreter the extension was built for) and
// this binary as the memory node.
int ExecPythonModule(const std::string& module,
                     const std::vector<std::string>& args) {
  std::string self = membox::SelfExePath();
  // The build tree's binary runs the build tree's package; an installed one
  // (cmake --install, pip install .) the package installed beside it, found
  // by its interpreter without help.
  if (self == MEMBOX_BUILD_TREE_EXE) {
    std::string path = MEMBOX_PYTHON_DIR;
    if (const char* old = std::getenv("PYTHONPATH"); old && *old)
      path += std::string(":") + old;
    setenv("PYTHONPATH", path.c_str(), 1);
  }
  setenv("MEMBOX_BIN", self.c_str(), 1);
  std::string python = MEMBOX_PYTHON_EXECUTABLE;
  if (const char* p = std::getenv("MEMBOX_PYTHON"); p && *p) python = p;
  std::vector<std::string> argv = {python, "-m", module};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> cargv;
  for (auto& a : argv) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  execv(cargv[0], cargv.data());
  std::fprintf(stderr, "membox: cannot run %s: %s\n", python.c_str(),
               std::strerror(errno));
  return 127;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"membox: parameter communication through disaggregated memory"};
  app.require_subcommand(1);
  std::string log_level;
  app.add_option("--log-level", log_level,
                 "trace, debug, info, warn, error, off");

  auto* version = app.add_subcommand("version", "print the version");
  auto* credcmd = app.add_subcommand(
      "credential", "issue or revoke a principal's credential");
  credcmd->require_subcommand(1);
  auto* cred_issue = credcmd->add_subcommand(
      "issue", "write a credential derived from the cluster secret");
  std::string cred_name, cred_rights = "worker", cred_quota = "0", cred_out,
                         cred_secret_file, cred_revoked;
  uint64_t cred_serial = 1;
  cred_issue->add_option("--name", cred_name, "principal (job or tenant)")
      ->required();
  cred_issue->add_option("--rights", cred_rights,
                         "'+'-joined: worker, node, admin (default worker)");
  cred_issue->add_option("--quota", cred_quota,
                         "N% of each node's capacity, a size (4GiB), or 0 "
                         "(the node's default)");
  cred_issue->add_option("--serial", cred_serial,
                         "bump it to rotate (then revoke --below it)");
  cred_issue->add_option("--secret-file", cred_secret_file,
                         "the cluster secret (or MEMBOX_SECRET_FILE)");
  cred_issue->add_option("-o,--output", cred_out, "file to create (0600)")
      ->required();
  auto* cred_revoke = credcmd->add_subcommand(
      "revoke", "add a principal to a node's --revoked-file");
  uint64_t cred_below = 0;
  cred_revoke->add_option("--name", cred_name, "principal")->required();
  cred_revoke->add_option("--below", cred_below,
                          "only serials under this (after a rotation)");
  cred_revoke->add_option("--revoked-file", cred_revoked, "the nodes' file")
      ->required();
  auto* secretcmd = app.add_subcommand(
      "secret", "write a new random cluster secret (256 bits, mode 0600)");
  std::string secret_out;
  secretcmd->add_option("-o,--output", secret_out, "file to create")
      ->required();

  membox::memserver::ServerOptions sopt;
  std::string secret, secret_file, pool = "1GiB", min_block = "4KiB",
                                   max_block = "32GiB", quota = "0";
  int heartbeat_ms = 5000;
  auto* serve = app.add_subcommand("serve", "run a memory node");
  std::string serve_config;
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
  std::string revoked_file;
  serve->add_option("--revoked-file", revoked_file,
                    "revoked credentials, one 'NAME [below SERIAL]' per line; "
                    "re-read when it changes (membox credential revoke)");
  bool allow_weak_secret = false;
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
  int64_t orphan_grace_ms = 60000;
  serve->add_option("--orphan-grace-ms", orphan_grace_ms,
                    "delete a dead master's segments after this long unless "
                    "it comes back (same client name); 0: keep them");
  std::string admin_secret_file;
  serve->add_option("--admin-secret-file", admin_secret_file,
                    "credential for the full `membox status` listing");
  serve->add_option("--quota-segments", sopt.quota_segments,
                    "per-client segments");
  membox::ps::ProxyOptions popt;
  std::string ps_listen = "auto", ps_max = "auto", ps_sched = "per-client";
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
  double hang_report_s = 10;
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
  serve->add_flag("--ps-replicate", popt.replicate,
                  "keep every key on every proxy (no striping), so any one "
                  "node can die without losing a round");
  double failover_s = 60;
  serve
      ->add_option("--ps-failover-s", failover_s,
                   "with --ps-replicate: how long rounds wait for a dead "
                   "peer's replacement before they fail")
      ->check(CLI::Range(0.1, 86400.0));
  serve->add_flag("--join", popt.join,
                  "replace a proxy that died: copy the state from the "
                  "running --ps-peers before serving");
  EmbeddingFlags eflags;
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
  std::string metrics_listen;
  serve->add_option("--metrics-listen", metrics_listen,
                    "serve Prometheus metrics at http://HOST:PORT/metrics "
                    "(off by default)");
  std::string metrics_token_file;
  serve->add_option("--metrics-token-file", metrics_token_file,
                    "scrapes must send 'Authorization: Bearer' with the "
                    "first line of this file");
  bool exit_with_parent = false;
  serve->add_flag("--exit-with-parent", exit_with_parent,
                  "stop when the parent process dies (benchmarks, tests)");

  auto* launch = app.add_subcommand(
      "launch",
      "start memory nodes and workers on this machine: membox launch "
      "[--nodes N] [--workers P] [--checkpoint-dir D] [--resume] -- CMD...");
  launch->prefix_command();  // everything after goes to membox.launch
  launch->allow_extras();
  launch->set_help_flag();  // --help reaches membox.launch (all its options)

  auto* cluster = app.add_subcommand(
      "cluster",
      "an emulated cluster on this machine (root): membox cluster "
      "up|run|exec|status|down TOPOLOGY.toml [-- CMD...]");
  cluster->prefix_command();  // everything after goes to membox.cluster
  cluster->allow_extras();
  cluster->set_help_flag();

  std::vector<std::string> status_servers;
  auto* status = app.add_subcommand(
      "status",
      "print memory nodes' pools, segments, clients (and with --services "
      "their proxies' workers, versions, waiting rounds)");
  status
      ->add_option("--server", status_servers,
                   "memory node(s), host:port[,host:port...] (every node of "
                   "a job)")
      ->delimiter(',')
      ->required();
  bool status_services = false;
  status->add_flag("--services", status_services,
                   "also ask each node's parameter proxy and embedding "
                   "server (default ports: +1, +2)");
  status->add_option("--secret", secret, "authentication secret");
  status->add_option("--secret-file", secret_file,
                     "file whose first line is the secret");
  status->add_option("--admin-secret-file", admin_secret_file,
                     "list every client and segment (the server's admin "
                     "secret); without it, this client's view");

  auto* bench = app.add_subcommand("bench", "run a benchmark");
  bench->require_subcommand(1);
  auto* gpubench = bench->add_subcommand(
      "gpu",
      "CUDA training through membox vs Gloo, and the staging copy rate "
      "(membox/gpu_bench.py; needs a CUDA GPU and torch with CUDA)");
  gpubench->prefix_command();  // everything after goes to membox.gpu_bench
  gpubench->allow_extras();
  gpubench->set_help_flag();  // --help reaches the module
  auto* clbench = bench->add_subcommand(
      "cluster",
      "issue 13 / seed 000 across hosts: PushPull vs MPI and Gloo, 1-4 memory "
      "nodes, emulated training on an emulated cluster (membox/"
      "cluster_bench.py; root)");
  clbench->prefix_command();
  clbench->allow_extras();
  clbench->set_help_flag();
  auto* psbench = bench->add_subcommand(
      "ps",
      "ParameterServer on hundreds of small tensors: one key per tensor vs "
      "fused buckets, against Gloo DDP (membox/ps_bench.py)");
  psbench->prefix_command();
  psbench->allow_extras();
  psbench->set_help_flag();
  auto* ctrbench = bench->add_subcommand(
      "ctr",
      "wide & deep CTR with tables in the embedding store, against torch's "
      "layers and TorchRec in one process (membox/ctr_bench.py)");
  ctrbench->prefix_command();
  ctrbench->allow_extras();
  ctrbench->set_help_flag();
  auto* offbench = bench->add_subcommand(
      "offload",
      "the model's state in the memory nodes (membox.torch.offload) against "
      "DDP and FSDP2: resident bytes per parameter, step time, largest batch "
      "under a memory budget (membox/offload_bench.py)");
  offbench->prefix_command();
  offbench->allow_extras();
  offbench->set_help_flag();
#ifdef MEMBOX_WITH_BENCH
  membox::bench::TransferOptions topt;
  std::string min_size = "1KiB", max_size = "1GiB";
  auto* transfer = bench->add_subcommand(
      "transfer",
      "seed 002 Fig. 8: tensor send/receive, membox vs gRPC vs memcpy");
  AddCommonFlags(transfer, &topt.common);
  transfer->add_option("--min-size", min_size,
                       "smallest tensor (default 1KiB)");
  transfer->add_option("--max-size", max_size, "largest tensor (default 1GiB)");
  bool no_grpc = false, no_iperf = false;
  transfer->add_flag("--no-grpc", no_grpc, "skip the gRPC baseline");
  transfer->add_flag("--no-iperf", no_iperf, "skip the iperf3 reference");
  transfer->add_flag("--rtt-only", topt.rtt_only,
                     "only the service layer's request/reply round trips");

  membox::bench::MemserverBenchOptions mopt;
  auto* msbench = bench->add_subcommand(
      "memserver",
      "seed 003 Fig. 5: memory-node bandwidth with 2..32 client processes");
  AddCommonFlags(msbench, &mopt.common);
  msbench->add_option("--transports", mopt.transports,
                      "UCX transports: auto or tcp");

  membox::bench::AsyncSgdOptions aopt;
  auto* sgd = bench->add_subcommand("async-sgd",
                                    "seed 003 Figs. 6-9: asynchronous SGD "
                                    "emulation, membox vs an MPI server");
  AddCommonFlags(sgd, &aopt.common);
  sgd->add_option("--workers", aopt.workers,
                  "worker counts (default 2,4,6,8,12,18,24,32)")
      ->delimiter(',');
  sgd->add_option("--iterations", aopt.iterations,
                  "measured iterations per run");
  sgd->add_option("--models", aopt.models,
                  "models of seed 003 Table 2 (default: all six; --quick: "
                  "inception_v1,vgg16)")
      ->delimiter(',');

  membox::bench::AllreduceOptions ropt;
  auto* arbench = bench->add_subcommand(
      "allreduce",
      "PushPull (sum across p workers) vs MPI_Allreduce vs Gloo, with the "
      "p n / all-core streaming copy bound");
  AddCommonFlags(arbench, &ropt.common);
  arbench->add_option("--workers", ropt.workers, "worker counts (2,4,8)")
      ->delimiter(',');
  arbench->add_option("--nodes", ropt.nodes, "memory-node counts (1,2)")
      ->delimiter(',');
  arbench->add_option("--sizes", ropt.sizes, "tensor bytes (4KiB..512MiB)")
      ->delimiter(',');
  arbench->add_option("--iterations", ropt.iterations,
                      "iterations per size (default by size)");
  arbench->add_option("--partition-bytes", ropt.partition_bytes,
                      "shard size S' (default 4 MiB)");
  int ar_repeats = 0;
  arbench->add_option("--repeats", ar_repeats,
                      "every variant N times, interleaved; medians and "
                      "spread recorded (default 3, quick 1)");
  bool no_gloo = false;
  arbench->add_flag("--no-gloo", no_gloo, "skip the Gloo baseline");

  membox::bench::TrainOptions tropt;
  auto* trbench = bench->add_subcommand(
      "train",
      "seed 000 Figs. 16-17: emulated data-parallel training, membox vs "
      "DENSE, MPI and Gloo AllReduce, with ablations");
  AddCommonFlags(trbench, &tropt.common);
  trbench->add_option("--models", tropt.models, "resnet50,vgg16,bert-large")
      ->delimiter(',');
  trbench->add_option("--workers", tropt.workers, "workers (default 4)");
  trbench->add_option("--iterations", tropt.iterations,
                      "iterations per run, the first a warm-up");
  trbench->add_option("--compute-scale", tropt.compute_scale,
                      "multiply the models' compute times");
  bool tr_no_gloo = false;
  trbench->add_flag("--no-gloo", tr_no_gloo, "skip the Gloo baseline");

  membox::bench::CollectiveBenchOptions copt;
  auto* colbench = bench->add_subcommand(
      "collective",
      "seed 004 C.3: hierarchical AllReduce vs the ring between workers");
  AddCommonFlags(colbench, &copt.common);
  colbench->add_option("--workers", copt.workers, "worker processes (8)");
  colbench->add_option("--local", copt.local, "workers per node (2)");

  membox::bench::EmbeddingBenchOptions eopt;
  auto* embench = bench->add_subcommand(
      "embedding",
      "seed 004: sparse store tiers on a Zipf stream, membox SSD tier vs "
      "RocksDB, prefetch on vs off");
  AddCommonFlags(embench, &eopt.common);
  embench->add_option("--keys", eopt.keys, "table rows (default 10^7)");
  embench->add_option("--steps", eopt.steps, "batches");
  embench->add_option("--batch", eopt.batch, "lookups per batch");
  embench->add_option("--dir", eopt.dir, "where the SSD tier's files go");
  embench->add_option("--budget-fraction", eopt.budget_fraction,
                      "memory budget / table size (default 0.02)");

  auto* peer = app.add_subcommand(
      "bench-peer", "internal: the receiving side of a benchmark");
  peer->group("");  // hidden
  std::string peer_bench, peer_mode;
  peer->add_option("bench", peer_bench)->required();
  peer->add_option("mode", peer_mode)->required();
  std::vector<std::string> peer_args;
  peer->add_option("args", peer_args);
#endif

  CLI11_PARSE(app, argc, argv);
  membox::InitLogging("membox");
  if (!log_level.empty()) membox::SetLogLevel(log_level);

  if (version->parsed()) {
    std::printf("membox 0.1.0\n");
    return 0;
  }
  if (cred_issue->parsed()) {
    return IssueCredential(cred_secret_file, cred_name, cred_rights, cred_quota,
                           cred_serial, cred_out);
  }
  if (cred_revoke->parsed()) {
    membox::Status st =
        membox::RevocationList::Append(cred_revoked, cred_name, cred_below);
    if (!st.ok()) {
      std::fprintf(stderr, "membox credential revoke: %s\n",
                   st.ToString().c_str());
      return 1;
    }
    return 0;
  }
  if (secretcmd->parsed()) {
    membox::Status st = membox::WriteNewSecretFile(secret_out);
    if (!st.ok()) {
      std::fprintf(stderr, "membox secret: %s\n", st.ToString().c_str());
      return 1;
    }
    return 0;
  }
  if (serve->parsed()) {
    if (exit_with_parent) prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (!serve_config.empty()) {
      membox::Status st = ApplyConfigFile(serve, serve_config);
      if (!st.ok()) {
        std::fprintf(stderr, "membox serve: %s\n", st.ToString().c_str());
        return 2;
      }
    }
    membox::InitLogging("serve");
    if (!log_level.empty()) membox::SetLogLevel(log_level);
    popt.scheduler = ps_sched == "fcfs"
                         ? membox::ps::Scheduler::kFirstComeFirstServe
                         : membox::ps::Scheduler::kPerClientQueues;
    popt.transports = sopt.transports;
    popt.hang_report =
        std::chrono::milliseconds(static_cast<int64_t>(hang_report_s * 1000));
    popt.failover_timeout =
        std::chrono::milliseconds(static_cast<int64_t>(failover_s * 1000));
    sopt.orphan_grace = std::chrono::milliseconds(orphan_grace_ms);
    if (!ReadAdminSecret(admin_secret_file, "serve", &sopt.admin_secret)) {
      return 2;
    }
    return Serve(sopt, popt, ps_listen, ps_max, secret, secret_file, pool,
                 min_block, max_block, quota, heartbeat_ms, eflags,
                 metrics_listen, allow_weak_secret, revoked_file,
                 metrics_token_file);
  }
  if (status->parsed()) {
    return PrintStatus(status_servers, secret, secret_file, admin_secret_file,
                       status_services);
  }
  if (launch->parsed()) {
    std::vector<std::string> args = {"--membox", membox::SelfExePath()};
    for (const auto& a : launch->remaining()) args.push_back(a);
    return ExecPythonModule("membox.launch", args);
  }
  if (cluster->parsed()) {
    return ExecPythonModule("membox.cluster", cluster->remaining());
  }
  if (clbench->parsed()) {
    return ExecPythonModule("membox.cluster_bench", clbench->remaining());
  }
  if (gpubench->parsed()) {
    return ExecPythonModule("membox.gpu_bench", gpubench->remaining());
  }
  if (psbench->parsed()) {
    return ExecPythonModule("membox.ps_bench", psbench->remaining());
  }
  if (ctrbench->parsed()) {
    return ExecPythonModule("membox.ctr_bench", ctrbench->remaining());
  }
  if (offbench->parsed()) {
    return ExecPythonModule("membox.offload_bench", offbench->remaining());
  }
#ifdef MEMBOX_WITH_BENCH
  if (transfer->parsed()) {
    auto mn = membox::ParseByteSize(min_size);
    auto mx = membox::ParseByteSize(max_size);
    if (!mn.ok() || !mx.ok() || *mn == 0 || *mn > *mx) {
      std::fprintf(stderr, "error: bad --min-size/--max-size\n");
      return 2;
    }
    topt.min_size = *mn;
    topt.max_size = *mx;
    topt.with_grpc = !no_grpc;
    topt.with_iperf = !no_iperf;
    return membox::bench::RunTransferBench(topt);
  }
  if (msbench->parsed()) return membox::bench::RunMemserverBench(mopt);
  if (sgd->parsed()) return membox::bench::RunAsyncSgdBench(aopt);
  if (embench->parsed()) return membox::bench::RunEmbeddingBench(eopt);
  if (colbench->parsed()) return membox::bench::RunCollectiveBench(copt);
  if (trbench->parsed()) {
    tropt.with_gloo = !tr_no_gloo;
    return membox::bench::RunTrainBench(tropt);
  }
  if (arbench->parsed()) {
    ropt.with_gloo = !no_gloo;
    ropt.repeats = ar_repeats > 0 ? ar_repeats : (ropt.common.quick ? 1 : 3);
    return membox::bench::RunAllreduceBench(ropt);
  }
  if (peer->parsed()) {
    if (peer_bench == "transfer")
      return membox::bench::RunTransferPeer(peer_mode);
    if (peer_bench == "async-sgd") {
      std::vector<std::string> args = {peer_mode};
      args.insert(args.end(), peer_args.begin(), peer_args.end());
      return membox::bench::RunAsyncSgdWorker(args);
    }
    if (peer_bench == "train") return membox::bench::RunTrainWorker(peer_args);
    if (peer_bench == "collective") {
      return membox::bench::RunCollectiveWorker(peer_args);
    }
    if (peer_bench == "allreduce") {
      return membox::bench::RunAllreduceWorker(peer_args);
    }
    if (peer_bench == "memserver") {
      std::vector<std::string> args = {peer_mode};
      args.insert(args.end(), peer_args.begin(), peer_args.end());
      return membox::bench::RunMemserverPeer(args);
    }
    std::fprintf(stderr, "error: unknown benchmark '%s'\n", peer_bench.c_str());
    return 2;
  }
#endif
  return 0;
}
