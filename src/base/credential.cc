#include "membox/base/credential.h"

#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "membox/base/config.h"
#include "membox/base/hmac.h"
#include "membox/base/logging.h"

namespace membox {
namespace {

constexpr char kPrefix[] = "mbxcred1:";

std::vector<std::string> Split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    size_t p = s.find(sep, start);
    out.push_back(s.substr(start, p - start));
    if (p == std::string::npos) return out;
    start = p + 1;
  }
}

Result<uint64_t> ParseU64(const std::string& s, const char* what) {
  uint64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || p != s.data() + s.size()) {
    return InvalidArgumentError(std::string("credential: bad ") + what + " '" +
                                s + "'");
  }
  return v;
}

std::string Hex(const std::string& bytes) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char b : bytes) {
    out.push_back(kHex[b >> 4]);
    out.push_back(kHex[b & 15]);
  }
  return out;
}

Result<std::string> Unhex(const std::string& hex) {
  if (hex.size() != 64) {
    return InvalidArgumentError("credential: the key must be 64 hex digits");
  }
  std::string out;
  for (size_t i = 0; i < hex.size(); i += 2) {
    auto nib = [](char c) -> int {
      if (c >= '0' && c <= '9') return c - '0';
      if (c >= 'a' && c <= 'f') return c - 'a' + 10;
      if (c >= 'A' && c <= 'F') return c - 'A' + 10;
      return -1;
    };
    int hi = nib(hex[i]), lo = nib(hex[i + 1]);
    if (hi < 0 || lo < 0) {
      return InvalidArgumentError("credential: the key must be hex digits");
    }
    out.push_back(static_cast<char>(hi << 4 | lo));
  }
  return out;
}

std::string FormatQuota(const Principal& p) {
  if (p.quota_percent) return std::to_string(p.quota_percent) + "%";
  return std::to_string(p.quota_bytes);
}

}  // namespace

uint64_t Principal::QuotaOf(uint64_t capacity, uint64_t fallback) const {
  if (quota_percent) {
    return static_cast<uint64_t>(static_cast<__uint128_t>(capacity) *
                                 quota_percent / 100);
  }
  if (quota_bytes) return quota_bytes;
  return fallback;
}

std::string Principal::public_id() const {
  if (cluster) return "";
  return name + ":" + FormatRights(rights) + ":" + FormatQuota(*this) + ":" +
         std::to_string(serial);
}

std::string Principal::label() const {
  if (cluster) return "cluster";
  return name + " (serial " + std::to_string(serial) + ")";
}

Status ValidatePrincipalName(const std::string& name) {
  if (name.empty() || name.size() > 64) {
    return InvalidArgumentError("principal name must have 1..64 characters");
  }
  for (char c : name) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
              (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
    if (!ok) {
      return InvalidArgumentError("principal name '" + name +
                                  "' may hold only letters, digits, '.', "
                                  "'_' and '-'");
    }
  }
  if (name == "cluster") {
    return InvalidArgumentError("'cluster' is the cluster secret's principal");
  }
  return Status::Ok();
}

Result<uint32_t> ParseRights(const std::string& text) {
  uint32_t r = 0;
  for (const std::string& w : Split(text, '+')) {
    if (w == "worker") {
      r |= kRightWorker;
    } else if (w == "node") {
      r |= kRightNode;
    } else if (w == "admin") {
      r |= kRightAdmin;
    } else {
      return InvalidArgumentError("unknown right '" + w +
                                  "' (worker, node, admin)");
    }
  }
  return r;
}

std::string FormatRights(uint32_t rights) {
  std::string s;
  auto add = [&](uint32_t bit, const char* w) {
    if (!(rights & bit)) return;
    if (!s.empty()) s += "+";
    s += w;
  };
  add(kRightWorker, "worker");
  add(kRightNode, "node");
  add(kRightAdmin, "admin");
  return s;
}

Result<Principal> ParsePublicId(const std::string& id) {
  std::vector<std::string> f = Split(id, ':');
  if (f.size() != 4) {
    return InvalidArgumentError(
        "credential: expected name:rights:quota:serial");
  }
  Principal p;
  p.cluster = false;
  p.name = f[0];
  RETURN_IF_ERROR(ValidatePrincipalName(p.name));
  ASSIGN_OR_RETURN(p.rights, ParseRights(f[1]));
  if (!f[2].empty() && f[2].back() == '%') {
    ASSIGN_OR_RETURN(uint64_t pct,
                     ParseU64(f[2].substr(0, f[2].size() - 1), "quota"));
    if (pct == 0 || pct > 100) {
      return InvalidArgumentError("credential: a quota share is 1..100%");
    }
    p.quota_percent = static_cast<uint32_t>(pct);
  } else {
    ASSIGN_OR_RETURN(p.quota_bytes, ParseU64(f[2], "quota"));
  }
  ASSIGN_OR_RETURN(p.serial, ParseU64(f[3], "serial"));
  // One canonical spelling per principal: the id a node derives the key
  // from is exactly the one the issuer signed.
  if (p.public_id() != id) {
    return InvalidArgumentError("credential: non-canonical id '" + id + "'");
  }
  return p;
}

std::string DeriveCredentialKey(const std::string& cluster_secret,
                                const std::string& public_id) {
  static const char kLabel[] = "membox/credential v1";
  std::string data(kLabel, sizeof(kLabel));  // with the NUL: a separator
  data += public_id;
  Digest d = HmacSha256(
      cluster_secret,
      {std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(data.data()),
                                data.size())});
  return std::string(d.begin(), d.end());
}

Result<Credential> Credential::Issue(const std::string& cluster_secret,
                                     const Principal& principal) {
  if (principal.cluster) {
    return InvalidArgumentError("the cluster principal has no credential");
  }
  RETURN_IF_ERROR(ValidatePrincipalName(principal.name));
  if (principal.rights == 0 || (principal.rights & ~kRightsAll)) {
    return InvalidArgumentError("credential: no or unknown rights");
  }
  // Round-trip through the text form: what is issued is what parses.
  ASSIGN_OR_RETURN(Principal p, ParsePublicId(principal.public_id()));
  Credential c;
  c.principal = p;
  c.key = DeriveCredentialKey(cluster_secret, p.public_id());
  return c;
}

std::string Credential::Encode() const {
  return kPrefix + principal.public_id() + ":" + Hex(key);
}

bool Credential::Looks(const std::string& text) {
  return text.rfind(kPrefix, 0) == 0;
}

Result<Credential> Credential::Parse(const std::string& text) {
  if (!Looks(text)) {
    return InvalidArgumentError(
        "not a membox credential (no mbxcred1: prefix)");
  }
  std::string rest = text.substr(sizeof(kPrefix) - 1);
  size_t last = rest.rfind(':');
  if (last == std::string::npos) {
    return InvalidArgumentError("credential: no key");
  }
  Credential c;
  ASSIGN_OR_RETURN(c.principal, ParsePublicId(rest.substr(0, last)));
  ASSIGN_OR_RETURN(c.key, Unhex(rest.substr(last + 1)));
  return c;
}

Status RevocationList::Load() {
  MutexLock l(&mu_);
  return LoadLocked();
}

Status RevocationList::LoadLocked() {
  checked_ = std::chrono::steady_clock::now();
  struct stat st {};
  if (::stat(path_.c_str(), &st) != 0) {
    if (errno != ENOENT) {
      return NotFoundError("cannot stat revocation file '" + path_ +
                           "': " + std::strerror(errno));
    }
    revoked_.clear();
    mtime_ns_ = -1;
    return Status::Ok();
  }
  int64_t mtime =
      static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  std::ifstream in(path_);
  if (!in) return NotFoundError("cannot read revocation file '" + path_ + "'");
  std::map<std::string, Entry> next;
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (auto h = line.find('#'); h != std::string::npos) line.resize(h);
    std::istringstream f(line);
    std::string name, word, extra;
    if (!(f >> name)) continue;
    Entry e;
    if (f >> word) {
      std::string serial;
      if (word != "below" || !(f >> serial) || (f >> extra)) {
        return InvalidArgumentError(path_ + ":" + std::to_string(n) +
                                    ": expected NAME [below SERIAL]");
      }
      ASSIGN_OR_RETURN(e.below, ParseU64(serial, "serial"));
    }
    RETURN_IF_ERROR(ValidatePrincipalName(name).WithContext(path_ + ":" +
                                                            std::to_string(n)));
    auto [it, fresh] = next.emplace(name, e);
    if (!fresh) {
      // Two entries: "every serial" wins, else the higher bound.
      if (it->second.below != 0 && (e.below == 0 || e.below > it->second.below))
        it->second = e;
    }
  }
  revoked_ = std::move(next);
  mtime_ns_ = mtime;
  return Status::Ok();
}

Status RevocationList::Admit(const Principal& p) {
  if (p.cluster) return Status::Ok();
  MutexLock l(&mu_);
  auto now = std::chrono::steady_clock::now();
  if (now - checked_ >= std::chrono::seconds(1)) {
    checked_ = now;
    struct stat st {};
    int64_t mtime = -1;
    if (::stat(path_.c_str(), &st) == 0) {
      mtime = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 +
              st.st_mtim.tv_nsec;
    }
    if (mtime != mtime_ns_) {
      Status s = LoadLocked();
      if (!s.ok()) {
        MEMBOX_LOG_ERROR("revocation file: {} (keeping the previous list)",
                         s.ToString());
      }
    }
  }
  auto it = revoked_.find(p.name);
  if (it != revoked_.end() &&
      (it->second.below == 0 || p.serial < it->second.below)) {
    return PermissionDeniedError("credential " + p.label() + " was revoked");
  }
  return Status::Ok();
}

Status RevocationList::Append(const std::string& path, const std::string& name,
                              uint64_t below_serial) {
  RETURN_IF_ERROR(ValidatePrincipalName(name));
  int fd =
      ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  if (fd < 0) {
    return PermissionDeniedError("cannot open '" + path +
                                 "': " + std::strerror(errno));
  }
  std::string line = name;
  if (below_serial) line += " below " + std::to_string(below_serial);
  line += "\n";
  bool ok = ::write(fd, line.data(), line.size()) ==
            static_cast<ssize_t>(line.size());
  ok = ::close(fd) == 0 && ok;
  if (!ok) return InternalError("cannot write '" + path + "'");
  return Status::Ok();
}

}  // namespace membox
