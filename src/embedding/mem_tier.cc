#include "membox/embedding/mem_tier.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <new>
#include <set>
#include <type_traits>
#include <vector>

#include <absl/container/flat_hash_map.h>
#include <absl/container/flat_hash_set.h>

#include "membox/base/logging.h"
#include "membox/base/mutex.h"

namespace membox::embedding {
namespace {

// One row in memory: these fields, then the row's bytes in the same
// allocation (one cache-missing fetch reaches both). The LRU is an
// intrusive list through the entries, so pins and releases allocate
// nothing. Cache-line aligned: the fields fill one line and a row of up
// to 64 bytes the next, where a 16-byte alignment spread most entries
// over three lines.
struct alignas(64) Entry {
  uint64_t key = 0;
  uint64_t freq = 0;
  uint64_t mark = 0;  // the Acquire call that saw it last (dedups keys)
  Entry* lru_prev = nullptr;
  Entry* lru_next = nullptr;
  std::set<std::pair<uint64_t, uint64_t>>::iterator lfu_it;  // (freq, key)
  int32_t pins = 0;
  bool dirty = false;
  enum class Where : uint8_t { kPinned, kLru, kLfu } where = Where::kPinned;

  uint8_t* row() { return reinterpret_cast<uint8_t*>(this + 1); }
};

static_assert(std::is_trivially_destructible_v<Entry>,
              "EntryArena frees entries without destroying them");

// Entries with their rows in fixed-size, cache-line-aligned slots carved
// from blocks of about 1 MiB; a freed slot is reused by the next entry.
// Against one aligned operator new per entry: no allocator header or
// alignment padding per row (169 MB for 900,000 dim-8 Adagrad rows, 183 MB
// with 16-byte-aligned allocations), and rows created together are
// neighbours in memory. Memory goes back to the system only with the
// arena: the tier's budget bounds how many slots are in use at once
// (except while evictions to the SSD tier fail).
// Thread-safety: none (the tier's mutex guards it).
class EntryArena {
 public:
  explicit EntryArena(size_t row_bytes)
      : slot_((sizeof(Entry) + row_bytes + alignof(Entry) - 1) /
              alignof(Entry) * alignof(Entry)),
        per_block_(std::max<size_t>(1, (size_t{1} << 20) / slot_)) {}

  Entry* New(uint64_t key) {
    void* p = free_;
    if (p != nullptr) {
      free_ = *static_cast<void**>(p);
    } else {
      if (next_ == end_) {
        const size_t bytes = per_block_ * slot_;
        void* block = ::operator new (bytes, std::align_val_t{alignof(Entry)});
        blocks_.emplace_back(static_cast<uint8_t*>(block));
        next_ = blocks_.back().get();
        end_ = next_ + bytes;
      }
      p = next_;
      next_ += slot_;
    }
    Entry* e = new (p) Entry;
    e->key = key;
    return e;
  }

  void Free(Entry* e) {
    *reinterpret_cast<void**>(e) = free_;
    free_ = e;
  }

 private:
  struct BlockDeleter {
    void operator()(uint8_t* p) const {
      ::operator delete (p, std::align_val_t{alignof(Entry)});
    }
  };
  const size_t slot_;       // bytes per entry and row, a multiple of 64
  const size_t per_block_;  // slots per block
  std::vector<std::unique_ptr<uint8_t, BlockDeleter>> blocks_;
  uint8_t* next_ = nullptr;  // the newest block's first unused slot
  uint8_t* end_ = nullptr;
  void* free_ = nullptr;  // freed slots, linked through their first bytes
};

// Most recently used first. Entries link themselves; the list owns none.
class LruList {
 public:
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  Entry* back() const { return back_; }

  void PushFront(Entry* e) {
    e->lru_prev = nullptr;
    e->lru_next = front_;
    if (front_ != nullptr) front_->lru_prev = e;
    front_ = e;
    if (back_ == nullptr) back_ = e;
    ++size_;
  }
  void Erase(Entry* e) {
    (e->lru_prev ? e->lru_prev->lru_next : front_) = e->lru_next;
    (e->lru_next ? e->lru_next->lru_prev : back_) = e->lru_prev;
    e->lru_prev = e->lru_next = nullptr;
    --size_;
  }
  void MoveToFront(Entry* e) {
    if (front_ == e) return;
    Erase(e);
    PushFront(e);
  }

 private:
  Entry* front_ = nullptr;
  Entry* back_ = nullptr;
  size_t size_ = 0;
};

class MemTierImpl final : public MemTier {
 public:
  MemTierImpl(MemTierOptions o, SsdStore* ssd)
      : opt_(std::move(o)),
        ssd_(ssd),
        row_(ssd->row_bytes()),
        arena_(ssd->row_bytes()) {
    capacity_ = std::max<uint64_t>(1, opt_.budget_bytes / row_);
  }

  // One hash lookup per key for rows in memory (entries do not move: the
  // map keeps references stable and pinned rows are never erased).
  Result<std::vector<uint8_t*>> Acquire(std::span<const uint64_t> keys,
                                        uint64_t batch) override {
    MutexLock l(&mu_);
    const uint64_t mark = ++marks_;
    std::vector<Entry*> entries(keys.size(), nullptr);
    FindLocked(keys, entries.data());
    std::vector<uint64_t> missing;
    absl::flat_hash_set<uint64_t> missing_seen;
    uint64_t newly = 0;  // distinct rows this batch would newly pin
    for (size_t i = 0; i < keys.size(); ++i) {
      Entry* e = entries[i];
      if (e == nullptr) {
        if (missing_seen.insert(keys[i]).second) {
          missing.push_back(keys[i]);
          ++newly;
        }
        continue;
      }
      if (e->mark != mark) {
        e->mark = mark;
        if (e->pins == 0) {
          ++newly;
          // Pin below unlinks it from the LRU: fetch its neighbours now.
          PrefetchLine(e->lru_prev);
          PrefetchLine(e->lru_next);
        }
      }
    }
    if (pinned_ + newly > capacity_) {
      return ResourceExhaustedError("the pinned working set (" +
                                    std::to_string(pinned_ + newly) +
                                    " rows) exceeds the memory budget (" +
                                    std::to_string(capacity_) + " rows)");
    }
    // Load what is on the SSD, create the rest.
    if (!missing.empty()) {
      RETURN_IF_ERROR(LoadLocked(missing, /*to_pin=*/true));
      for (size_t i = 0; i < keys.size(); ++i) {
        if (entries[i] == nullptr) entries[i] = rows_.at(keys[i]);
      }
    }
    std::vector<uint8_t*> out;
    out.reserve(keys.size());
    auto& held = batches_[batch];
    for (Entry* e : entries) {
      // A key named twice (or in two Acquires of one batch) is pinned twice
      // and unpinned twice by Release: the count stays right.
      Pin(*e);
      held.push_back(e);
      e->freq++;
      out.push_back(e->row());
    }
    // The rows are pinned and stay so until Release(batch): an eviction
    // the SSD tier refuses now leaves the tier over its budget until one
    // succeeds (the next Release or Flush reports the failure), and does
    // not fail a pull that has its rows.
    EvictOrWarnLocked();
    return out;
  }

  Status ForEachRow(std::span<const uint64_t> keys,
                    const std::function<void(size_t, uint8_t*)>& fn,
                    bool changes) override {
    MutexLock l(&mu_);
    std::vector<Entry*> entries(keys.size(), nullptr);
    FindLocked(keys, entries.data());
    std::vector<size_t> missing;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (entries[i] == nullptr) {
        missing.push_back(i);
        continue;
      }
      Visit(*entries[i], changes);
      fn(i, entries[i]->row());
    }
    // Rows not in memory: loaded a quarter of the budget at a time, each
    // piece used, then the budget restored by eviction.
    const size_t chunk = std::max<uint64_t>(1, capacity_ / 4);
    for (size_t b = 0; b < missing.size(); b += chunk) {
      size_t e = std::min(missing.size(), b + chunk);
      std::vector<uint64_t> load;
      absl::flat_hash_set<uint64_t> seen;
      for (size_t j = b; j < e; ++j) {
        uint64_t k = keys[missing[j]];
        if (!rows_.count(k) && seen.insert(k).second) load.push_back(k);
      }
      RETURN_IF_ERROR(LoadLocked(load));
      for (size_t j = b; j < e; ++j) {
        Entry& en = *rows_.at(keys[missing[j]]);
        Visit(en, changes);
        fn(missing[j], en.row());
      }
      // Part of the rows may be changed already: an eviction the SSD tier
      // refuses leaves the tier over its budget (as in Acquire) rather than
      // failing a half-applied call.
      EvictOrWarnLocked();
    }
    return Status::Ok();
  }

  Status ForEachPinnedRow(uint64_t batch, std::span<const uint64_t> keys,
                          const std::function<void(size_t, uint8_t*)>& fn,
                          bool changes) override {
    {
      MutexLock l(&mu_);
      auto b = batches_.find(batch);
      if (b != batches_.end() && b->second.size() == keys.size()) {
        const std::vector<Entry*>& held = b->second;
        size_t i = 0;
        for (size_t j = 0; j < std::min(kAhead, held.size()); ++j) {
          PrefetchEntry(held[j]);
        }
        while (i < keys.size() && held[i]->key == keys[i]) {
          if (i + kAhead < held.size()) PrefetchEntry(held[i + kAhead]);
          ++i;
        }
        if (i == keys.size()) {
          for (size_t j = 0; j < keys.size(); ++j) {
            // The rows' lines again: `fn` may have pushed them out.
            if (j + kAhead < keys.size()) PrefetchEntry(held[j + kAhead]);
            Visit(*held[j], changes);
            fn(j, held[j]->row());
          }
          stats_.pinned_updates += keys.size();
          return Status::Ok();
        }
      }
    }
    return ForEachRow(keys, fn, changes);
  }

  void MarkDirty(std::span<const uint64_t> keys) override {
    MutexLock l(&mu_);
    for (uint64_t k : keys) {
      auto it = rows_.find(k);
      if (it != rows_.end()) it->second->dirty = true;
    }
  }

  Status Release(uint64_t batch) override {
    MutexLock l(&mu_);
    auto b = batches_.find(batch);
    if (b == batches_.end()) return NotFoundError("no such batch");
    const std::vector<Entry*>& held = b->second;
    for (size_t j = 0; j < std::min(kAhead, held.size()); ++j) {
      PrefetchLine(held[j]);
    }
    for (size_t j = 0; j < held.size(); ++j) {
      if (j + kAhead < held.size()) PrefetchLine(held[j + kAhead]);
      Entry* e = held[j];
      if (--e->pins == 0) {
        pinned_--;
        lru_.PushFront(e);
        e->where = Entry::Where::kLru;
      }
    }
    batches_.erase(b);
    return EvictLocked();
  }

  Status Flush() override {
    MutexLock l(&mu_);
    std::vector<uint64_t> keys;
    std::vector<uint8_t> rows;
    for (auto& [k, e] : rows_) {
      if (!e->dirty) continue;
      keys.push_back(k);
      rows.insert(rows.end(), e->row(), e->row() + row_);
      e->dirty = false;
    }
    if (!keys.empty()) RETURN_IF_ERROR(ssd_->Put(keys, rows));
    stats_.flushed_rows += keys.size();
    return ssd_->Sync();
  }

  MemTierStats Stats() const override {
    MutexLock l(&mu_);
    MemTierStats s = stats_;
    s.capacity_rows = capacity_;
    s.rows_in_memory = rows_.size();
    s.pinned = pinned_;
    s.lru = lru_.size();
    s.lfu = lfu_.size();
    return s;
  }

 private:
  // How many keys ahead a lookup loop asks for the cache lines it will
  // need: a lookup is two dependent cache misses (the map's slot, then the
  // entry), which the loops overlap across keys instead of taking one
  // after another (they were most of a memory node's CPU in the CTR run).
  static constexpr size_t kAhead = 16;

  static void PrefetchLine(const void* p) {
    if (p != nullptr) __builtin_prefetch(p);
  }
  // The entry's fields and its row (which may start on the next line).
  void PrefetchEntry(Entry* e) const {
    __builtin_prefetch(e);
    __builtin_prefetch(e->row() + row_ - 1);
  }

  // found[i] = the entry of keys[i], or nullptr when it is not in memory;
  // each entry found is asked for, for the caller's pass over them.
  void FindLocked(std::span<const uint64_t> keys, Entry** found) const
      MEMBOX_REQUIRES(mu_) {
    const size_t n = keys.size();
    for (size_t i = 0; i < std::min(kAhead, n); ++i) rows_.prefetch(keys[i]);
    for (size_t i = 0; i < n; ++i) {
      if (i + kAhead < n) rows_.prefetch(keys[i + kAhead]);
      auto it = rows_.find(keys[i]);
      if (it == rows_.end()) continue;
      found[i] = it->second;
      PrefetchEntry(found[i]);
    }
  }

  // Loads `keys` (none in memory, distinct) from the SSD tier, or creates
  // them, into memory: unpinned rows at the LRU's front, or (`to_pin`)
  // rows in no list that the caller pins at once.
  Status LoadLocked(const std::vector<uint64_t>& keys, bool to_pin = false)
      MEMBOX_REQUIRES(mu_) {
    if (keys.empty()) return Status::Ok();
    std::vector<uint8_t> buf(keys.size() * row_);
    std::vector<bool> found;
    RETURN_IF_ERROR(ssd_->Get(keys, buf, &found));
    rows_.reserve(rows_.size() + keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      Entry& e = *arena_.New(keys[i]);
      if (found[i]) {
        std::memcpy(e.row(), buf.data() + i * row_, row_);
        stats_.ssd_reads++;
      } else {
        std::span<uint8_t> r(e.row(), row_);
        if (opt_.initializer) {
          opt_.initializer(keys[i], r);
        } else {
          std::memset(r.data(), 0, r.size());
        }
        e.dirty = true;  // exists nowhere else yet
        stats_.created++;
      }
      if (to_pin) {
        e.where = Entry::Where::kPinned;  // pins 0 until the caller's Pin
      } else {
        lru_.PushFront(&e);
        e.where = Entry::Where::kLru;
      }
      rows_.emplace(keys[i], &e);
    }
    return Status::Ok();
  }

  // An access that does not pin: the row becomes the LRU's newest (from
  // the LFU too, as a pin and release would), and is dirty if `changes`.
  void Visit(Entry& e, bool changes) {
    e.freq++;
    if (changes) e.dirty = true;
    if (e.where == Entry::Where::kLru) {
      lru_.MoveToFront(&e);
      stats_.hits_lru++;
    } else if (e.where == Entry::Where::kLfu) {
      lfu_.erase(e.lfu_it);
      lru_.PushFront(&e);
      e.where = Entry::Where::kLru;
      stats_.hits_lfu++;
    } else {
      stats_.hits_pinned++;
    }
  }

  void Pin(Entry& e) {
    if (e.pins++ > 0) {
      stats_.hits_pinned++;
      return;
    }
    // where == kPinned with no pins: just loaded (LoadLocked's to_pin).
    if (e.where == Entry::Where::kLru) {
      lru_.Erase(&e);
      stats_.hits_lru++;
    } else if (e.where == Entry::Where::kLfu) {
      lfu_.erase(e.lfu_it);
      stats_.hits_lfu++;
    }
    e.where = Entry::Where::kPinned;
    pinned_++;
  }

  // EvictLocked for callers that have changed or pinned rows already: a
  // failure is logged, the rows stay in memory over the budget, and the
  // next eviction (every Acquire, ForEachRow chunk and Release) retries.
  void EvictOrWarnLocked() MEMBOX_REQUIRES(mu_) {
    Status s = EvictLocked();
    if (!s.ok()) {
      MEMBOX_LOG_WARN("memory tier: eviction deferred: {}", s.ToString());
    }
  }

  // LRU overflow -> LFU; LFU overflow -> SSD (dirty rows written first).
  Status EvictLocked() MEMBOX_REQUIRES(mu_) {
    uint64_t unpinned_cap = capacity_ - std::min(capacity_, pinned_);
    uint64_t lru_cap = static_cast<uint64_t>(unpinned_cap * opt_.lru_fraction);
    while (lru_.size() > lru_cap) {
      Entry& e = *lru_.back();
      lru_.Erase(&e);
      e.lfu_it = lfu_.insert({e.freq, e.key}).first;
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
      Entry& e = *rows_.at(k);
      if (e.dirty) {
        keys.push_back(k);
        rows.insert(rows.end(), e.row(), e.row() + row_);
      }
      drop.push_back(k);
    }
    if (!keys.empty()) {
      // Written (appended) before the memory goes; acknowledged by the next
      // Flush()/Sync like every other SSD write.
      Status s = ssd_->Put(keys, rows);
      if (!s.ok()) {
        // Nothing leaves memory: the victims go back to the LFU.
        for (uint64_t k : drop) {
          Entry& e = *rows_.at(k);
          e.lfu_it = lfu_.insert({e.freq, k}).first;
        }
        return s;
      }
      stats_.flushed_rows += keys.size();
    }
    stats_.evicted_to_ssd += drop.size();
    for (uint64_t k : drop) {
      auto it = rows_.find(k);
      arena_.Free(it->second);
      rows_.erase(it);
    }
    return Status::Ok();
  }

  MemTierOptions opt_;
  SsdStore* ssd_;
  const uint32_t row_;
  uint64_t capacity_ = 0;  // rows
  mutable Mutex mu_;
  // An open-addressing map (one probe into contiguous slots per lookup,
  // where std::unordered_map chased a bucket and a node): lookups were a
  // third of a memory node's CPU in the CTR run (docs/results/ctr.md).
  // Entries live in arena_; the map points at them.
  EntryArena arena_ MEMBOX_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, Entry*> rows_ MEMBOX_GUARDED_BY(mu_);
  LruList lru_;                                  // front: newest
  std::set<std::pair<uint64_t, uint64_t>> lfu_;  // (freq, key)
  // batch -> the rows it pinned (a row once per time it was pinned)
  absl::flat_hash_map<uint64_t, std::vector<Entry*>> batches_;
  uint64_t marks_ = 0;
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
