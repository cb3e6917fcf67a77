#include "membox/sync/split_allreduce.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>

#include "membox/base/dtype.h"
#include "membox/collective/ring_allreduce.h"
#include "membox/ps/param_client.h"

namespace membox::sync {

namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t0, Clock::time_point t) {
  return std::chrono::duration<double>(t - t0).count();
}

// Ids up to this many bits keep key_base + id * kSplitSteps + share clear of
// overflow for any key_base below 2^63.
constexpr uint64_t kMaxId = (uint64_t{1} << 54) - 1;

}  // namespace

int FirstSplitShare(int workers, int nodes) {
  if (workers < 2 || nodes < 1 || workers <= nodes) return 0;
  const double p = workers, m = nodes;
  const double r = (p / m - 1) * p / (2 * (p - 1));
  const int s = static_cast<int>(std::lround(kSplitSteps * r / (1 + r)));
  return std::min(kSplitSteps - 1, s);
}

int NextSplitShare(int share, double ring_s, double nodes_s) {
  if (share <= 0) return 0;  // the nodes alone: it stays so
  double target;
  if (share >= kSplitSteps) {
    target = kSplitSteps - 1;
  } else {
    const double ring = ring_s / share;                   // s per sixteenth
    const double node = nodes_s / (kSplitSteps - share);  // s per sixteenth
    target = ring + node > 0 ? kSplitSteps * node / (ring + node) : share;
  }
  const double delta = target - share;
  int next;
  if (std::fabs(delta) < 0.5) {
    next = share;
  } else if (std::fabs(delta) <= 2) {
    next = static_cast<int>(target + 0.5);
  } else {
    next = static_cast<int>(share + delta / 2 + 0.5);
  }
  return std::clamp(next, 0, kSplitSteps - 1);
}

bool SplitShare::MustAgree() const {
  if (splits_ == 0 || value_ == 0) return false;
  return held_ < 4 || splits_ % 16 == 0;
}

void SplitShare::Agreed(int value) {
  held_ = value == value_ ? held_ + 1 : 0;
  value_ = value;
  if (rank_ != 0) proposal_ = value;
}

void SplitShare::Measured(double ring_s, double nodes_s) {
  if (rank_ != 0) return;
  proposal_ = NextSplitShare(value_, ring_s, nodes_s);
}

Result<std::unique_ptr<SplitAllreduce>> SplitAllreduce::Create(
    ps::ParamClient* client, collective::RingAllreduce* ring,
    const SplitOptions& options) {
  if (client == nullptr || ring == nullptr) {
    return InvalidArgumentError("split all_reduce: needs a client and a ring");
  }
  if (options.world < 1 || options.nodes < 1 || options.rank < 0 ||
      options.rank >= options.world) {
    return InvalidArgumentError("split all_reduce: rank " +
                                std::to_string(options.rank) + " of world " +
                                std::to_string(options.world) + " with " +
                                std::to_string(options.nodes) + " node(s)");
  }
  const int first = options.first_share < 0
                        ? FirstSplitShare(options.world, options.nodes)
                        : options.first_share;
  if (first >= kSplitSteps) {
    return InvalidArgumentError("split all_reduce: first share " +
                                std::to_string(first) + " is not below " +
                                std::to_string(kSplitSteps));
  }
  if (options.ring_max_bytes < 4 * static_cast<size_t>(options.world)) {
    return InvalidArgumentError("split all_reduce: ring_max_bytes " +
                                std::to_string(options.ring_max_bytes) +
                                " holds no float per worker");
  }
  return std::unique_ptr<SplitAllreduce>(
      new SplitAllreduce(client, ring, options, first));
}

SplitAllreduce::SplitAllreduce(ps::ParamClient* client,
                               collective::RingAllreduce* ring,
                               const SplitOptions& options, int first)
    : client_(client),
      ring_(ring),
      opt_(options),
      share_(options.rank, first) {}

Status SplitAllreduce::RingPart(float* data, size_t count) {
  const size_t piece = opt_.ring_max_bytes / 4;
  for (size_t at = 0; at < count; at += piece) {
    RETURN_IF_ERROR(ring_->Allreduce(data + at, std::min(piece, count - at)));
  }
  if (opt_.average) {
    const float inv = 1.0f / static_cast<float>(opt_.world);
    for (size_t i = 0; i < count; ++i) data[i] *= inv;
  }
  return Status::Ok();
}

Status SplitAllreduce::Allreduce(uint64_t id, const float* in, float* out,
                                 size_t count) {
  if (id > kMaxId) {
    return InvalidArgumentError("split all_reduce: id " + std::to_string(id) +
                                " is above 2^54 - 1");
  }
  const bool small = count * 4 < opt_.min_bytes;
  if (!small && opt_.adapt && share_.MustAgree()) {
    // Rank 0's proposal down the ring: every rank cuts this split alike.
    int32_t v = share_.proposal();
    RETURN_IF_ERROR(
        ring_->Broadcast(&v, sizeof v, 0)
            .WithContext("split all_reduce: agreeing on the share"));
    if (v < 0 || v >= kSplitSteps) {
      return DataLossError("split all_reduce: rank 0 sent share " +
                           std::to_string(v));
    }
    share_.Agreed(v);
  }
  const int share = small ? 0 : share_.value();
  const size_t cut = count * static_cast<size_t>(share) / kSplitSteps;
  const size_t tail = count - cut;
  const uint64_t key = opt_.key_base + id * kSplitSteps + share;
  if (tail > 0 && declared_.count(key) == 0) {
    RETURN_IF_ERROR(client_
                        ->DeclareScratch(key, tail * 4, DType::kFloat32,
                                         /*stored=*/false)
                        .status()
                        .WithContext("split all_reduce: declaring its tail"));
    declared_.insert(key);
  }
  const auto t0 = Clock::now();
  std::atomic<int64_t> nodes_done{0};  // ns after t0; 0 until done
  ps::PsHandle h;
  if (tail > 0) {
    h = client_->PushPull(
        key, in + cut, out + cut, /*priority=*/0,
        [&nodes_done, t0](const Status&) {
          nodes_done.store(std::max<int64_t>(1, (Clock::now() - t0).count()),
                           std::memory_order_release);
        });
  }
  Status ring_st;
  if (cut > 0) {
    if (out != in) std::memcpy(out, in, cut * 4);
    ring_st = RingPart(out, cut);
  }
  const double ring_s = Since(t0, Clock::now());
  Status nodes_st = tail > 0 ? h.Wait() : Status::Ok();
  if (cut > 0) share_.Taken();
  RETURN_IF_ERROR(ring_st.WithContext("split all_reduce: the ring's part"));
  RETURN_IF_ERROR(nodes_st.WithContext("split all_reduce: the nodes' part"));
  if (cut == 0) return Status::Ok();
  ++splits_;
  last_ring_s_ = ring_s;
  last_nodes_s_ =
      std::chrono::duration<double>(
          std::chrono::nanoseconds(nodes_done.load(std::memory_order_acquire)))
          .count();
  share_.Measured(last_ring_s_, last_nodes_s_);
  return Status::Ok();
}

}  // namespace membox::sync
