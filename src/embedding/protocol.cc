#include "src/embedding/protocol.h"

#include <algorithm>

#include "membox/base/wire.h"
#include "membox/service/envelope.h"
#include "membox/transport/channel.h"

namespace membox::embedding::proto {
namespace {

using wire::GetBool;
using wire::GetF64;
using wire::GetStr;
using wire::PutF64;
using wire::PutStr;
using wire::Reader;
using wire::Writer;

constexpr uint8_t kMagic = 'E';
// 2: pulls and pushes carry sections; 3: inside the service envelope (the
// request id, method and error travel there); 4: a hello carries the
// client id and rejoin flag, a push its sequence number (resent pushes);
// 5: the nodes' replication (replicate, fetch-replica); 6: a reply's
// floor; 7: where and announce, a hello's reply names the node's place.
constexpr uint8_t kVersion = 7;

Status Bad(const char* what) {
  return InvalidArgumentError(std::string("malformed embedding message: ") +
                              what);
}

void PutKeys(Writer& w, const std::vector<uint64_t>& k) {
  w.U32(static_cast<uint32_t>(k.size()));
  w.Bytes(k.data(), k.size() * 8);
}

bool GetKeys(Reader& r, std::vector<uint64_t>* k) {
  uint32_t n = 0;
  if (!r.U32(&n) || n > kMaxKeys || uint64_t(n) * 8 > r.remaining()) {
    return false;
  }
  k->resize(n);
  return r.Copy(k->data(), size_t(n) * 8);
}

void PutValues(Writer& w, const std::vector<float>& v) {
  w.U32(static_cast<uint32_t>(v.size()));
  w.Bytes(v.data(), v.size() * 4);
}

bool GetValues(Reader& r, std::vector<float>* v) {
  uint32_t n = 0;
  if (!r.U32(&n) || n > kMaxValues || uint64_t(n) * 4 > r.remaining()) {
    return false;
  }
  v->resize(n);
  return r.Copy(v->data(), size_t(n) * 4);
}

// Sections: u32 count (<= kMaxSections, each at least 8 bytes), then per
// section table u32, keys[, release bool, values]; totals within kMaxKeys
// and kMaxValues.
bool GetSections(Reader& r, bool push, std::vector<Section>* out) {
  uint32_t n = 0;
  if (!r.U32(&n) || n > kMaxSections || uint64_t(n) * 8 > r.remaining()) {
    return false;
  }
  out->resize(n);
  size_t keys = 0, values = 0;
  for (Section& s : *out) {
    if (!r.U32(&s.table_id) || !GetKeys(r, &s.keys)) return false;
    if (push && (!GetBool(r, &s.release) || !GetValues(r, &s.values))) {
      return false;
    }
    keys += s.keys.size();
    values += s.values.size();
    if (keys > kMaxKeys || values > kMaxValues) return false;
  }
  return true;
}

void PutTable(Writer& w, const TableConfig& t) {
  PutStr(w, t.name);
  w.U32(t.dim);
  w.U8(static_cast<uint8_t>(t.optimizer));
  PutF64(w, t.lr);
  PutF64(w, t.eps);
  PutF64(w, t.beta1);
  PutF64(w, t.beta2);
  PutF64(w, t.initial_accumulator);
  w.U64(t.seed);
  PutF64(w, t.init_scale);
}

bool GetTable(Reader& r, TableConfig* t) {
  uint8_t opt = 0;
  bool ok = GetStr(r, &t->name, kMaxName) && r.U32(&t->dim) && r.U8(&opt) &&
            opt <= 2 && GetF64(r, &t->lr) && GetF64(r, &t->eps) &&
            GetF64(r, &t->beta1) && GetF64(r, &t->beta2) &&
            GetF64(r, &t->initial_accumulator) && r.U64(&t->seed) &&
            GetF64(r, &t->init_scale);
  t->optimizer = static_cast<RowOptimizer>(opt);
  return ok;
}

// u32 count (<= kMaxApplied, 24 bytes each), then (client, floor, seq).
bool GetApplied(Reader& r, std::vector<Applied>* out) {
  uint32_t n = 0;
  if (!r.U32(&n) || n > kMaxApplied || uint64_t(n) * 24 > r.remaining()) {
    return false;
  }
  out->resize(n);
  for (Applied& a : *out) {
    if (!r.U64(&a.client) || !r.U64(&a.floor) || !r.U64(&a.seq)) return false;
  }
  return true;
}

}  // namespace

const char* TypeName(Type t) {
  switch (t) {
    case Type::kHello:
      return "hello";
    case Type::kOpenTable:
      return "open-table";
    case Type::kPull:
      return "pull";
    case Type::kPush:
      return "push";
    case Type::kRelease:
      return "release";
    case Type::kFlush:
      return "flush";
    case Type::kStats:
      return "stats";
    case Type::kReply:
      return "reply";
    case Type::kReplicate:
      return "replicate";
    case Type::kFetchReplica:
      return "fetch-replica";
    case Type::kWhere:
      return "where";
    case Type::kAnnounce:
      return "announce";
  }
  return "?";
}

size_t RowBytes(uint32_t dim) {
  return 8 + size_t(std::max<uint32_t>(dim, 1)) * 4;
}

uint32_t MaxKeysPerMessage(uint32_t dim) {
  static_assert(kMessageBudget + kHeaderSlack ==
                transport::Channel::kMaxControlMessage);
  size_t budget = kMessageBudget - kSectionBytes;
  size_t per_key = RowBytes(dim);
  size_t n = std::min<size_t>(budget / per_key, kMaxKeys);
  n = std::min<size_t>(n, kMaxValues / std::max<uint32_t>(dim, 1));
  return static_cast<uint32_t>(std::max<size_t>(n, 1));
}

std::vector<uint8_t> Encode(const Message& m) {
  // Pulls and pushes are sized up front: a 1 MiB push is written once, not
  // regrown and copied as it fills.
  size_t body = 64;
  for (const Section& s : m.sections) {
    body += kSectionBytes + s.keys.size() * 8 + s.values.size() * 4;
  }
  Writer w(service::NewMessage(body));
  w.U8(kMagic);
  w.U8(kVersion);
  switch (m.type) {
    case Type::kHello:
      PutStr(w, m.name);
      w.U64(m.client_id);
      w.U8(m.rejoin ? 1 : 0);
      break;
    case Type::kOpenTable:
      PutTable(w, m.table);
      break;
    case Type::kReplicate:
      PutStr(w, m.name);
      PutTable(w, m.table);
      w.U64(m.seq);
      w.U8(m.rejoin ? 1 : 0);
      w.U32(static_cast<uint32_t>(m.sections.size()));
      for (const Section& s : m.sections) {
        PutKeys(w, s.keys);
        PutValues(w, s.values);
      }
      w.U32(static_cast<uint32_t>(m.applied.size()));
      for (const Applied& a : m.applied) {
        w.U64(a.client);
        w.U64(a.floor);
        w.U64(a.seq);
      }
      break;
    case Type::kFetchReplica:
      PutStr(w, m.name);
      w.U32(m.table_id);
      w.U64(m.seq);
      break;
    case Type::kPull:
    case Type::kPush:
      w.U64(m.batch);
      if (m.type == Type::kPush) {
        w.U64(m.seq);
        w.U64(m.floor);
      }
      w.U32(static_cast<uint32_t>(m.sections.size()));
      for (const Section& s : m.sections) {
        w.U32(s.table_id);
        PutKeys(w, s.keys);
        if (m.type == Type::kPush) {
          w.U8(s.release ? 1 : 0);
          PutValues(w, s.values);
        }
      }
      break;
    case Type::kRelease:
      w.U32(m.table_id);
      w.U64(m.batch);
      break;
    case Type::kWhere:
      w.U32(m.table_id);
      break;
    case Type::kAnnounce:
      w.U32(m.table_id);
      PutStr(w, m.name);
      break;
    case Type::kFlush:
    case Type::kStats:
      break;
    case Type::kReply:
      w.U32(m.table_id);
      PutValues(w, m.values);
      PutStr(w, m.text);
      w.U64(m.floor);
      break;
  }
  return std::move(w.buffer());
}

Result<Message> Decode(uint16_t type, std::span<const uint8_t> in) {
  if (type < 1 || type > 12) return Bad("unknown type");
  Reader r(in);
  uint8_t magic = 0, version = 0;
  if (!r.U8(&magic) || magic != kMagic) return Bad("bad magic");
  if (!r.U8(&version) || version != kVersion) return Bad("unknown version");
  Message m;
  m.type = static_cast<Type>(type);
  bool ok = true;
  switch (m.type) {
    case Type::kHello:
      ok = GetStr(r, &m.name, kMaxName) && r.U64(&m.client_id) &&
           GetBool(r, &m.rejoin);
      break;
    case Type::kOpenTable:
      ok = GetTable(r, &m.table);
      break;
    case Type::kReplicate: {
      uint32_t n = 0;
      ok = GetStr(r, &m.name, kMaxName) && GetTable(r, &m.table) &&
           r.U64(&m.seq) && GetBool(r, &m.rejoin) && r.U32(&n) && n <= 1;
      if (ok && n == 1) {
        Section& s = m.sections.emplace_back();
        ok = GetKeys(r, &s.keys) && GetValues(r, &s.values);
      }
      ok = ok && GetApplied(r, &m.applied);
      break;
    }
    case Type::kFetchReplica:
      ok = GetStr(r, &m.name, kMaxName) && r.U32(&m.table_id) && r.U64(&m.seq);
      break;
    case Type::kPull:
    case Type::kPush:
      ok =
          r.U64(&m.batch) &&
          (m.type != Type::kPush || (r.U64(&m.seq) && r.U64(&m.floor) &&
                                     m.floor < std::max<uint64_t>(m.seq, 1))) &&
          GetSections(r, m.type == Type::kPush, &m.sections);
      break;
    case Type::kRelease:
      ok = r.U32(&m.table_id) && r.U64(&m.batch);
      break;
    case Type::kWhere:
      ok = r.U32(&m.table_id) && m.table_id < kMaxPlaces;
      break;
    case Type::kAnnounce:
      ok = r.U32(&m.table_id) && m.table_id < kMaxPlaces &&
           GetStr(r, &m.name, kMaxName) && !m.name.empty();
      break;
    case Type::kFlush:
    case Type::kStats:
      break;
    case Type::kReply:
      ok = r.U32(&m.table_id) && GetValues(r, &m.values) &&
           GetStr(r, &m.text, kMaxText) && r.U64(&m.floor);
      break;
  }
  if (!ok) return Bad(TypeName(m.type));
  if (r.remaining() != 0) return Bad("trailing bytes");
  return m;
}

}  // namespace membox::embedding::proto
