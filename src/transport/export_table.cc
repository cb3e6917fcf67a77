#include "src/transport/export_table.h"

#include <string>
#include <utility>
#include <vector>

#include "membox/base/logging.h"

namespace membox::transport {

// Releases its lease when the last copy goes away.
class ExportTable::Holder {
 public:
  Holder(ExportTable* t, std::shared_ptr<Slot> s, uint64_t id)
      : table_(t), slot_(std::move(s)), id_(id) {}
  ~Holder() { table_->Release(slot_, id_); }
  Holder(const Holder&) = delete;
  Holder& operator=(const Holder&) = delete;

 private:
  ExportTable* table_;
  std::shared_ptr<Slot> slot_;
  uint64_t id_;
};

void ExportTable::Register(uint64_t id, const Entry& e) {
  auto s = std::make_shared<Slot>();
  s->e = e;
  MutexLock l(&mu_);
  slots_[id] = std::move(s);
}

void ExportTable::Unregister(uint64_t id) {
  std::vector<Fence> fences;
  std::shared_ptr<Slot> slot;
  {
    MutexLock l(&mu_);
    auto it = slots_.find(id);
    if (it == slots_.end()) return;
    slot = std::move(it->second);
    slots_.erase(it);
    // Accesses that passed the check before the erase finish first.
    auto deadline = std::chrono::steady_clock::now() + grace_;
    while (!slot->held.empty()) {
      auto left = deadline - std::chrono::steady_clock::now();
      if (left <= std::chrono::nanoseconds::zero()) break;
      released_.WaitFor(&mu_, left);
    }
    if (slot->held.empty()) return;
    // A holder is stalled (a peer that stopped reading or sending): fail its
    // channel so the blocked call returns and drops the lease.
    for (auto& [lease, fence] : slot->held) {
      if (fence) fences.push_back(fence);
    }
    fenced_ += slot->held.size();
    MEMBOX_LOG_WARN(
        "region {}: {} access(es) still running {} ms after revocation; "
        "failing their channels",
        id, slot->held.size(), grace_.count());
  }
  for (auto& f : fences) f();
  MutexLock l(&mu_);
  while (!slot->held.empty()) {
    if (!released_.WaitFor(&mu_, std::chrono::seconds(10)) &&
        !slot->held.empty()) {
      MEMBOX_LOG_ERROR("region {}: still waiting for {} fenced access(es)", id,
                       slot->held.size());
    }
  }
}

Status ExportTable::CheckLocked(const Slot* s, uint64_t id,
                                const Token128& token, uint64_t addr,
                                uint64_t len, bool host_memory) const {
  if (s == nullptr || !(s->e.token == token)) {
    return PermissionDeniedError("no region " + std::to_string(id) +
                                 " with this access key");
  }
  const Entry& r = s->e;
  if (host_memory && !r.host) {
    return FailedPreconditionError(
        "region " + std::to_string(id) +
        " is GPU memory: only UCX's one-sided operations reach it, not "
        "membox's TCP path or active messages");
  }
  if (addr < r.address || len > r.length || addr - r.address > r.length - len) {
    return OutOfRangeError("range [" + std::to_string(addr) + ", +" +
                           std::to_string(len) + ") outside region " +
                           std::to_string(id));
  }
  return Status::Ok();
}

Status ExportTable::Check(uint64_t id, const Token128& token, uint64_t addr,
                          uint64_t len, bool host_memory) const {
  MutexLock l(&mu_);
  auto it = slots_.find(id);
  return CheckLocked(it == slots_.end() ? nullptr : it->second.get(), id, token,
                     addr, len, host_memory);
}

Result<ExportTable::Lease> ExportTable::Acquire(uint64_t id,
                                                const Token128& token,
                                                uint64_t addr, uint64_t len,
                                                bool host_memory, Fence fence) {
  MutexLock l(&mu_);
  auto it = slots_.find(id);
  RETURN_IF_ERROR(CheckLocked(it == slots_.end() ? nullptr : it->second.get(),
                              id, token, addr, len, host_memory));
  std::shared_ptr<Slot>& slot = it->second;
  uint64_t lease = slot->next_lease++;
  slot->held.emplace(lease, std::move(fence));
  ++leases_;
  return Lease(std::make_shared<Holder>(this, slot, lease));
}

void ExportTable::Release(const std::shared_ptr<Slot>& slot, uint64_t lease) {
  MutexLock l(&mu_);
  if (slot->held.erase(lease) > 0) --leases_;
  released_.NotifyAll();
}

bool ExportTable::CheckRkeyCrc(uint64_t id, uint32_t crc) const {
  MutexLock l(&mu_);
  auto it = slots_.find(id);
  return it != slots_.end() && it->second->e.rkey_crc == crc;
}

size_t ExportTable::leases() const {
  MutexLock l(&mu_);
  return leases_;
}

uint64_t ExportTable::fenced() const {
  MutexLock l(&mu_);
  return fenced_;
}

}  // namespace membox::transport
