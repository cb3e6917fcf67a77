#include "src/ps/client/key_table.h"

#include <string>
#include <utility>

#include "membox/base/copy.h"

#include "src/ps/combine.h"

namespace membox::ps::client {

using proto::Type;
using transport::MemRegion;

void KeyTable::AddRegion(std::unique_ptr<MemRegion> r, bool user) {
  const auto start = reinterpret_cast<uintptr_t>(r->data());
  regions_[start] = std::move(r);
  if (user) user_regions_.insert(start);
}

std::vector<std::unique_ptr<MemRegion>> KeyTable::TakeUserRegionsOverlapping(
    const void* data, size_t bytes) {
  const auto start = reinterpret_cast<uintptr_t>(data);
  std::vector<std::unique_ptr<MemRegion>> taken;
  for (auto it = user_regions_.begin(); it != user_regions_.end();) {
    auto r = regions_.find(*it);
    const uintptr_t b = r->first, e = b + r->second->size();
    if (b < start + bytes && start < e) {
      taken.push_back(std::move(r->second));
      regions_.erase(r);
      it = user_regions_.erase(it);
    } else {
      ++it;
    }
  }
  return taken;
}

Result<std::unique_ptr<MemRegion>> KeyTable::TakeUserRegion(const void* data) {
  const auto start = reinterpret_cast<uintptr_t>(data);
  if (user_regions_.erase(start) == 0) {
    return NotFoundError("no tensor registered at this address");
  }
  auto it = regions_.find(start);
  std::unique_ptr<MemRegion> r = std::move(it->second);
  regions_.erase(it);
  return r;
}

const MemRegion* KeyTable::Locate(const void* p, size_t n) const {
  const auto a = reinterpret_cast<uintptr_t>(p);
  auto it = regions_.upper_bound(a);
  if (it == regions_.begin()) return nullptr;
  --it;
  return it->second->Contains(p, n) ? it->second.get() : nullptr;
}

KeyInfo* KeyTable::Find(uint64_t key) {
  auto it = keys_.find(key);
  return it == keys_.end() ? nullptr : &it->second;
}

const KeyInfo* KeyTable::Find(uint64_t key) const {
  auto it = keys_.find(key);
  return it == keys_.end() ? nullptr : &it->second;
}

uint64_t KeyTable::StagingNeeded(uint64_t key, const void* in,
                                 const void* out) const {
  auto it = keys_.find(key);
  if (it == keys_.end() || it->second.stored || it->second.staging) return 0;
  const uint64_t bytes = it->second.bytes;
  if ((!in || Locate(in, bytes)) && (!out || Locate(out, bytes))) return 0;
  return bytes;
}

std::unique_ptr<MemRegion> KeyTable::SetStaging(uint64_t key,
                                                std::unique_ptr<MemRegion> r) {
  KeyInfo* k = Find(key);
  if (!k || k->staging) return r;
  k->staging = std::move(r);
  return nullptr;
}

bool KeyTable::Holdable(const KeyInfo& k) {
  return k.striped && !k.stored && !k.combined;
}

uint64_t KeyTable::HoldNeeded(uint64_t key) const {
  auto it = keys_.find(key);
  if (it == keys_.end() || it->second.hold || !Holdable(it->second)) return 0;
  return it->second.bytes;
}

std::unique_ptr<MemRegion> KeyTable::SetHold(uint64_t key,
                                             std::unique_ptr<MemRegion> r) {
  KeyInfo* k = Find(key);
  if (!k || k->hold) return r;
  k->hold = std::move(r);
  return nullptr;
}

Result<Op> KeyTable::Prepare(const Submission& s, const Context& c,
                             CompletionCallback* cb) {
  KeyInfo* found = Find(s.key);
  if (!found) {
    return NotFoundError("key " + std::to_string(s.key) +
                         " not declared on this worker");
  }
  KeyInfo& k = *found;
  const void* in = s.in;
  void* out = s.out;
  if (s.state &&
      (k.stored || k.declaration.optimizer == proto::Optimizer::kNone)) {
    return FailedPreconditionError(
        "key " + std::to_string(s.key) +
        " has no optimizer: no state or previous value");
  }
  if (!s.state && (k.stored ? s.type == Type::kPush : s.type == Type::kStore)) {
    return FailedPreconditionError(
        "key " + std::to_string(s.key) +
        (k.stored ? " is a stored key: Store and Pull it"
                  : " is not a stored key: declare it stored to Store it"));
  }
  const MemRegion* in_region = in ? Locate(in, k.bytes) : nullptr;
  const MemRegion* out_region = out ? Locate(out, k.bytes) : nullptr;
  if (k.stored && !(in ? in_region : out_region)) {
    return InvalidArgumentError(
        "stored keys move registered memory (AllocateTensor / "
        "RegisterTensor) only");
  }
  const bool staged = (in && !in_region) || (out && !out_region);
  if (!k.stored && !k.staging && staged) {
    return FailedPreconditionError(
        "key " + std::to_string(s.key) +
        ": its memory was unregistered while submitting");
  }
  Op op;
  op.type = s.type;
  op.part = s.state.value_or(proto::Part::kValue);
  op.priority = s.priority;
  op.key = s.key;
  op.bytes = k.bytes;
  op.shard_bytes = k.shard_bytes;
  op.shards = k.shards;
  op.striped = k.striped;
  op.copies = (s.type == Type::kStore && !k.striped) ? c.proxies : 1;
  op.route = (in && !k.stored && c.route_for)
                 ? c.route_for(s.key, k.next_round())
                 : c.current;
  op.seq = c.seq;
  CompletionCallback done = std::move(*cb);
  if (staged) {
    // The key's staging buffer serves one operation at a time: this one
    // queues behind the last that used it, and the sender wakes when that
    // one finishes (Submit never blocks).
    if (k.last_staged && !k.last_staged->released()) {
      op.after = k.last_staged;
    }
    done = [user = std::move(done), freed = c.staging_freed](const Status& st) {
      if (user) user(st);
      if (freed) freed();
    };
  }
  op.state = std::make_shared<service::CallState>(
      static_cast<int>(k.shards * op.copies), std::move(done));
  if (c.progress) op.state->set_progress(c.progress);
  uint8_t* staging =
      k.staging ? static_cast<uint8_t*>(k.staging->data()) : nullptr;
  // A held push waits for the previous push's answer (so a node that
  // died had answered every worker the round before the one it applied
  // last), and for the staging buffer when its output is staged: held
  // only when one operation covers both.
  std::shared_ptr<service::CallState> held_after;
  bool held =
      c.hold && s.type == Type::kPush && in && !s.state && k.hold &&
      Holdable(k) &&
      !(in_region && in_region->memory_type() == transport::MemoryType::kCuda);
  if (held) {
    auto pending = [](const std::shared_ptr<service::CallState>& st) {
      return st && !st->released() ? st : nullptr;
    };
    auto push = pending(k.last_push);
    auto staged_op = staged ? pending(k.last_staged) : nullptr;
    if (push && staged_op && push != staged_op) {
      held = false;  // this round is backed up by its bytes
    } else {
      held_after = push ? push : staged_op;
    }
  }
  if (held) {
    op.held = true;
    op.after = held_after;
    const uint64_t half = k.next_round() % 2 * k.bytes;
    // Copied shard by shard as the shards go out (Op::copy_in), not here:
    // a large push's first shards are on the wire while its last ones are
    // still copied.
    op.copy_in = in;
    op.copy_to = static_cast<uint8_t*>(k.hold->data()) + half;
    op.in_region = k.hold->id();
    op.in_offset = half;
    if (!k.stored && !s.state) op.round = k.base_version + k.rounds++;
    k.last_push = op.state;
    in = nullptr;  // taken
  }
  if (in) {
    if (in_region) {
      op.in_region = in_region->id();
      op.in_offset = static_cast<const uint8_t*>(in) -
                     static_cast<const uint8_t*>(in_region->data());
    } else {
      if (op.after) {
        op.copy_in = in;
        op.copy_to = staging;
      } else {
        CopyBytes(staging, in, k.bytes);
      }
      k.last_staged = op.state;
      op.in_region = k.staging->id();
      op.in_offset = 0;
    }
    if (!k.stored && !s.state) op.round = k.base_version + k.rounds++;
    if (s.type == Type::kPush) k.last_push = op.state;
  }
  if (out) {
    op.has_output = true;
    if (out_region) {
      op.out_region = out_region->id();
      op.out_offset = static_cast<uint8_t*>(out) -
                      static_cast<const uint8_t*>(out_region->data());
    } else {
      op.out_region = k.staging->id();
      op.out_offset = k.bytes;
      const size_t n = k.bytes;
      const uint8_t* from = staging + k.bytes;
      op.state->set_finisher([out, from, n] {
        CopyBytes(out, from, n);
        return Status::Ok();
      });
      k.last_staged = op.state;
    }
  }
  // A stored key's pull reads what is there now; so do state pulls,
  // except PullAt's, whose version says which value it reads.
  op.min_version = s.state
                       ? (*s.state == proto::Part::kPrevious ? s.at_version : 0)
                   : (c.async || k.stored) ? 0
                                           : k.next_round();
  return op;
}

void KeyTable::Clear() {
  keys_.clear();
  regions_.clear();
  user_regions_.clear();
}

bool KeyTable::CombineCandidate(const KeyInfo& k, uint32_t proxies,
                                bool async) {
  return !async && !k.stored && k.shards == 1 && (proxies == 1 || k.striped) &&
         k.bytes <= kMaxCombineBytes &&
         k.declaration.optimizer == proto::Optimizer::kNone;
}

Result<std::optional<KeyTable::CombineAsk>> KeyTable::BeforeCombining(
    Type type, uint64_t key, const void* in, uint32_t proxies, bool async) {
  KeyInfo* k = Find(key);
  if (!k) return std::optional<CombineAsk>();
  if (!k->combine_error.ok()) return k->combine_error;
  if (type != Type::kPush || !in || k->combine_asked || k->rounds < 1 ||
      !CombineCandidate(*k, proxies, async)) {
    return std::optional<CombineAsk>();
  }
  k->combine_asked = true;
  return std::optional<CombineAsk>(
      CombineAsk{k->last_push, k->bytes, k->dtype});
}

bool KeyTable::Combined(uint64_t key) const {
  auto it = keys_.find(key);
  return it != keys_.end() && it->second.combined;
}

void KeyTable::CombineAttached(uint64_t key, const Status& st) {
  KeyInfo* k = Find(key);
  if (!k) return;
  if (st.ok()) {
    k->combined = true;
  } else {
    k->combine_error = st;
  }
}

Result<uint64_t> KeyTable::TakeCombinedRound(uint64_t key, const void* in,
                                             const void* out) {
  KeyInfo* k = Find(key);
  if (!k || !k->combined) {
    return FailedPreconditionError("key " + std::to_string(key) +
                                   " is not combined in memory");
  }
  if (!k->combine_error.ok()) return k->combine_error;
  for (const void* p : {in, out}) {
    const transport::MemRegion* r = p ? Locate(p, k->bytes) : nullptr;
    if (r && r->memory_type() == transport::MemoryType::kCuda) {
      return FailedPreconditionError(
          "key " + std::to_string(key) +
          " is combined in the memory node's host memory, which every "
          "worker of the job maps; a CUDA buffer cannot take part: stage it "
          "through host memory, or set MEMBOX_COMBINE=0 on every worker");
    }
  }
  return k->base_version + k->rounds++;
}

}  // namespace membox::ps::client
