#include "src/ps/storage.h"

#include <algorithm>
#include <cstring>

#include "membox/transport/huge_pages.h"

#include "src/ps/reduce.h"

namespace membox::ps {

using transport::MemRegion;

std::string OptimizerSettings::ToString() const {
  const char* names[] = {"none", "sgd", "adam", "adamw", "adagrad"};
  return std::string(names[static_cast<int>(kind)]) +
         " (lr=" + std::to_string(lr) +
         " momentum=" + std::to_string(momentum) +
         " betas=" + std::to_string(beta1) + "," + std::to_string(beta2) +
         " eps=" + std::to_string(eps) +
         " weight_decay=" + std::to_string(weight_decay) + ")";
}

Result<std::shared_ptr<MemRegion>> ShardStorage::Allocate(uint64_t bytes) {
  ASSIGN_OR_RETURN(auto r, AllocateForOverwrite(bytes));
  std::memset(r->data(), 0, bytes);
  return r;
}

std::unique_ptr<MemRegion> RegionRecycler::Take(uint64_t bytes) {
  MutexLock l(&mu_);
  auto it = kept_.find(bytes);
  if (it == kept_.end()) return nullptr;
  auto r = std::move(it->second);
  kept_.erase(it);
  bytes_ -= bytes;
  return r;
}

bool RegionRecycler::Put(std::unique_ptr<MemRegion>& r, uint64_t bytes) {
  MutexLock l(&mu_);
  if (closed_ || bytes_ + bytes > cap_bytes_) return false;
  bytes_ += bytes;
  kept_.emplace(bytes, std::move(r));
  return true;
}

void RegionRecycler::LowerCap(uint64_t cap_bytes) {
  MutexLock l(&mu_);
  cap_bytes_ = std::min(cap_bytes_, cap_bytes);
}

void RegionRecycler::Clear() {
  std::multimap<uint64_t, std::unique_ptr<MemRegion>> gone;
  MutexLock l(&mu_);
  gone.swap(kept_);
  bytes_ = 0;
}

void RegionRecycler::Close() {
  {
    MutexLock l(&mu_);
    closed_ = true;
  }
  Clear();
}

uint64_t RegionRecycler::bytes() const {
  MutexLock l(&mu_);
  return bytes_;
}

Result<std::shared_ptr<MemRegion>> ShardStorage::AllocateForOverwrite(
    uint64_t bytes) {
  bool recycled = false;
  return Take(bytes, &recycled);
}

Result<std::shared_ptr<MemRegion>> ShardStorage::AllocateForCopy(
    uint64_t bytes) {
  bool recycled = false;
  ASSIGN_OR_RETURN(auto r, Take(bytes, &recycled));
  if (!recycled) transport::PopulateForWrite(r->data(), bytes);
  return r;
}

Result<std::shared_ptr<MemRegion>> ShardStorage::AllocateUntouched(
    uint64_t bytes) {
  bool recycled = false;
  ASSIGN_OR_RETURN(auto r, Take(bytes, &recycled));
  if (recycled) std::memset(r->data(), 0, bytes);
  return r;
}

Result<std::shared_ptr<MemRegion>> ShardStorage::Take(uint64_t bytes,
                                                      bool* recycled) {
  if (stored_.load() + bytes > max_bytes_.load()) {
    return ResourceExhaustedError("proxy storage limit reached (" +
                                  std::to_string(max_bytes_.load()) +
                                  " bytes); " + limit_why_);
  }
  std::unique_ptr<MemRegion> r = recycler_->Take(bytes);
  *recycled = r != nullptr;
  if (!r) {
    ASSIGN_OR_RETURN(r, allocate_(bytes));
  }
  stored_.fetch_add(bytes);
  // The counter and the recycler outlive this storage while a snapshot
  // holds a buffer.
  auto counter = stored_counter_;
  auto recycler = recycler_;
  return std::shared_ptr<MemRegion>(
      r.release(), [counter, recycler, bytes](MemRegion* p) {
        counter->fetch_sub(bytes);
        std::unique_ptr<MemRegion> owned(p);
        recycler->Put(owned, bytes);  // else `owned` frees it here
      });
}

Status ShardStorage::Create(StoredShard& sh, uint64_t offset, uint64_t bytes) {
  sh.offset = offset;
  sh.bytes = bytes;
  ASSIGN_OR_RETURN(sh.value, Allocate(bytes));
  return Status::Ok();
}

Status ShardStorage::Unshare(std::shared_ptr<MemRegion>& buffer,
                             uint64_t bytes) {
  if (buffer && buffer.use_count() > 1) {
    ASSIGN_OR_RETURN(auto fresh, Allocate(bytes));
    std::memcpy(fresh->data(), buffer->data(), bytes);
    buffer = std::move(fresh);
  }
  return Status::Ok();
}

Status ShardStorage::Apply(DType dtype, const OptimizerSettings& opt,
                           Update update, StoredShard& sh, MemRegion* g,
                           double scale) {
  const size_t n = sh.bytes / DTypeSize(dtype);
  if (update == Update::kReplace) {
    if (scale != 1.0) ScaleInPlace(*cores_, dtype, g->data(), n, scale);
    if (sh.scratch && g == sh.scratch.get()) {
      std::swap(sh.value, sh.scratch);  // the old value becomes scratch
      return Status::Ok();
    }
    RETURN_IF_ERROR(Unshare(sh.value, sh.bytes));
    std::memcpy(sh.value->data(), g->data(), sh.bytes);
    return Status::Ok();
  }
  if (update == Update::kAdd) {
    RETURN_IF_ERROR(Unshare(sh.value, sh.bytes));
    cores_->Run(dtype, sh.value->data(), g->data(), n, scale);
    return Status::Ok();
  }
  if (opt.kind == proto::Optimizer::kNone) {
    return InternalError("an optimizer update without an optimizer");
  }
  if (!sh.m1) {
    ASSIGN_OR_RETURN(sh.m1, Allocate(sh.bytes));
  }
  if (opt.has_second_moment() && !sh.m2) {
    ASSIGN_OR_RETURN(sh.m2, Allocate(sh.bytes));
  }
  RETURN_IF_ERROR(Unshare(sh.m1, sh.bytes));
  RETURN_IF_ERROR(Unshare(sh.m2, sh.bytes));
  // Out of place: the new value goes to the old `previous` buffer (or a
  // fresh one when a snapshot or a transfer holds it), the old value
  // becomes `previous`.
  std::shared_ptr<MemRegion> out = std::move(sh.previous);
  if (!out || out.use_count() > 1) {
    ASSIGN_OR_RETURN(out, AllocateForOverwrite(sh.bytes));
  }
  OptimizerStep step;
  switch (opt.kind) {
    case proto::Optimizer::kSgd:
      step.kind = OptimizerStep::kSgd;
      break;
    case proto::Optimizer::kAdam:
      step.kind = OptimizerStep::kAdam;
      break;
    case proto::Optimizer::kAdamW:
      step.kind = OptimizerStep::kAdamW;
      break;
    default:
      step.kind = OptimizerStep::kAdagrad;
      break;
  }
  step.lr = opt.lr;
  step.momentum = opt.momentum;
  step.beta1 = opt.beta1;
  step.beta2 = opt.beta2;
  step.eps = opt.eps;
  step.weight_decay = opt.weight_decay;
  step.t = sh.version + 1;
  step.grad_scale = scale;
  ApplyOptimizer(*cores_, dtype, step, out->data(), sh.value->data(), g->data(),
                 sh.m1->data(), sh.m2 ? sh.m2->data() : nullptr, n);
  sh.previous = std::move(sh.value);
  sh.value = std::move(out);
  return Status::Ok();
}

ShardStorage::Snapshot ShardStorage::Snap(uint64_t key, uint32_t index,
                                          DType dtype, uint64_t key_bytes,
                                          uint64_t shard_bytes,
                                          const StoredShard& sh) {
  Snapshot s;
  CheckpointShard& c = s.record;
  c.key = key;
  c.shard = index;
  c.dtype = static_cast<uint8_t>(dtype);
  c.key_bytes = key_bytes;
  c.shard_bytes = shard_bytes;
  c.version = sh.version;
  auto view = [&](const std::shared_ptr<MemRegion>& r) {
    return r ? std::span<const uint8_t>(static_cast<const uint8_t*>(r->data()),
                                        sh.bytes)
             : std::span<const uint8_t>();
  };
  c.value_stale = sh.value_stale;
  if (sh.value_stale) return s;  // its version alone (no optimizer state)
  c.value = view(sh.value);
  c.m1 = view(sh.m1);
  c.m2 = view(sh.m2);
  s.keep = {sh.value, sh.m1, sh.m2};
  return s;
}

Status ShardStorage::Load(StoredShard& sh, const CheckpointShard& record) {
  if (record.value_stale) {
    // The version alone, as it was held: never served, replaced by the
    // next round applied here.
    if (!record.value.empty() || !record.m1.empty() || !record.m2.empty()) {
      return DataLossError("a stale shard with bytes");
    }
    sh.version = record.version;
    ASSIGN_OR_RETURN(sh.value, AllocateUntouched(sh.bytes));
    sh.value_stale = true;
    sh.m1.reset();
    sh.m2.reset();
    return Status::Ok();
  }
  if (record.value.size() != sh.bytes ||
      (!record.m1.empty() && record.m1.size() != sh.bytes) ||
      (!record.m2.empty() && record.m2.size() != sh.bytes)) {
    return DataLossError("shard size mismatch");
  }
  sh.version = record.version;
  ASSIGN_OR_RETURN(sh.value, AllocateForOverwrite(sh.bytes));
  std::memcpy(sh.value->data(), record.value.data(), sh.bytes);
  sh.value_stale = false;
  sh.m1.reset();
  sh.m2.reset();
  if (!record.m1.empty()) {
    ASSIGN_OR_RETURN(sh.m1, Allocate(sh.bytes));
    std::memcpy(sh.m1->data(), record.m1.data(), sh.bytes);
  }
  if (!record.m2.empty()) {
    ASSIGN_OR_RETURN(sh.m2, Allocate(sh.bytes));
    std::memcpy(sh.m2->data(), record.m2.data(), sh.bytes);
  }
  return Status::Ok();
}

}  // namespace membox::ps
