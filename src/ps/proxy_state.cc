// The parameter proxy: checkpoints, restore, and loading shards from a
// checkpoint or from peers (src/ps/proxy_impl.h).
#include "src/ps/proxy_impl.h"

namespace membox::ps::proxy_internal {

Result<Shard*> ProxyImpl::PrepareShard(uint64_t k, uint32_t index,
                                       uint8_t dtype, uint64_t key_bytes,
                                       uint64_t shard_bytes,
                                       const std::string& path) {
  Key& key = keys_[k];
  auto dt = static_cast<DType>(dtype);
  if (key.shards.empty()) {
    // Any dtype (stored keys hold bytes); a key for rounds is declared
    // with a dtype the sums support, and must match this one.
    if (dtype < 1 || dtype > static_cast<uint8_t>(DType::kUInt8) ||
        shard_bytes == 0 || key_bytes % DTypeSize(dt) != 0) {
      return DataLossError(path + ": bad dtype or sizes for key " +
                           std::to_string(k));
    }
    key.bytes = key_bytes;
    key.dtype = dt;
    key.shard_bytes = shard_bytes;
    key.initialized = true;
    key.restored = true;
    uint64_t n = (key.bytes + key.shard_bytes - 1) / key.shard_bytes;
    if (n > (1u << 20)) return DataLossError(path + ": too many shards");
    key.shards.resize(n);
    n_keys_.fetch_add(1);
    n_shards_.fetch_add(n);
  }
  if (index >= key.shards.size() || key.bytes != key_bytes || key.dtype != dt ||
      key.shard_bytes != shard_bytes) {
    return DataLossError(path + ": inconsistent records for key " +
                         std::to_string(k));
  }
  Shard& sh = key.shards[index];
  sh.offset = uint64_t{index} * key.shard_bytes;
  sh.bytes = std::min(key.shard_bytes, key.bytes - sh.offset);
  return &sh;
}

Status ProxyImpl::CheckComplete(const std::string& path) {
  for (auto& [k, key] : keys_) {
    for (auto& sh : key.shards) {
      if (!sh.value) {
        return DataLossError(path + ": key " + std::to_string(k) +
                             " is missing shards");
      }
    }
  }
  return Status::Ok();
}

Status ProxyImpl::LoadRecords(const std::vector<CheckpointShard>& shards,
                              const std::string& path) {
  for (const auto& c : shards) {
    ASSIGN_OR_RETURN(Shard * sh,
                     PrepareShard(c.key, c.shard, c.dtype, c.key_bytes,
                                  c.shard_bytes, path));
    RETURN_IF_ERROR(storage_->Load(*sh, c).WithContext(path + ": key " +
                                                       std::to_string(c.key)));
  }
  return CheckComplete(path);
}

void ProxyImpl::StartCheckpoint(const std::string& name,
                                std::function<void(Status)> done) {
  if (opt_.checkpoint_dir.empty()) {
    return done(FailedPreconditionError(
        "this proxy has no checkpoint directory (--checkpoint-dir)"));
  }
  if (copying_shards_ > 0) {
    return done(
        UnavailableError("this proxy joined and is still copying " +
                         std::to_string(copying_shards_) +
                         " shard(s) from its peers; retry once it has them"));
  }
  // Snapshot: share the current buffers; later updates copy (storage).
  auto snap = std::make_shared<std::vector<ShardStorage::Snapshot>>();
  for (auto& [k, key] : keys_) {
    if (key.scratch) continue;  // the job's scratch is no model state
    for (uint32_t i = 0; i < key.shards.size(); ++i) {
      snap->push_back(ShardStorage::Snap(k, i, key.dtype, key.bytes,
                                         key.shard_bytes, key.shards[i]));
    }
  }
  CheckpointHeader h;
  h.proxy_rank = opt_.rank;
  h.proxies = nproxies_;
  h.mode = static_cast<uint8_t>(mode_);
  h.optimizer = 0;  // optimizers are per key now (format: unused)
  if (Status v = ValidateCheckpointName(name); !v.ok()) return done(v);
  if (job_disk_quota_ != 0) {
    // A principal's checkpoint files count against its quota too: the
    // others it wrote here, plus about this one's size.
    uint64_t others = 0;
    for (auto& [n, bytes] : checkpoint_bytes_) {
      if (n != name) others += bytes;
    }
    const uint64_t estimate = storage_->stored_bytes();
    if (others + estimate > job_disk_quota_) {
      return done(ResourceExhaustedError(
          "checkpoint '" + name + "' of about " + std::to_string(estimate) +
          " bytes would exceed the quota of principal " + job_owner_ + " (" +
          std::to_string(job_disk_quota_) +
          " bytes; its other checkpoints "
          "here hold " +
          std::to_string(others) + ")"));
    }
    checkpoint_bytes_[name] = estimate;
  }
  // A credential's checkpoints are its own files: "<name>@<principal>"
  // (restore one with --restore-name NAME@PRINCIPAL), so another job's
  // checkpoint of the same name never overwrites them.
  std::string path =
      CheckpointPath(job_disk_quota_ != 0 ? name + "@" + job_owner_ : name);
  // One writer thread, a few requests queued: checkpoints of one name are
  // written one after the other, and a flood of requests is refused.
  auto shared_done = std::make_shared<std::function<void(Status)>>(done);
  Status queued = checkpoint_writer_.Submit([this, snap, h, path, shared_done] {
    auto& done = *shared_done;
    std::vector<CheckpointShard> shards;
    for (auto& sn : *snap) shards.push_back(sn.record);
    Status s = WriteCheckpoint(path, h, shards);
    if (s.ok()) {
      checkpoints_.fetch_add(1);
      MEMBOX_LOG_INFO("checkpoint written: {} ({} shards)", path,
                      shards.size());
    } else {
      MEMBOX_LOG_ERROR("checkpoint {} failed: {}", path, s.ToString());
    }
    // Release the snapshot's buffers on the event thread, where the
    // copy-on-write checks read the use counts.
    Post([snap] { snap->clear(); });
    done(s);
  });
  if (!queued.ok()) {
    Post([snap] { snap->clear(); });
    (*shared_done)(queued);
  }
}

Status ValidateCheckpointName(const std::string& name) {
  if (name.empty() || name.size() > 128 || name[0] == '.') {
    return InvalidArgumentError(
        "a checkpoint name has 1..128 characters and does not start with "
        "'.'");
  }
  for (char ch : name) {
    bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
              (ch >= '0' && ch <= '9') || ch == '_' || ch == '.' || ch == '-';
    if (!ok) {
      return InvalidArgumentError(
          "a checkpoint name may hold only A-Z a-z 0-9 _ . - (no NUL, no "
          "'/')");
    }
  }
  return Status::Ok();
}

std::string ProxyImpl::CheckpointPath(const std::string& name) const {
  return (std::filesystem::path(opt_.checkpoint_dir) /
          ("proxy-" + std::to_string(opt_.rank) + "-" + name))
      .string();
}

Status ProxyImpl::Restore() {
  std::string path = CheckpointPath(opt_.restore_name);
  CheckpointHeader h;
  std::vector<CheckpointShard> shards;
  RETURN_IF_ERROR(ReadCheckpoint(path, &h, &shards));
  if (h.proxies != nproxies_ || h.proxy_rank != opt_.rank) {
    return FailedPreconditionError(
        path + " was written by proxy " + std::to_string(h.proxy_rank) +
        " of " + std::to_string(h.proxies) + ", not by this one");
  }
  RETURN_IF_ERROR(LoadRecords(shards, path));
  MEMBOX_LOG_INFO("restored {} keys ({} shards) from {}", keys_.size(),
                  shards.size(), path);
  return Status::Ok();
}

}  // namespace membox::ps::proxy_internal
