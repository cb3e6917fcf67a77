// The owner's table of exported memory ranges: what a remote access may
// touch, and which accesses are touching it right now.
//
// Every incoming one-sided access (membox's TCP path, UCX active messages)
// acquires a Lease for exactly its range before it touches memory, and holds
// it until the bytes are in place or sent. Unregister() first removes the
// entry (every later access fails at once), then waits for the leases
// already held: up to `grace` for them to finish by themselves, then it runs
// each holder's fence (which fails the holder's channel, so that a receive
// or send blocked on a stalled peer returns) and waits for the rest. When
// Unregister returns, no access touches the range any more: the memory may
// be freed, or zeroed and handed to another principal
// (docs/design/network_face.md, "Revocation").
//
// Ownership: the table owns its entries; a Lease keeps its entry alive (not
// the memory) until released. Fences are called without the table's lock,
// and must be safe to call after their channel failed (weak references).
//
// Thread-safety: every method may be called from any thread. Unregister
// blocks until the leases are gone: never call it while holding a lease or a
// lock that a lease holder needs to release its lease.
#ifndef MEMBOX_SRC_TRANSPORT_EXPORT_TABLE_H_
#define MEMBOX_SRC_TRANSPORT_EXPORT_TABLE_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>

#include "membox/base/hmac.h"
#include "membox/base/mutex.h"
#include "membox/base/status.h"

namespace membox::transport {

class ExportTable {
 public:
  struct Entry {
    uint64_t address = 0;
    uint64_t length = 0;
    Token128 token;
    uint32_t rkey_crc = 0;  // crc32 of the packed remote key handed out
    bool host = true;       // false: GPU memory, reachable by UCX RMA only
  };
  // Released (destroyed) when the access is done with the memory.
  using Lease = std::shared_ptr<void>;
  // Makes the lease's holder give it up soon (fails its channel).
  using Fence = std::function<void()>;

  explicit ExportTable(
      std::chrono::milliseconds grace = std::chrono::milliseconds(1000))
      : grace_(grace) {}
  ExportTable(const ExportTable&) = delete;
  ExportTable& operator=(const ExportTable&) = delete;

  void Register(uint64_t id, const Entry& e);
  // Removes `id`, then waits for (and if need be fences) its leases.
  void Unregister(uint64_t id);

  // Checks that [addr, addr + len) lies inside the region `id` whose token is
  // `token` (and is host memory if `host_memory`). An unknown id and a wrong
  // token give the same error, so a caller learns nothing about regions it
  // may not open.
  Status Check(uint64_t id, const Token128& token, uint64_t addr, uint64_t len,
               bool host_memory) const;
  // Check(), and on success a lease on the range until the access is done.
  Result<Lease> Acquire(uint64_t id, const Token128& token, uint64_t addr,
                        uint64_t len, bool host_memory, Fence fence);
  bool CheckRkeyCrc(uint64_t id, uint32_t crc) const;

  // Leases held now (tests, metrics).
  size_t leases() const;
  // Leases fenced since the start (tests, metrics).
  uint64_t fenced() const;

 private:
  struct Slot {
    Entry e;
    uint64_t next_lease = 1;
    std::map<uint64_t, Fence> held;  // lease id -> its holder's fence
  };
  class Holder;
  Status CheckLocked(const Slot* s, uint64_t id, const Token128& token,
                     uint64_t addr, uint64_t len, bool host_memory) const
      MEMBOX_REQUIRES(mu_);
  void Release(const std::shared_ptr<Slot>& slot, uint64_t lease);

  const std::chrono::milliseconds grace_;
  mutable Mutex mu_;
  CondVar released_;
  std::map<uint64_t, std::shared_ptr<Slot>> slots_ MEMBOX_GUARDED_BY(mu_);
  size_t leases_ MEMBOX_GUARDED_BY(mu_) = 0;
  uint64_t fenced_ MEMBOX_GUARDED_BY(mu_) = 0;
};

}  // namespace membox::transport

#endif  // MEMBOX_SRC_TRANSPORT_EXPORT_TABLE_H_
