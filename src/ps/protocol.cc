#include "src/ps/protocol.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "membox/base/wire.h"
#include "membox/service/envelope.h"

namespace membox::ps::proto {
namespace {

using wire::GetBytes;
using wire::GetF64;
using wire::GetStr;
using wire::PutBytes;
using wire::PutF64;
using wire::PutStr;
using wire::Reader;
using wire::Writer;

constexpr uint8_t kMagic = 'P';
// 2: per-key optimizers, kTune; 3: inside the service envelope (type =
// the envelope's method; request id, status code and error message travel
// there); 4: AdamW, Adagrad and weight decay, a pull's part; 5: a
// hello's and a rejoin's job.
constexpr uint8_t kVersion = 5;

void PutOptimizer(Writer& w, const Message& m) {
  w.U8(static_cast<uint8_t>(m.optimizer));
  PutF64(w, m.lr);
  PutF64(w, m.momentum);
  PutF64(w, m.beta1);
  PutF64(w, m.beta2);
  PutF64(w, m.eps);
  PutF64(w, m.weight_decay);
}

bool GetOptimizer(Reader& r, Message* m) {
  uint8_t u8 = 0;
  if (!r.U8(&u8) || u8 > static_cast<uint8_t>(Optimizer::kAdagrad)) {
    return false;
  }
  m->optimizer = static_cast<Optimizer>(u8);
  bool ok = GetF64(r, &m->lr) && GetF64(r, &m->momentum) &&
            GetF64(r, &m->beta1) && GetF64(r, &m->beta2) &&
            GetF64(r, &m->eps) && GetF64(r, &m->weight_decay);
  // Written so that NaN fails every comparison.
  return ok && m->lr >= 0 && m->momentum >= 0 && m->momentum < 1 &&
         m->beta1 >= 0 && m->beta1 < 1 && m->beta2 >= 0 && m->beta2 < 1 &&
         m->eps > 0 && std::isfinite(m->lr) && std::isfinite(m->eps) &&
         m->weight_decay >= 0 && std::isfinite(m->weight_decay);
}

Status Bad(const char* what) {
  return InvalidArgumentError(std::string("malformed ps message: ") + what);
}

}  // namespace

uint64_t HelloPlace(uint32_t rank, uint32_t nodes) {
  return (uint64_t{nodes} << 32) | rank;
}

Status CheckHelloPlace(uint64_t version, uint32_t index, uint32_t given,
                       const std::string& endpoint) {
  if (version == 0) return Status::Ok();
  const uint32_t nodes = static_cast<uint32_t>(version >> 32);
  const uint32_t rank = static_cast<uint32_t>(version);
  if (nodes == given && rank == index) return Status::Ok();
  return FailedPreconditionError(
      "the memory node at " + endpoint + " is node " + std::to_string(rank) +
      " of the job's " + std::to_string(nodes) +
      ", but this worker was given " + std::to_string(given) +
      " node(s) with it as node " + std::to_string(index) +
      ": give every worker the job's whole list of memory nodes, in their "
      "order (MEMBOX_PROXIES, --proxies; what `membox launch` and `membox "
      "cluster` pass)");
}

const char* TypeName(Type t) {
  switch (t) {
    case Type::kHello:
      return "hello";
    case Type::kRegion:
      return "region";
    case Type::kConfigure:
      return "configure";
    case Type::kDeclare:
      return "declare";
    case Type::kPush:
      return "push";
    case Type::kRoute:
      return "route";
    case Type::kPull:
      return "pull";
    case Type::kProbe:
      return "probe";
    case Type::kCheckpoint:
      return "checkpoint";
    case Type::kStats:
      return "stats";
    case Type::kReply:
      return "reply";
    case Type::kPeerHello:
      return "peer-hello";
    case Type::kReady:
      return "ready";
    case Type::kDone:
      return "done";
    case Type::kTune:
      return "tune";
    case Type::kJoin:
      return "join";
    case Type::kJoinDone:
      return "join-done";
    case Type::kResume:
      return "resume";
    case Type::kRejoin:
      return "rejoin";
    case Type::kRejoined:
      return "rejoined";
    case Type::kCatchUp:
      return "catch-up";
    case Type::kCatchUpDone:
      return "catch-up-done";
    case Type::kBackup:
      return "backup";
    case Type::kBackupDone:
      return "backup-done";
    case Type::kBackupStep:
      return "backup-step";
    case Type::kBackupWhole:
      return "backup-whole";
    case Type::kStore:
      return "store";
    case Type::kWhere:
      return "where";
    case Type::kCombine:
      return "combine";
    case Type::kRingAbort:
      return "ring-abort";
    case Type::kFree:
      return "free";
    case Type::kBackupVersion:
      return "backup-version";
    case Type::kClaim:
      return "claim";
  }
  return "?";
}

std::vector<uint8_t> Encode(const Message& m) {
  Writer w(service::NewMessage());
  w.U8(kMagic);
  w.U8(kVersion);
  switch (m.type) {
    case Type::kHello:
    case Type::kPeerHello:
    case Type::kRejoin:
      PutStr(w, m.name);
      w.U32(m.rank);
      w.U32(m.world);
      if (m.type == Type::kPeerHello) PutStr(w, m.endpoint);
      if (m.type != Type::kPeerHello) PutStr(w, m.job);
      break;
    case Type::kWhere:
      w.U32(m.rank);
      break;
    case Type::kClaim:
      w.U32(m.rank);
      w.U32(m.world);
      PutStr(w, m.endpoint);
      break;
    case Type::kRegion:
      PutBytes(w, m.descriptor);
      break;
    case Type::kConfigure:
      w.U8(static_cast<uint8_t>(m.mode));
      w.U32(m.staleness);
      break;
    case Type::kDeclare:
      w.U64(m.key);
      w.U64(m.bytes);
      w.U8(m.dtype);
      w.U64(m.shard_bytes);
      w.U8((m.has_input ? 1 : 0) | (m.striped ? 2 : 0) | (m.stored ? 4 : 0) |
           (m.scratch ? 8 : 0));
      w.U64(m.region);
      w.U64(m.offset);
      PutOptimizer(w, m);
      break;
    case Type::kTune:
      w.U64(m.key);
      w.U64(m.key_end);
      PutOptimizer(w, m);
      break;
    case Type::kPush:
      w.U64(m.key);
      w.U32(m.shard);
      w.U64(m.round);
      w.U64(m.region);
      w.U64(m.offset);
      w.U8((m.has_output ? 1 : 0) | (m.held ? 2 : 0) | (m.had_result ? 4 : 0));
      w.U64(m.out_region);
      w.U64(m.out_offset);
      break;
    case Type::kRoute:
      w.U64(m.threshold);
      w.U32(m.lat_proxy);
      w.U32(m.bw_proxy);
      w.U32(static_cast<uint32_t>(m.from_rounds.size()));
      for (auto& [k, r] : m.from_rounds) {
        w.U64(k);
        w.U64(r);
      }
      break;
    case Type::kStore:
      w.U64(m.key);
      w.U32(m.shard);
      w.U64(m.region);
      w.U64(m.offset);
      w.U8(static_cast<uint8_t>(m.part));
      break;
    case Type::kPull:
      w.U64(m.key);
      w.U32(m.shard);
      w.U64(m.min_version);
      w.U64(m.out_region);
      w.U64(m.out_offset);
      w.U8(static_cast<uint8_t>(m.part));
      break;
    case Type::kProbe:
      w.U64(m.bytes);
      break;
    case Type::kCheckpoint:
      PutStr(w, m.path);
      break;
    case Type::kJoin:
      w.U32(m.rank);
      break;
    case Type::kResume:
      w.U32(m.rank);
      w.U32(m.world);
      break;
    case Type::kStats:
    case Type::kJoinDone:
    case Type::kRejoined:
      break;
    case Type::kReply:
      w.U64(m.version);
      PutStr(w, m.text);
      break;
    case Type::kReady:
    case Type::kDone:
      w.U64(m.key);
      w.U32(m.shard);
      w.U64(m.round);
      w.U32(m.step);
      PutBytes(w, m.descriptor);
      break;
    case Type::kCatchUp:
    case Type::kBackup:
      w.U64(m.key);
      w.U32(m.shard);
      w.U64(m.round);
      w.U64(m.bytes);
      PutBytes(w, m.descriptor);
      break;
    case Type::kBackupDone:
    case Type::kRingAbort:
      w.U64(m.key);
      w.U32(m.shard);
      w.U64(m.round);
      PutStr(w, m.text);
      break;
    case Type::kCatchUpDone:
    case Type::kBackupWhole:
    case Type::kBackupVersion:
      w.U64(m.key);
      w.U32(m.shard);
      w.U64(m.round);
      break;
    case Type::kBackupStep:
      w.U64(m.key);
      w.U32(m.shard);
      w.U64(m.round);
      w.U64(m.bytes);
      PutBytes(w, m.descriptor);
      PutOptimizer(w, m);
      PutF64(w, m.grad_scale);
      break;
    case Type::kCombine:
      w.U64(m.key);
      break;
    case Type::kFree:
      w.U32(static_cast<uint32_t>(m.keys.size()));
      for (uint64_t k : m.keys) w.U64(k);
      break;
  }
  return std::move(w.buffer());
}

Result<Message> Decode(uint16_t type, std::span<const uint8_t> in) {
  Message m;
  if (type < 1 || type > static_cast<uint8_t>(kLastType)) {
    return Bad("unknown type");
  }
  m.type = static_cast<Type>(type);
  Reader r(in);
  uint8_t magic = 0, version = 0;
  if (!r.U8(&magic) || magic != kMagic) return Bad("magic");
  if (!r.U8(&version) || version != kVersion) return Bad("version");
  bool ok = true;
  uint8_t u8 = 0;
  switch (m.type) {
    case Type::kHello:
    case Type::kPeerHello:
    case Type::kRejoin:
      ok = GetStr(r, &m.name, kMaxName) && r.U32(&m.rank) && r.U32(&m.world);
      // world 0 (rank 0): an observer, which may only ask for kStats.
      if (ok && m.type == Type::kHello)
        ok = m.world <= kMaxWorld &&
             (m.world == 0 ? m.rank == 0 : m.rank < m.world);
      if (ok && m.type == Type::kRejoin)
        ok = m.world >= 1 && m.world <= kMaxWorld && m.rank < m.world;
      if (ok && m.type == Type::kPeerHello)
        ok = m.rank < kMaxProxies && GetStr(r, &m.endpoint, kMaxName);
      if (ok && m.type != Type::kPeerHello) ok = GetStr(r, &m.job, kMaxName);
      break;
    case Type::kWhere:
      ok = r.U32(&m.rank) && m.rank < kMaxProxies;
      break;
    case Type::kClaim:
      ok = r.U32(&m.rank) && m.rank < kMaxProxies && r.U32(&m.world) &&
           m.world <= kClaimAfterLoss && GetStr(r, &m.endpoint, kMaxName) &&
           !m.endpoint.empty();
      break;
    case Type::kRegion:
      ok = GetBytes(r, &m.descriptor, kMaxDescriptor) && !m.descriptor.empty();
      break;
    case Type::kConfigure:
      ok = r.U8(&u8) && u8 <= static_cast<uint8_t>(Mode::kAsync);
      m.mode = static_cast<Mode>(u8);
      ok = ok && r.U32(&m.staleness);
      break;
    case Type::kDeclare: {
      uint8_t flags = 0;
      ok = r.U64(&m.key) && r.U64(&m.bytes) && r.U8(&m.dtype) &&
           r.U64(&m.shard_bytes) && r.U8(&flags) && r.U64(&m.region) &&
           r.U64(&m.offset) && GetOptimizer(r, &m);
      ok = ok && m.bytes > 0 && m.shard_bytes > 0 && (flags & ~15u) == 0;
      m.has_input = flags & 1;
      m.striped = flags & 2;
      m.stored = flags & 4;
      m.scratch = flags & 8;
      // A stored key is written by kStore only: no initial value, no
      // optimizer. A scratch key has no optimizer either.
      ok =
          ok && !(m.stored && (m.has_input || m.optimizer != Optimizer::kNone));
      ok = ok && !(m.scratch && m.optimizer != Optimizer::kNone);
      break;
    }
    case Type::kTune:
      ok = r.U64(&m.key) && r.U64(&m.key_end) && m.key < m.key_end &&
           GetOptimizer(r, &m);
      break;
    case Type::kPush:
      ok = r.U64(&m.key) && r.U32(&m.shard) && r.U64(&m.round) &&
           r.U64(&m.region) && r.U64(&m.offset) && r.U8(&u8) &&
           (u8 & ~7u) == 0 && r.U64(&m.out_region) && r.U64(&m.out_offset);
      m.has_output = u8 & 1;
      m.held = u8 & 2;
      m.had_result = u8 & 4;
      // A held push sent again by a worker that had its result: held,
      // and without an output.
      ok = ok && (!m.had_result || (m.held && !m.has_output));
      break;
    case Type::kRoute: {
      uint32_t n = 0;
      ok = r.U64(&m.threshold) && r.U32(&m.lat_proxy) && r.U32(&m.bw_proxy) &&
           r.U32(&n) && m.lat_proxy < kMaxProxies && m.bw_proxy < kMaxProxies &&
           n <= kMaxRouteKeys && n <= r.remaining() / 16;
      for (uint32_t i = 0; ok && i < n; ++i) {
        uint64_t k = 0, rd = 0;
        ok = r.U64(&k) && r.U64(&rd);
        m.from_rounds.emplace_back(k, rd);
      }
      break;
    }
    case Type::kStore: {
      uint8_t part = 0;
      ok = r.U64(&m.key) && r.U32(&m.shard) && r.U64(&m.region) &&
           r.U64(&m.offset) && r.U8(&part) &&
           part <= static_cast<uint8_t>(Part::kMoment2) &&
           part != static_cast<uint8_t>(Part::kPrevious);
      m.part = static_cast<Part>(part);
      break;
    }
    case Type::kPull: {
      uint8_t part = 0;
      ok = r.U64(&m.key) && r.U32(&m.shard) && r.U64(&m.min_version) &&
           r.U64(&m.out_region) && r.U64(&m.out_offset) && r.U8(&part) &&
           part <= static_cast<uint8_t>(Part::kMoment2);
      m.part = static_cast<Part>(part);
      m.has_output = true;
      break;
    }
    case Type::kProbe:
      ok = r.U64(&m.bytes) && m.bytes > 0;
      break;
    case Type::kCheckpoint:
      ok = GetStr(r, &m.path, kMaxName);
      // A bare file name: no directories, nothing hidden.
      ok = ok && m.path.find('/') == std::string::npos &&
           (m.path.empty() || m.path[0] != '.');
      break;
    case Type::kJoin:
      ok = r.U32(&m.rank) && m.rank < kMaxProxies;
      break;
    case Type::kResume:
      ok = r.U32(&m.rank) && m.rank < kMaxProxies && r.U32(&m.world);
      break;
    case Type::kStats:
    case Type::kJoinDone:
    case Type::kRejoined:
      break;
    case Type::kReply:
      ok = r.U64(&m.version) && GetStr(r, &m.text, kMaxText);
      break;
    case Type::kReady:
    case Type::kDone:
      ok = r.U64(&m.key) && r.U32(&m.shard) && r.U64(&m.round) &&
           r.U32(&m.step) && GetBytes(r, &m.descriptor, kMaxDescriptor);
      break;
    case Type::kCatchUp:
    case Type::kBackup:
      ok = r.U64(&m.key) && r.U32(&m.shard) && r.U64(&m.round) && m.round > 0 &&
           r.U64(&m.bytes) && m.bytes > 0 &&
           GetBytes(r, &m.descriptor, kMaxDescriptor);
      break;
    case Type::kBackupDone:
    case Type::kRingAbort:
      ok = r.U64(&m.key) && r.U32(&m.shard) && r.U64(&m.round) &&
           GetStr(r, &m.text, kMaxText);
      break;
    case Type::kCatchUpDone:
    case Type::kBackupWhole:
      ok = r.U64(&m.key) && r.U32(&m.shard) && r.U64(&m.round);
      break;
    case Type::kBackupVersion:
      ok = r.U64(&m.key) && r.U32(&m.shard) && r.U64(&m.round) && m.round > 0;
      break;
    case Type::kBackupStep:
      // A step needs an optimizer; the scale is a positive finite factor.
      ok = r.U64(&m.key) && r.U32(&m.shard) && r.U64(&m.round) && m.round > 0 &&
           r.U64(&m.bytes) && m.bytes > 0 &&
           GetBytes(r, &m.descriptor, kMaxDescriptor) && GetOptimizer(r, &m) &&
           m.optimizer != Optimizer::kNone && GetF64(r, &m.grad_scale) &&
           m.grad_scale > 0 && std::isfinite(m.grad_scale);
      break;
    case Type::kCombine:
      ok = r.U64(&m.key);
      break;
    case Type::kFree: {
      uint32_t n = 0;
      ok = r.U32(&n) && n >= 1 && n <= kMaxFreeKeys && n <= r.remaining() / 8;
      for (uint32_t i = 0; ok && i < n; ++i) {
        uint64_t k = 0;
        ok = r.U64(&k);
        m.keys.push_back(k);
      }
      // Each key once: a repeated one is a confused (or hostile) worker.
      if (ok) {
        std::vector<uint64_t> sorted = m.keys;
        std::sort(sorted.begin(), sorted.end());
        ok = std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end();
      }
      break;
    }
  }
  if (!ok) return Bad(TypeName(m.type));
  if (r.remaining() != 0) return Bad("trailing bytes");
  return m;
}

}  // namespace membox::ps::proto
