#include "src/ps/checkpoint.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "membox/base/durable_file.h"
#include "membox/base/wire.h"

namespace membox::ps {
namespace {

using wire::Crc32;
using wire::Reader;
using wire::Writer;

constexpr char kMagic[8] = {'M', 'B', 'X', 'C', 'K', 'P', 'T', '1'};
// 1: no per-shard flags. 2: a flags byte after each shard's version
// (bit 0: the value is stale and not written). Both are read.
constexpr uint32_t kFormat = 2;
constexpr uint8_t kValueStale = 1;
constexpr uint64_t kMaxShardBytes = 64ull << 30;

void PutBlob(Writer& w, std::span<const uint8_t> b) {
  w.U64(b.size());
  w.U32(Crc32(b.data(), b.size()));
  w.Bytes(b.data(), b.size());
}

Status Damaged(const std::string& what) {
  return DataLossError("checkpoint is damaged: " + what);
}

bool GetBlob(Reader& r, std::span<const uint8_t>* out, Status* err,
             const char* what) {
  uint64_t n = 0;
  uint32_t crc = 0;
  if (!r.U64(&n) || !r.U32(&crc) || n > kMaxShardBytes || n > r.remaining() ||
      !r.View(out, n)) {
    *err = Damaged(std::string("truncated ") + what);
    return false;
  }
  if (Crc32(out->data(), out->size()) != crc) {
    *err = Damaged(std::string("checksum mismatch in ") + what);
    return false;
  }
  return true;
}

}  // namespace

void PutShardHeader(Writer& w, const ShardHeader& h) {
  w.U64(h.key);
  w.U32(h.shard);
  w.U8(h.dtype);
  w.U64(h.key_bytes);
  w.U64(h.shard_bytes);
  w.U64(h.version);
}

bool GetShardHeader(Reader& r, ShardHeader* h) {
  return r.U64(&h->key) && r.U32(&h->shard) && r.U8(&h->dtype) &&
         r.U64(&h->key_bytes) && r.U64(&h->shard_bytes) && r.U64(&h->version);
}

Status EncodeCheckpoint(const CheckpointHeader& header,
                        const std::vector<CheckpointShard>& shards,
                        const CheckpointSink& sink) {
  // Header + per-shard metadata are encoded in memory; shard data goes to
  // the sink as it is, so a large model is never copied twice.
  Status s;
  uint32_t crc = 0;  // running checksum of the record headers
  auto emit = [&](Writer& w) {
    if (!s.ok()) return;
    crc = Crc32(&crc, 4) ^ Crc32(w.buffer().data(), w.buffer().size());
    s = sink(w.buffer().data(), w.buffer().size());
  };
  {
    Writer w;
    w.Bytes(kMagic, 8);
    w.U32(kFormat);
    w.U32(header.proxy_rank);
    w.U32(header.proxies);
    w.U8(header.mode);
    w.U8(header.optimizer);
    w.U64(shards.size());
    emit(w);
  }
  for (const auto& sh : shards) {
    Writer w;
    PutShardHeader(w, sh);
    w.U8(sh.value_stale ? kValueStale : 0);
    w.U64(sh.value.size());
    w.U32(Crc32(sh.value.data(), sh.value.size()));
    emit(w);
    if (s.ok()) s = sink(sh.value.data(), sh.value.size());
    Writer w2;
    PutBlob(w2, sh.m1);
    PutBlob(w2, sh.m2);
    emit(w2);
  }
  Writer w;
  w.U32(crc);
  w.Bytes("END!", 4);
  if (s.ok()) s = sink(w.buffer().data(), w.buffer().size());
  return s;
}

Status WriteCheckpoint(const std::string& path, const CheckpointHeader& header,
                       const std::vector<CheckpointShard>& shards) {
  return ReplaceFileDurably(path, [&](const FileSink& sink) {
    return EncodeCheckpoint(header, shards, sink);
  });
}

Status ParseCheckpoint(std::span<const uint8_t> bytes, CheckpointHeader* header,
                       std::vector<CheckpointShard>* shards) {
  shards->clear();
  Reader r(bytes);
  std::vector<uint8_t> magic;
  uint32_t format = 0;
  uint64_t count = 0;
  size_t mark = 0;
  uint32_t crc = 0;
  auto fold = [&](size_t from, size_t to) {
    crc = Crc32(&crc, 4) ^ Crc32(bytes.data() + from, to - from);
  };
  if (!r.Bytes(&magic, 8) || std::memcmp(magic.data(), kMagic, 8) != 0) {
    return Damaged("not a membox checkpoint (bad magic)");
  }
  if (!r.U32(&format) || format < 1 || format > kFormat) {
    return Damaged("unsupported format version " + std::to_string(format));
  }
  if (!r.U32(&header->proxy_rank) || !r.U32(&header->proxies) ||
      !r.U8(&header->mode) || !r.U8(&header->optimizer) || !r.U64(&count)) {
    return Damaged("truncated header");
  }
  if (header->proxies == 0 || header->proxy_rank >= header->proxies ||
      count > (1u << 24)) {
    return Damaged("implausible header");
  }
  fold(mark, r.consumed());
  for (uint64_t i = 0; i < count; ++i) {
    mark = r.consumed();
    CheckpointShard sh;
    uint64_t n = 0;
    uint32_t vcrc = 0;
    uint8_t flags = 0;
    if (!GetShardHeader(r, &sh) || (format >= 2 && !r.U8(&flags)) ||
        !r.U64(&n) || !r.U32(&vcrc)) {
      return Damaged("truncated shard record " + std::to_string(i));
    }
    fold(mark, r.consumed());
    if ((flags & ~kValueStale) != 0) {
      return Damaged("unknown flags in shard record " + std::to_string(i));
    }
    sh.value_stale = flags & kValueStale;
    // A stale value is its version alone: no bytes.
    if ((sh.value_stale ? n != 0 : n == 0) || n > kMaxShardBytes ||
        n > r.remaining() || sh.shard_bytes == 0 || sh.key_bytes == 0 ||
        n > sh.key_bytes) {
      return Damaged("bad size in shard record " + std::to_string(i));
    }
    if (!r.View(&sh.value, n)) return Damaged("truncated value");
    if (Crc32(sh.value.data(), n) != vcrc) {
      return Damaged("checksum mismatch in key " + std::to_string(sh.key) +
                     " shard " + std::to_string(sh.shard));
    }
    mark = r.consumed();
    Status err;
    if (!GetBlob(r, &sh.m1, &err, "optimizer state") ||
        !GetBlob(r, &sh.m2, &err, "optimizer state")) {
      return err;
    }
    if (sh.value_stale && (!sh.m1.empty() || !sh.m2.empty())) {
      // Only sums (no optimizer) are backed up by their version.
      return Damaged("a stale value with optimizer state in key " +
                     std::to_string(sh.key));
    }
    if ((!sh.m1.empty() && sh.m1.size() != n) ||
        (!sh.m2.empty() && sh.m2.size() != n)) {
      return Damaged("optimizer state size differs from the value's");
    }
    fold(mark, r.consumed());
    shards->push_back(std::move(sh));
  }
  uint32_t want = 0;
  std::vector<uint8_t> end;
  if (!r.U32(&want) || !r.Bytes(&end, 4) ||
      std::memcmp(end.data(), "END!", 4) != 0) {
    return Damaged("truncated (no end marker)");
  }
  if (want != crc) return Damaged("header checksum mismatch");
  if (r.remaining() != 0) return Damaged("trailing bytes");
  return Status::Ok();
}

Status ReadCheckpoint(const std::string& path, CheckpointHeader* header,
                      std::vector<CheckpointShard>* shards) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return NotFoundError("no checkpoint at " + path);
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)),
                             std::istreambuf_iterator<char>());
  Status s = ParseCheckpoint(bytes, header, shards);
  if (!s.ok()) return Status(s.code(), path + ": " + std::string(s.message()));
  for (auto& sh : *shards) {  // own the bytes: `bytes` goes now
    auto own = [](std::span<const uint8_t>& view, std::vector<uint8_t>& mine) {
      mine.assign(view.begin(), view.end());
      view = mine;
    };
    own(sh.value, sh.owned_value);
    own(sh.m1, sh.owned_m1);
    own(sh.m2, sh.owned_m2);
  }
  return s;
}

}  // namespace membox::ps
