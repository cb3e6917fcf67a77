// `membox credential issue|revoke` and `membox secret`.
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include "membox/base/config.h"
#include "membox/base/credential.h"
#include "membox/base/environment.h"
#include "membox/base/secret.h"

#include "tools/commands.h"

namespace membox::tools {
namespace {

// `membox credential issue`: the credential of `name` under the cluster
// secret, written to `out` (created, mode 0600).
int IssueCredential(const std::string& secret_file, const std::string& name,
                    const std::string& rights, const std::string& quota,
                    uint64_t serial, const std::string& out) {
  auto fail = [](const membox::Status& s) {
    std::fprintf(stderr, "membox credential issue: %s\n", s.ToString().c_str());
    return 1;
  };
  auto choice = membox::ResolveSecretOrEnvironment("", secret_file);
  if (!choice.ok()) return fail(choice.status());
  const std::string* sec = &choice->secret;
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

struct CredentialFlags {
  std::string name, rights = "worker", quota = "0", out, secret_file, revoked;
  uint64_t serial = 1, below = 0;
  std::string secret_out;
};

}  // namespace

Commands AddCredentialCommands(CLI::App* app) {
  auto f = std::make_shared<CredentialFlags>();
  auto* credcmd = app->add_subcommand(
      "credential", "issue or revoke a principal's credential");
  credcmd->require_subcommand(1);
  auto* cred_issue = credcmd->add_subcommand(
      "issue", "write a credential derived from the cluster secret");
  cred_issue->add_option("--name", f->name, "principal (job or tenant)")
      ->required();
  cred_issue->add_option("--rights", f->rights,
                         "'+'-joined: worker, node, admin (default worker)");
  cred_issue->add_option("--quota", f->quota,
                         "N% of each node's capacity, a size (4GiB), or 0 "
                         "(the node's default)");
  cred_issue->add_option("--serial", f->serial,
                         "bump it to rotate (then revoke --below it)");
  cred_issue->add_option("--secret-file", f->secret_file,
                         "the cluster secret (or MEMBOX_SECRET_FILE)");
  cred_issue->add_option("-o,--output", f->out, "file to create (0600)")
      ->required();
  auto* cred_revoke = credcmd->add_subcommand(
      "revoke", "add a principal to a node's --revoked-file");
  cred_revoke->add_option("--name", f->name, "principal")->required();
  cred_revoke->add_option("--below", f->below,
                          "only serials under this (after a rotation)");
  cred_revoke->add_option("--revoked-file", f->revoked, "the nodes' file")
      ->required();
  auto* secretcmd = app->add_subcommand(
      "secret", "write a new random cluster secret (256 bits, mode 0600)");
  secretcmd->add_option("-o,--output", f->secret_out, "file to create")
      ->required();

  Commands out;
  out.push_back({cred_issue, [f] {
                   return IssueCredential(f->secret_file, f->name, f->rights,
                                          f->quota, f->serial, f->out);
                 }});
  out.push_back({cred_revoke, [f] {
                   Status st =
                       RevocationList::Append(f->revoked, f->name, f->below);
                   if (!st.ok()) {
                     std::fprintf(stderr, "membox credential revoke: %s\n",
                                  st.ToString().c_str());
                     return 1;
                   }
                   return 0;
                 }});
  out.push_back({secretcmd, [f] {
                   Status st = WriteNewSecretFile(f->secret_out);
                   if (!st.ok()) {
                     std::fprintf(stderr, "membox secret: %s\n",
                                  st.ToString().c_str());
                     return 1;
                   }
                   return 0;
                 }});
  return out;
}

}  // namespace membox::tools
