#include "src/ps/state_copy.h"

#include <atomic>
#include <cstring>
#include <map>
#include <set>
#include <utility>

#include "membox/base/mutex.h"
#include "membox/base/wire.h"

namespace membox::ps {
namespace {

using transport::MemRegion;
using transport::RegionDescriptor;
using wire::Crc32;
using wire::Reader;
using wire::Writer;

constexpr char kMagic[8] = {'M', 'B', 'X', 'S', 'T', 'A', 'T', '1'};
constexpr char kEnd[4] = {'E', 'N', 'D', '!'};
// 2: the held keys after the shards. 3: the stale-value flag. 4: the
// striped and held-round flags.
constexpr uint32_t kFormat = 4;
constexpr uint64_t kMaxKeyBytes = 1ull << 40;
constexpr uint32_t kMaxDescriptor = 8192;
constexpr uint8_t kHasValue = 1, kHasM1 = 2, kHasM2 = 4, kStaleValue = 8,
                  kStriped = 16, kHeldRound = 32;
// key, shard, dtype, key_bytes, shard_bytes, version, bytes, buffers, and
// one descriptor's length: the least a record takes.
constexpr size_t kMinRecord = 8 + 4 + 1 + 8 + 8 + 8 + 8 + 1 + 4;
// key, dtype, key_bytes, shard_bytes
constexpr size_t kKeyRecord = 8 + 1 + 8 + 8;

Status Damaged(const std::string& what) {
  return DataLossError("state manifest is damaged: " + what);
}

void PutDescriptor(Writer& w, const RegionDescriptor& d) {
  auto b = d.Serialize();
  w.U32(static_cast<uint32_t>(b.size()));
  w.Bytes(b.data(), b.size());
}

Status GetDescriptor(Reader& r, uint64_t bytes, RegionDescriptor* out) {
  uint32_t n = 0;
  std::span<const uint8_t> b;
  if (!r.U32(&n) || n == 0 || n > kMaxDescriptor || !r.View(&b, n)) {
    return Damaged("truncated or oversized region descriptor");
  }
  auto d = RegionDescriptor::Deserialize(b);
  if (!d.ok())
    return Damaged("bad region descriptor: " + d.status().ToString());
  if (d->length < bytes) return Damaged("a region is shorter than its shard");
  *out = std::move(*d);
  return Status::Ok();
}

}  // namespace

std::vector<uint8_t> EncodeStateManifest(const StateManifest& m) {
  Writer w;
  w.Bytes(kMagic, sizeof(kMagic));
  w.U32(kFormat);
  w.U32(m.proxy_rank);
  w.U32(static_cast<uint32_t>(m.shards.size()));
  for (const auto& s : m.shards) {
    PutShardHeader(w, s);
    w.U64(s.bytes);
    w.U8(kHasValue | (s.m1 ? kHasM1 : 0) | (s.m2 ? kHasM2 : 0) |
         (s.stale_value ? kStaleValue : 0) | (s.striped ? kStriped : 0) |
         (s.held_round ? kHeldRound : 0));
    PutDescriptor(w, s.value);
    if (s.m1) PutDescriptor(w, *s.m1);
    if (s.m2) PutDescriptor(w, *s.m2);
  }
  w.U32(static_cast<uint32_t>(m.keys.size()));
  for (const auto& k : m.keys) {
    w.U64(k.key);
    w.U8(k.dtype);
    w.U64(k.key_bytes);
    w.U64(k.shard_bytes);
  }
  auto& b = w.buffer();
  w.U32(Crc32(b.data(), b.size()));
  w.Bytes(kEnd, sizeof(kEnd));
  return std::move(w.buffer());
}

Status ParseStateManifest(std::span<const uint8_t> bytes, StateManifest* out) {
  constexpr size_t kHeader = sizeof(kMagic) + 4 + 4 + 4;
  constexpr size_t kTrailer = 4 + sizeof(kEnd);
  if (bytes.size() < kHeader + kTrailer) return Damaged("truncated");
  const size_t body = bytes.size() - kTrailer;
  Reader tail(bytes.subspan(body));
  uint32_t crc = 0;
  char end[4];
  if (!tail.U32(&crc) || !tail.Copy(end, sizeof(end)) ||
      std::memcmp(end, kEnd, sizeof(kEnd)) != 0) {
    return Damaged("no end marker");
  }
  if (Crc32(bytes.data(), body) != crc) return Damaged("checksum mismatch");

  Reader r(bytes.first(body));
  char magic[8];
  uint32_t format = 0, count = 0;
  StateManifest m;
  if (!r.Copy(magic, sizeof(magic)) ||
      std::memcmp(magic, kMagic, sizeof(kMagic)) != 0) {
    return Damaged("bad magic");
  }
  if (!r.U32(&format) || format != kFormat) {
    return Damaged("unknown format " + std::to_string(format));
  }
  if (!r.U32(&m.proxy_rank) || !r.U32(&count)) return Damaged("truncated");
  if (count > r.remaining() / kMinRecord) {
    return Damaged("more shards than bytes");
  }
  m.shards.reserve(count);
  std::set<std::pair<uint64_t, uint32_t>> seen;
  for (uint32_t i = 0; i < count; ++i) {
    OfferedShard s;
    uint8_t buffers = 0;
    if (!GetShardHeader(r, &s) || !r.U64(&s.bytes) || !r.U8(&buffers)) {
      return Damaged("truncated shard record");
    }
    const std::string where =
        "key " + std::to_string(s.key) + " shard " + std::to_string(s.shard);
    if (s.dtype < 1 || s.dtype > static_cast<uint8_t>(DType::kUInt8)) {
      return Damaged(where + ": unknown dtype");
    }
    if (s.key_bytes == 0 || s.key_bytes > kMaxKeyBytes || s.shard_bytes == 0 ||
        s.shard_bytes > s.key_bytes) {
      return Damaged(where + ": bad key or shard size");
    }
    const uint64_t shards = (s.key_bytes + s.shard_bytes - 1) / s.shard_bytes;
    if (s.shard >= shards) return Damaged(where + ": no such shard");
    const uint64_t offset = uint64_t{s.shard} * s.shard_bytes;
    if (s.bytes != std::min(s.shard_bytes, s.key_bytes - offset)) {
      return Damaged(where + ": size does not follow from the key's");
    }
    // A stale value comes only with keys without optimizer state; a held
    // round too, of a striped key, with the giver's current value.
    if ((buffers & kHasValue) == 0 ||
        (buffers & ~(kHasValue | kHasM1 | kHasM2 | kStaleValue | kStriped |
                     kHeldRound)) != 0 ||
        ((buffers & kHasM2) && !(buffers & kHasM1)) ||
        ((buffers & kStaleValue) && (buffers & kHasM1)) ||
        ((buffers & kHeldRound) &&
         ((buffers & (kHasM1 | kStaleValue)) || !(buffers & kStriped)))) {
      return Damaged(where + ": bad buffer set");
    }
    s.stale_value = buffers & kStaleValue;
    s.striped = buffers & kStriped;
    s.held_round = buffers & kHeldRound;
    RETURN_IF_ERROR(GetDescriptor(r, s.bytes, &s.value).WithContext(where));
    if (buffers & kHasM1) {
      RETURN_IF_ERROR(
          GetDescriptor(r, s.bytes, &s.m1.emplace()).WithContext(where));
    }
    if (buffers & kHasM2) {
      RETURN_IF_ERROR(
          GetDescriptor(r, s.bytes, &s.m2.emplace()).WithContext(where));
    }
    if (!seen.insert({s.key, s.shard}).second) {
      return Damaged(where + ": given twice");
    }
    m.shards.push_back(std::move(s));
  }
  uint32_t keys = 0;
  if (!r.U32(&keys)) return Damaged("truncated: no key list");
  if (keys > r.remaining() / kKeyRecord) return Damaged("more keys than bytes");
  std::map<uint64_t, const HeldKey*> listed;
  m.keys.resize(keys);
  for (HeldKey& k : m.keys) {
    if (!r.U64(&k.key) || !r.U8(&k.dtype) || !r.U64(&k.key_bytes) ||
        !r.U64(&k.shard_bytes)) {
      return Damaged("truncated key record");
    }
    const std::string where = "held key " + std::to_string(k.key);
    if (k.dtype < 1 || k.dtype > static_cast<uint8_t>(DType::kUInt8)) {
      return Damaged(where + ": unknown dtype");
    }
    if (k.key_bytes == 0 || k.key_bytes > kMaxKeyBytes || k.shard_bytes == 0 ||
        k.shard_bytes > k.key_bytes) {
      return Damaged(where + ": bad key or shard size");
    }
    if (!listed.emplace(k.key, &k).second) {
      return Damaged(where + ": given twice");
    }
  }
  // An offered shard's key, where listed, has the same geometry.
  for (const OfferedShard& s : m.shards) {
    auto it = listed.find(s.key);
    if (it != listed.end() &&
        (it->second->dtype != s.dtype || it->second->key_bytes != s.key_bytes ||
         it->second->shard_bytes != s.shard_bytes)) {
      return Damaged("key " + std::to_string(s.key) +
                     ": its shards and its key record disagree");
    }
  }
  if (r.remaining() != 0) return Damaged("bytes after the key list");
  *out = std::move(m);
  return Status::Ok();
}

Result<std::unique_ptr<StateOffer>> StateOffer::Make(
    transport::Device& device, uint32_t giver_rank,
    const std::vector<Item>& items, std::vector<HeldKey> keys) {
  std::unique_ptr<StateOffer> offer(new StateOffer());
  ASSIGN_OR_RETURN(InlineOffer in,
                   MakeInlineOffer(giver_rank, items, std::move(keys)));
  ASSIGN_OR_RETURN(offer->manifest_,
                   device.AllocateMemRegion(in.manifest.size()));
  std::memcpy(offer->manifest_->data(), in.manifest.data(), in.manifest.size());
  offer->manifest_bytes_ = in.manifest.size();
  offer->shards_ = items.size();
  for (const Item& it : items) {
    const StoredShard& sh = *it.stored;
    offer->state_bytes_ +=
        StateBytes(sh.bytes, sh.m1 != nullptr, sh.m1 && sh.m2);
  }
  offer->keep_ = std::move(in.keep);
  return offer;
}

Result<InlineOffer> MakeInlineOffer(uint32_t giver_rank,
                                    const std::vector<StateOffer::Item>& items,
                                    std::vector<HeldKey> keys) {
  InlineOffer offer;
  StateManifest m;
  m.proxy_rank = giver_rank;
  m.keys = std::move(keys);
  m.shards.reserve(items.size());
  for (const StateOffer::Item& it : items) {
    const StoredShard& sh = *it.stored;
    if (!sh.value) {
      return InternalError("offering a shard without a value");
    }
    OfferedShard s;
    s.key = it.key;
    s.shard = it.shard;
    s.dtype = static_cast<uint8_t>(it.dtype);
    s.key_bytes = it.key_bytes;
    s.shard_bytes = it.shard_bytes;
    s.version = sh.version;
    s.bytes = sh.bytes;
    s.stale_value = sh.value_stale;
    s.striped = it.striped;
    s.held_round = it.held_round;
    s.value = sh.value->Export();
    offer.keep.push_back(sh.value);
    // m2 without m1 does not occur (Adam has both, SGD with momentum m1).
    if (sh.m1) {
      s.m1 = sh.m1->Export();
      offer.keep.push_back(sh.m1);
      if (sh.m2) {
        s.m2 = sh.m2->Export();
        offer.keep.push_back(sh.m2);
      }
    }
    m.shards.push_back(std::move(s));
  }
  offer.manifest = EncodeStateManifest(m);
  return offer;
}

Result<StateManifest> ReadStateManifest(transport::Channel& channel,
                                        transport::Device& device,
                                        std::span<const uint8_t> descriptor,
                                        uint64_t bytes, uint32_t giver_rank,
                                        std::chrono::nanoseconds timeout) {
  ASSIGN_OR_RETURN(auto desc, RegionDescriptor::Deserialize(descriptor));
  // A manifest takes a few hundred bytes per shard; 1 GiB is far beyond
  // any real one and keeps a lying peer from making us allocate more.
  if (bytes == 0 || desc.length < bytes || bytes > (1ull << 30)) {
    return DataLossError("the peer's state manifest has a bad length");
  }
  ASSIGN_OR_RETURN(auto remote, channel.Import(desc, timeout));
  ASSIGN_OR_RETURN(std::unique_ptr<MemRegion> local,
                   device.AllocateMemRegion(bytes));
  ASSIGN_OR_RETURN(auto h, channel.Read(local->data(), *local,
                                        remote->address(), *remote, bytes));
  RETURN_IF_ERROR(h.Wait(timeout));
  StateManifest m;
  RETURN_IF_ERROR(
      ParseStateManifest(std::span<const uint8_t>(
                             static_cast<const uint8_t*>(local->data()), bytes),
                         &m));
  if (m.proxy_rank != giver_rank) {
    return DataLossError("the state manifest is proxy " +
                         std::to_string(m.proxy_rank) + "'s, not proxy " +
                         std::to_string(giver_rank) + "'s");
  }
  return m;
}

Result<std::vector<CopiedShard>> CopyShards(
    transport::Channel& channel, const std::vector<const OfferedShard*>& shards,
    const CopyAllocator& allocate, std::chrono::nanoseconds timeout) {
  std::vector<CopiedShard> out;
  out.reserve(shards.size());
  // Declared before the handles: destroyed after them, so a read that fails
  // midway is waited for (~OpHandle) before its buffers go.
  std::vector<std::shared_ptr<transport::RemoteMemRegion>> remotes;
  std::vector<transport::OpHandle> reads;
  Status first;
  auto start = [&](const RegionDescriptor& d, uint64_t n,
                   std::shared_ptr<MemRegion>* into) -> Status {
    // The descriptor came from an authenticated peer in the manifest it
    // wrote: no round trip to verify it (the one-sided read is still
    // checked against the region's range by the transport; the parser
    // checked the region covers the shard).
    ASSIGN_OR_RETURN(auto remote, channel.Import(d, timeout, false));
    ASSIGN_OR_RETURN(*into, allocate(n));
    ASSIGN_OR_RETURN(
        auto h, channel.Read((*into)->data(), **into, d.address, *remote, n));
    remotes.push_back(std::move(remote));
    reads.push_back(std::move(h));
    return Status::Ok();
  };
  for (const OfferedShard* s : shards) {
    CopiedShard c;
    c.offer = s;
    Status st = start(s->value, s->bytes, &c.value);
    if (st.ok() && s->m1) st = start(*s->m1, s->bytes, &c.m1);
    if (st.ok() && s->m2) st = start(*s->m2, s->bytes, &c.m2);
    out.push_back(std::move(c));
    if (!st.ok()) {
      first = st.WithContext("key " + std::to_string(s->key) + " shard " +
                             std::to_string(s->shard));
      break;
    }
  }
  for (auto& h : reads) {
    Status st = h.Wait(timeout);
    if (first.ok() && !st.ok()) first = st;
  }
  if (!first.ok()) return first;
  return out;
}

void StartCopyShard(transport::Channel& channel, const OfferedShard& shard,
                    const CopyAllocator& allocate,
                    const std::function<void(transport::OpHandle)>& track,
                    std::function<void(Result<CopiedShard>)> done,
                    const RegionImporter& import) {
  // Shared by the reads' completions; the last one reports.
  struct Copy {
    CopiedShard got;
    std::vector<std::shared_ptr<transport::RemoteMemRegion>> remotes;
    std::atomic<int> left{0};
    Mutex mu;
    Status first MEMBOX_GUARDED_BY(mu);
    std::function<void(Result<CopiedShard>)> done;
    void Finished(const Status& st) {
      if (!st.ok()) {
        MutexLock l(&mu);
        if (first.ok()) first = st;
      }
      if (left.fetch_sub(1) != 1) return;
      Status f;
      {
        MutexLock l(&mu);
        f = first;
      }
      remotes.clear();
      if (f.ok()) {
        done(std::move(got));
      } else {
        done(f);
      }
    }
  };
  auto copy = std::make_shared<Copy>();
  copy->got.offer = &shard;
  copy->done = std::move(done);
  struct Part {
    const RegionDescriptor* desc;
    std::shared_ptr<MemRegion>* into;
  };
  std::vector<Part> parts = {{&shard.value, &copy->got.value}};
  if (shard.m1) parts.push_back({&*shard.m1, &copy->got.m1});
  if (shard.m2) parts.push_back({&*shard.m2, &copy->got.m2});
  copy->left = static_cast<int>(parts.size());
  for (const Part& part : parts) {
    Status st = [&]() -> Status {
      // From an authenticated peer's manifest: no round trip to verify it
      // (the read is still checked against the region's range).
      ASSIGN_OR_RETURN(
          auto remote,
          import ? import(*part.desc)
                 : channel.Import(*part.desc, std::chrono::seconds(30), false));
      ASSIGN_OR_RETURN(*part.into, allocate(shard.bytes));
      {
        MutexLock l(&copy->mu);
        copy->remotes.push_back(remote);
      }
      ASSIGN_OR_RETURN(
          auto h, channel.Read((*part.into)->data(), **part.into,
                               part.desc->address, *remote, shard.bytes,
                               [copy](const Status& s) { copy->Finished(s); }));
      track(std::move(h));
      return Status::Ok();
    }();
    if (!st.ok()) {
      copy->Finished(st.WithContext("key " + std::to_string(shard.key) +
                                    " shard " + std::to_string(shard.shard)));
    }
  }
}

}  // namespace membox::ps
