// Principals and their credentials (docs/design/network_face.md,
// "Principals").
//
// The cluster secret is the root of authority: whoever holds it is the
// principal "cluster" with every right (memory nodes, operators). From it an
// operator issues credentials to jobs and tenants:
//
//   membox credential issue --name JOB --quota 25% -o job.cred
//
// A credential names a principal (name, rights, quota, serial) and carries
// the key HMAC-SHA-256(cluster secret, "membox/credential v1" | public id).
// A node derives that key from the public id it is shown, so it needs no
// registry; the holder proves the key in the transport handshake without
// sending it. The credential text is one line, usable wherever a secret is
// (--secret-file, MEMBOX_SECRET_FILE, membox.connect(secret=...)):
//
//   mbxcred1:<name>:<rights>:<quota>:<serial>:<64 hex digits of key>
//
// rights: '+'-joined words of worker, node, admin; quota: 0 (the node's
// default), N% of the node's capacity, or a byte count.
//
// Thread-safety: value types and pure functions.
#ifndef MEMBOX_BASE_CREDENTIAL_H_
#define MEMBOX_BASE_CREDENTIAL_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <string>

#include "membox/base/mutex.h"
#include "membox/base/status.h"

namespace membox {

enum Right : uint32_t {
  kRightWorker =
      1,            // use memory: segments, parameters, embeddings, checkpoints
  kRightNode = 2,   // node-to-node messages: peer hello, join, state copy
  kRightAdmin = 4,  // see every principal in `membox status`
  kRightsAll = 7,
};

// Who a connection proved to be.
struct Principal {
  std::string name = "cluster";
  uint32_t rights = kRightsAll;
  uint64_t quota_bytes = 0;    // 0: none given in bytes
  uint32_t quota_percent = 0;  // 0: none given as a share
  uint64_t serial = 0;
  bool cluster = true;  // proved the cluster secret itself

  bool may(Right r) const { return (rights & r) != 0; }
  // The bytes this principal may make a node hold out of `capacity`:
  // its quota, else `fallback` (the node's default for one principal).
  uint64_t QuotaOf(uint64_t capacity, uint64_t fallback) const;
  // "name:rights:quota:serial" (empty for the cluster).
  std::string public_id() const;
  // "job-a (serial 2)" / "cluster", for logs and errors.
  std::string label() const;
};

struct Credential {
  Principal principal;
  std::string key;  // 32 bytes

  // A credential for `principal` under `cluster_secret`.
  static Result<Credential> Issue(const std::string& cluster_secret,
                                  const Principal& principal);
  // The one-line text form.
  std::string Encode() const;
  // True when `text` is a credential line (it may still be malformed).
  static bool Looks(const std::string& text);
  static Result<Credential> Parse(const std::string& text);
};

// Revoked credentials, from a file the operator edits (or `membox credential
// revoke` appends to). One entry per line: "NAME" revokes every credential
// of NAME; "NAME below N" those with a serial under N (rotation: issue
// serial N, hand it out, then revoke below N); '#' starts a comment. A node
// started with --revoked-file re-reads it when it changes, so revocation
// needs no restart: new connections of a revoked credential are refused and
// open ones closed within a second (service::Server). The cluster principal
// cannot be revoked (rotate the cluster secret instead).
//
// Thread-safety: Admit and Load may be called from any thread.
class RevocationList {
 public:
  explicit RevocationList(std::string path) : path_(std::move(path)) {}
  // Reads the file now; a missing file is an empty list, a malformed line an
  // error naming it.
  Status Load();
  // kPermissionDenied when `p` is revoked. Re-reads the file when its
  // modification time changed (at most once a second); a file that became
  // malformed keeps the last good list and logs why.
  Status Admit(const Principal& p);
  // Appends an entry to `path` (creating it, mode 0600).
  static Status Append(const std::string& path, const std::string& name,
                       uint64_t below_serial);

 private:
  struct Entry {
    uint64_t below = 0;  // 0: every serial
  };
  Status LoadLocked() MEMBOX_REQUIRES(mu_);
  const std::string path_;
  Mutex mu_;
  std::map<std::string, Entry> revoked_ MEMBOX_GUARDED_BY(mu_);
  int64_t mtime_ns_ MEMBOX_GUARDED_BY(mu_) = -1;  // -1: absent
  std::chrono::steady_clock::time_point checked_ MEMBOX_GUARDED_BY(mu_){};
};

// Parses a public id ("name:rights:quota:serial"), validating every field.
Result<Principal> ParsePublicId(const std::string& id);
// HMAC-SHA-256(cluster secret, "membox/credential v1" | public id): the key
// the holder of that principal's credential proves.
std::string DeriveCredentialKey(const std::string& cluster_secret,
                                const std::string& public_id);
// Principal names: 1..64 of [A-Za-z0-9._-], not "cluster".
Status ValidatePrincipalName(const std::string& name);
// "worker+node" -> bits; "" and unknown words are errors.
Result<uint32_t> ParseRights(const std::string& text);
std::string FormatRights(uint32_t rights);

}  // namespace membox

#endif  // MEMBOX_BASE_CREDENTIAL_H_
