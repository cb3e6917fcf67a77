#include "membox/embedding/mem_tier.h"

#include <cstring>
#include <list>
#include <map>
#include <mutex>
#include <set>
#include <unordered_map>

namespace membox::embedding {
namespace {

struct Entry {
  std::unique_ptr<uint8_t[]> row;
  uint64_t freq = 0;
  int pins = 0;
  bool dirty = false;
  enum class Where { kPinned, kLru, kLfu } where = Where::kPinned;
  std::list<uint64_t>::iterator lru_it;
  std::set<std::pair<uint64_t, uint64_t>>::iterator lfu_it;  // (freq, key)
};

class MemTierImpl final : public MemTier {
 public:
  MemTierImpl(MemTierOptions o, SsdStore* ssd)
      : opt_(std::move(o)), ssd_(ssd), row_(ssd->row_bytes()) {
    capacity_ = std::max<uint64_t>(1, opt_.budget_bytes / row_);
  }

  Result<std::vector<uint8_t*>> Acquire(std::span<const uint64_t> keys,
                                        uint64_t batch) override {
    std::lock_guard<std::mutex> l(mu_);
    // Count the rows this batch would newly pin.
    uint64_t newly = 0;
    std::set<uint64_t> seen;
    for (uint64_t k : keys) {
      if (!seen.insert(k).second) continue;
      auto it = rows_.find(k);
      if (it == rows_.end() || it->second.pins == 0) ++newly;
    }
    if (pinned_ + newly > capacity_) {
      return ResourceExhaustedError("the pinned working set (" +
                                    std::to_string(pinned_ + newly) +
                                    " rows) exceeds the memory budget (" +
                                    std::to_string(capacity_) + " rows)");
    }
    std::vector<uint64_t> missing;
    for (uint64_t k : seen) {
      if (!rows_.count(k)) missing.push_back(k);
    }
    // Load what is on the SSD, create the rest.
    if (!missing.empty()) {
      std::vector<uint8_t> buf(missing.size() * row_);
      std::vector<bool> found;
      RETURN_IF_ERROR(ssd_->Get(missing, buf, &found));
      for (size_t i = 0; i < missing.size(); ++i) {
        Entry e;
        e.row.reset(new uint8_t[row_]);
        if (found[i]) {
          std::memcpy(e.row.get(), buf.data() + i * row_, row_);
          stats_.ssd_reads++;
        } else {
          std::span<uint8_t> r(e.row.get(), row_);
          if (opt_.initializer) {
            opt_.initializer(missing[i], r);
          } else {
            std::memset(r.data(), 0, r.size());
          }
          e.dirty = true;  // exists nowhere else yet
          stats_.created++;
        }
        rows_.emplace(missing[i], std::move(e));
      }
    }
    std::vector<uint8_t*> out;
    out.reserve(keys.size());
    auto& held = batches_[batch];
    for (uint64_t k : keys) {
      Entry& e = rows_.at(k);
      if (held.insert(k).second) Pin(k, e);
      e.freq++;
      out.push_back(e.row.get());
    }
    RETURN_IF_ERROR(EvictLocked());
    return out;
  }

  void MarkDirty(std::span<const uint64_t> keys) override {
    std::lock_guard<std::mutex> l(mu_);
    for (uint64_t k : keys) {
      auto it = rows_.find(k);
      if (it != rows_.end()) it->second.dirty = true;
    }
  }

  Status Release(uint64_t batch) override {
    std::lock_guard<std::mutex> l(mu_);
    auto b = batches_.find(batch);
    if (b == batches_.end()) return NotFoundError("no such batch");
    for (uint64_t k : b->second) {
      Entry& e = rows_.at(k);
      if (--e.pins == 0) {
        pinned_--;
        lru_.push_front(k);
        e.lru_it = lru_.begin();
        e.where = Entry::Where::kLru;
      }
    }
    batches_.erase(b);
    return EvictLocked();
  }

  Status Flush() override {
    std::lock_guard<std::mutex> l(mu_);
    std::vector<uint64_t> keys;
    std::vector<uint8_t> rows;
    for (auto& [k, e] : rows_) {
      if (!e.dirty) continue;
      keys.push_back(k);
      rows.insert(rows.end(), e.row.get(), e.row.get() + row_);
      e.dirty = false;
    }
    if (!keys.empty()) RETURN_IF_ERROR(ssd_->Put(keys, rows));
    stats_.flushed_rows += keys.size();
    return ssd_->Sync();
  }

  MemTierStats Stats() const override {
    std::lock_guard<std::mutex> l(mu_);
    MemTierStats s = stats_;
    s.capacity_rows = capacity_;
    s.rows_in_memory = rows_.size();
    s.pinned = pinned_;
    s.lru = lru_.size();
    s.lfu = lfu_.size();
    return s;
  }

 private:
  void Pin(uint64_t k, Entry& e) {
    if (e.pins++ > 0) {
      stats_.hits_pinned++;
      return;
    }
    if (e.where == Entry::Where::kLru) {
      lru_.erase(e.lru_it);
      stats_.hits_lru++;
    } else if (e.where == Entry::Where::kLfu) {
      lfu_.erase(e.lfu_it);
      stats_.hits_lfu++;
    }
    e.where = Entry::Where::kPinned;
    pinned_++;
  }

  // LRU overflow -> LFU; LFU overflow -> SSD (dirty rows written first).
  Status EvictLocked() {
    uint64_t unpinned_cap = capacity_ - std::min(capacity_, pinned_);
    uint64_t lru_cap = static_cast<uint64_t>(unpinned_cap * opt_.lru_fraction);
    while (lru_.size() > lru_cap) {
      uint64_t k = lru_.back();
      lru_.pop_back();
      Entry& e = rows_.at(k);
      e.lfu_it = lfu_.insert({e.freq, k}).first;
      e.where = Entry::Where::kLfu;
      stats_.evicted_to_lfu++;
    }
    std::vector<uint64_t> keys;
    std::vector<uint8_t> rows;
    std::vector<uint64_t> drop;
    while (lru_.size() + lfu_.size() > unpinned_cap && !lfu_.empty()) {
      auto victim = lfu_.begin();  // least frequently used
      uint64_t k = victim->second;
      lfu_.erase(victim);
      Entry& e = rows_.at(k);
      if (e.dirty) {
        keys.push_back(k);
        rows.insert(rows.end(), e.row.get(), e.row.get() + row_);
      }
      drop.push_back(k);
      stats_.evicted_to_ssd++;
    }
    if (!keys.empty()) {
      // Written (appended) before the memory goes; acknowledged by the next
      // Flush()/Sync like every other SSD write.
      RETURN_IF_ERROR(ssd_->Put(keys, rows));
      stats_.flushed_rows += keys.size();
    }
    for (uint64_t k : drop) rows_.erase(k);
    return Status::Ok();
  }

  MemTierOptions opt_;
  SsdStore* ssd_;
  const uint32_t row_;
  uint64_t capacity_ = 0;  // rows
  mutable std::mutex mu_;
  std::unordered_map<uint64_t, Entry> rows_;        // GUARDED_BY(mu_)
  std::list<uint64_t> lru_;                         // front: newest
  std::set<std::pair<uint64_t, uint64_t>> lfu_;     // (freq, key)
  std::map<uint64_t, std::set<uint64_t>> batches_;  // batch -> keys
  uint64_t pinned_ = 0;
  MemTierStats stats_;
};

}  // namespace

Result<std::unique_ptr<MemTier>> MemTier::Create(const MemTierOptions& options,
                                                 SsdStore* ssd) {
  if (ssd == nullptr) return InvalidArgumentError("the SSD tier is required");
  if (options.budget_bytes < ssd->row_bytes()) {
    return InvalidArgumentError("budget smaller than one row");
  }
  if (!(options.lru_fraction >= 0 && options.lru_fraction <= 1)) {
    return InvalidArgumentError("lru_fraction must be in [0, 1]");
  }
  return std::unique_ptr<MemTier>(new MemTierImpl(options, ssd));
}

}  // namespace membox::embedding
