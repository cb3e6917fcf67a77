#include "src/ps/ring.h"

#include <algorithm>

namespace membox::ps {

RingGeometry RingGeometry::For(uint32_t P, uint32_t rank, uint64_t key,
                               uint32_t shard) {
  RingGeometry r;
  r.P = std::max<uint32_t>(1, P);
  const bool forward = ((key + shard) & 1) == 0;
  r.pos = forward ? rank : (r.P - rank) % r.P;
  auto rank_of = [&](uint32_t pos) {
    pos %= r.P;
    return forward ? pos : (r.P - pos) % r.P;
  };
  r.next = rank_of(r.pos + 1);
  r.prev = rank_of(r.pos + r.P - 1);
  return r;
}

uint32_t RingGeometry::ChunkAt(uint32_t step) const {
  // Reduce-scatter: at step s a proxy adds chunk (pos - 1 - s) of its
  // predecessor, so after P-1 steps chunk (pos + 1) holds the full sum at
  // position pos; all-gather then copies the full chunks around.
  return Reduces(step) ? (pos + 2 * P - 1 - step) % P
                       : (pos + 2 * P - (step - (P - 1))) % P;
}

std::pair<uint64_t, uint64_t> RingChunk(uint64_t bytes, size_t element_size,
                                        uint32_t P, uint32_t c) {
  uint64_t n = bytes / element_size;
  uint64_t per = (n + P - 1) / P;
  uint64_t b = std::min<uint64_t>(n, per * c);
  uint64_t e = std::min<uint64_t>(n, b + per);
  return {b * element_size, (e - b) * element_size};
}

Result<bool> RingProgress::Start(uint64_t round, const RingGeometry& ring,
                                 const Io& io) {
  ForgetRead();
  round_ = round;
  step_ = 0;
  read_done_ = false;
  running_ = true;
  if (ring.steps() == 0) {
    running_ = false;
    return true;
  }
  Status s = io.send_ready(0);
  if (!s.ok()) {
    running_ = false;
    return s;
  }
  return Advance(ring, io);
}

void RingProgress::OnReady(uint64_t round, uint32_t step,
                           transport::RegionDescriptor prev_buffer) {
  ready_[{round, step}] = std::move(prev_buffer);
}

void RingProgress::OnDone(uint64_t round, uint32_t step) {
  done_.insert({round, step});
}

Result<bool> RingProgress::Advance(const RingGeometry& ring, const Io& io) {
  if (!running_) return false;
  auto fail = [this](Status s) -> Result<bool> {
    running_ = false;
    ForgetRead();
    return s;
  };
  const uint32_t steps = ring.steps();
  while (step_ < steps) {
    const auto id = std::make_pair(round_, step_);
    if (!read_done_) {
      auto r = ready_.find(id);
      if (!reading_) {
        if (r == ready_.end()) return false;
        auto got = io.read(step_, r->second);
        if (!got.ok()) return fail(got.status());
        if (!*got) {
          reading_ = true;
          return false;  // ReadLanded, then Advance again
        }
      } else {
        if (!landed_) return false;
        Status landed = *landed_;
        ForgetRead();
        if (!landed.ok()) return fail(landed);
      }
      if (r != ready_.end()) ready_.erase(r);
      read_done_ = true;
      Status s = io.send_done(step_);
      if (!s.ok()) return fail(s);
    }
    auto d = done_.find(id);
    if (d == done_.end()) return false;
    done_.erase(d);
    ++steps_done_;
    ++step_;
    read_done_ = false;
    if (step_ < steps) {
      Status s = io.send_ready(step_);
      if (!s.ok()) return fail(s);
    }
  }
  running_ = false;
  return true;
}

void RingProgress::ReadLanded(uint64_t epoch, Status st) {
  if (epoch != epoch_ || !reading_ || landed_) return;  // stale
  landed_ = std::move(st);
}

void RingProgress::Reset() {
  ForgetRead();
  running_ = false;
  step_ = 0;
  read_done_ = false;
  ready_.clear();
  done_.clear();
}

std::string RingProgress::Waiting(const RingGeometry& ring) const {
  if (!running_) return "not in a ring step";
  std::string at = "ring step " + std::to_string(step_ + 1) + "/" +
                   std::to_string(ring.steps()) + " of round " +
                   std::to_string(round_) + ": waiting for proxy ";
  if (reading()) {
    return at + "reading proxy " + std::to_string(ring.prev) + "'s chunk";
  }
  if (!read_done_) {
    return at + std::to_string(ring.prev) + " to announce its buffer";
  }
  return at + std::to_string(ring.next) + " to read ours";
}

}  // namespace membox::ps
