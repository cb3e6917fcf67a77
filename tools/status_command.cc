// `membox status`: what memory nodes (and their services) say about
// themselves.
#include <chrono>
#include <cstdio>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>

#include "membox/base/environment.h"
#include "membox/embedding/client.h"
#include "membox/memserver/client.h"
#include "membox/ps/param_client.h"

#include "tools/commands.h"

namespace membox::tools {
namespace {

// The services a node's memory server names in its status text ("service
// NAME ENDPOINT" lines; memserver::Server::SetServices), each "host:port"
// (empty: the node runs none). An endpoint bound to every address
// (0.0.0.0, [::]) is reached at the host `server` was reached at.
struct NodeServices {
  bool known = false;  // a "services" line: the node has started them all
  std::string proxy;
  std::string embedding;
};

NodeServices ServicesIn(const std::string& status, const std::string& server) {
  NodeServices out;
  std::istringstream lines(status);
  std::string line;
  while (std::getline(lines, line)) {
    std::istringstream words(line);
    std::string tag, name, at;
    if (words >> tag && tag == "services") out.known = true;
    if (!(words >> name >> at) || tag != "service") continue;
    const size_t colon = at.rfind(':');
    if (colon == std::string::npos) continue;
    const std::string host = at.substr(0, colon);
    if (host == "0.0.0.0" || host == "[::]" || host == "::") {
      const size_t sc = server.rfind(':');
      at = server.substr(0, sc) + at.substr(colon);
    }
    if (name == "parameter_proxy") out.proxy = at;
    if (name == "embedding_server") out.embedding = at;
  }
  return out;
}

// `membox status`: for each memory node, the memory server's status (this
// client's view, or every client's with the admin secret) and, with
// `services`, those of the parameter proxy and the embedding server the
// node names (a line "none" for a service the node does not run). Exit 1
// when a memory server, or a service it names, cannot be asked. `wait`: a node
// that does not answer yet is asked again every 200 ms until `wait_s` seconds
// have passed (a script starting nodes waits for them to be ready).
int PrintStatus(const std::vector<std::string>& servers,
                const std::string& secret, const std::string& secret_file,
                const std::string& admin_file, bool services, bool wait,
                double wait_s) {
  auto choice = membox::ResolveSecretOrEnvironment(secret, secret_file);
  membox::Result<std::string> sec =
      choice.ok() ? membox::Result<std::string>(choice->secret)
                  : membox::Result<std::string>(choice.status());
  std::string admin;
  if (!ReadAdminSecret(admin_file, "status", &admin)) return 2;
  if (!sec.ok()) {
    std::fprintf(stderr, "membox status: %s\n",
                 sec.status().ToString().c_str());
    return 2;
  }
  int rc = 0;
  const auto deadline =
      std::chrono::steady_clock::now() +
      std::chrono::duration_cast<std::chrono::steady_clock::duration>(
          std::chrono::duration<double>(wait ? wait_s : 0.0));
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
    auto ask = [&]() -> membox::Result<std::string> {
      auto c = membox::memserver::Client::Connect(o);
      return c.ok() ? (*c)->ServerStatus(admin)
                    : membox::Result<std::string>(c.status());
    };
    // Not ready: the memory server does not answer yet, or (with
    // `services`) the node has not started its services yet.
    auto starting = [&](const membox::Result<std::string>& t) {
      return t.ok() ? services && !ServicesIn(*t, server).known
                    : t.status().code() == membox::StatusCode::kUnavailable;
    };
    auto text = ask();
    while (starting(text) && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      text = ask();
    }
    if (!text.ok()) {
      std::fprintf(stderr, "membox status: %s: %s\n", server.c_str(),
                   text.status().ToString().c_str());
      rc = 1;
      continue;
    }
    std::fputs(text->c_str(), stdout);
    if (!services) continue;
    std::fflush(stdout);
    const NodeServices named = ServicesIn(*text, server);
    if (!named.known) {
      std::printf(
          "-- services: not named yet (the node is starting, or "
          "runs a membox older than this; --wait waits)\n");
      rc = 1;
      continue;
    }
    if (named.proxy.empty()) {
      std::printf("-- parameter proxy: none (this node runs none)\n");
    } else {
      auto t = membox::ps::QueryProxyStatus(named.proxy, *sec,
                                            std::chrono::milliseconds(5000));
      if (t.ok()) {
        std::printf("-- parameter proxy %s --\n%s", named.proxy.c_str(),
                    t->c_str());
      } else {
        std::printf("-- parameter proxy %s: not answering (%s)\n",
                    named.proxy.c_str(), t.status().ToString().c_str());
        rc = 1;
      }
    }
    if (named.embedding.empty()) {
      std::printf("-- embedding server: none (this node runs none)\n");
    } else {
      membox::embedding::EmbeddingClientOptions eo;
      eo.nodes = {named.embedding};
      eo.secret = *sec;
      eo.name = "membox-status";
      eo.timeout = std::chrono::milliseconds(5000);
      auto ec = membox::embedding::EmbeddingClient::Connect(eo);
      auto t = ec.ok() ? (*ec)->NodeStatus(0)
                       : membox::Result<std::string>(ec.status());
      if (t.ok()) {
        std::printf("-- embedding server %s --\n%s", named.embedding.c_str(),
                    t->c_str());
      } else {
        std::printf("-- embedding server %s: not answering (%s)\n",
                    named.embedding.c_str(), t.status().ToString().c_str());
        rc = 1;
      }
    }
    std::fflush(stdout);
  }
  return rc;
}

struct StatusFlags {
  std::vector<std::string> servers;
  bool services = false;
  bool wait = false;
  double wait_s = 60;
  std::string secret, secret_file, admin_secret_file;
};

}  // namespace

Commands AddStatusCommand(CLI::App* app) {
  auto f = std::make_shared<StatusFlags>();
  auto* status = app->add_subcommand(
      "status",
      "print memory nodes' pools, segments, clients (and with --services "
      "their proxies' workers, versions, waiting rounds)");
  status
      ->add_option("--server", f->servers,
                   "memory node(s), host:port[,host:port...] (every node of "
                   "a job)")
      ->delimiter(',')
      ->required();
  status->add_flag("--services", f->services,
                   "also ask the parameter proxy and embedding server "
                   "each node runs (a node names them; none: not run)");
  status->add_flag("--wait", f->wait,
                   "wait until every node answers (up to --timeout), then "
                   "print: for scripts that start nodes");
  status
      ->add_option("--timeout", f->wait_s,
                   "with --wait: seconds to wait for the nodes (default 60); "
                   "exit 1 if one still does not answer")
      ->check(CLI::PositiveNumber);
  status->add_option("--secret", f->secret, "authentication secret");
  status->add_option("--secret-file", f->secret_file,
                     "file whose first line is the secret");
  status->add_option("--admin-secret-file", f->admin_secret_file,
                     "list every client and segment (the server's admin "
                     "secret); without it, this client's view");
  return {{status, [f] {
             return PrintStatus(f->servers, f->secret, f->secret_file,
                                f->admin_secret_file, f->services, f->wait,
                                f->wait_s);
           }}};
}

}  // namespace membox::tools
