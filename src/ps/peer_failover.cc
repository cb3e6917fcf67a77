#include "src/ps/peer_failover.h"

namespace membox::ps {

PeerFailover::Hello PeerFailover::OnHello(uint32_t rank, uint64_t conn,
                                          uint32_t nonce) {
  auto it = nonce_.find(rank);
  const bool new_incarnation = it != nonce_.end() && it->second != nonce;
  nonce_[rank] = nonce;
  conn_[rank] = conn;
  if (!new_incarnation && !down(rank)) return Hello::kFirst;
  return Hello::kReplacement;
}

bool PeerFailover::Lost(uint32_t rank, Clock::time_point now) {
  if (!down_.insert(rank).second) return false;
  if (down_.size() == 1) down_since_ = now;
  for (uint32_t p = 0; p < proxies_; ++p) {
    if (p != self_ && !down(p)) awaiting_resume_.insert(p);
  }
  return true;
}

bool PeerFailover::Replaced(uint32_t rank) {
  ++incarnations_[rank];
  down_.erase(rank);
  claims_.erase(rank);  // served: the place is taken
  // A replacement starts with no ring state: there is nothing it must
  // resume (a survivor waiting on the peer that died after another did
  // would wait for it forever).
  awaiting_resume_.erase(rank);
  return down_.empty();
}

bool PeerFailover::ResumeIsNews(uint32_t rank, uint32_t nonce) const {
  auto it = nonce_.find(rank);
  const bool seen = it != nonce_.end() && it->second == nonce;
  return !seen && !down(rank);
}

void PeerFailover::Resumed(uint32_t from) { awaiting_resume_.erase(from); }

bool PeerFailover::Current(uint32_t rank, uint64_t conn) const {
  return IsLink(rank, conn) && !down(rank) && !awaiting_resume_.count(rank);
}

bool PeerFailover::IsLink(uint32_t rank, uint64_t conn) const {
  auto it = conn_.find(rank);
  return it != conn_.end() && it->second == conn;
}

uint64_t PeerFailover::incarnation(uint32_t rank) const {
  auto it = incarnations_.find(rank);
  return it == incarnations_.end() ? 0 : it->second;
}

bool PeerFailover::Overdue(Clock::time_point now,
                           Clock::duration timeout) const {
  return !down_.empty() && now - down_since_ >= timeout;
}

Status PeerFailover::Claim(uint32_t rank, const std::string& endpoint,
                           bool linked, Clock::time_point now) {
  if (rank >= proxies_ || rank == self_) {
    return InvalidArgumentError("no peer proxy " + std::to_string(rank) +
                                " to replace here");
  }
  RETURN_IF_ERROR(MayReplace(rank, endpoint, now));
  if (!down(rank) && linked) {
    return UnavailableError("proxy " + std::to_string(rank) + " is up");
  }
  claims_[rank] = {endpoint, now + kClaimHold};
  if (!down(rank)) {
    return NotFoundError("no link to proxy " + std::to_string(rank) +
                         " here: its death is for its neighbours to tell");
  }
  return Status::Ok();
}

void PeerFailover::Unclaim(uint32_t rank, const std::string& endpoint) {
  auto it = claims_.find(rank);
  if (it != claims_.end() && it->second.endpoint == endpoint) claims_.erase(it);
}

Status PeerFailover::MayReplace(uint32_t rank, const std::string& endpoint,
                                Clock::time_point now) const {
  auto it = claims_.find(rank);
  if (it == claims_.end() || it->second.endpoint == endpoint ||
      it->second.until <= now) {
    return Status::Ok();
  }
  return AlreadyExistsError("proxy " + std::to_string(rank) +
                            "'s place is claimed by the standby at " +
                            it->second.endpoint);
}

}  // namespace membox::ps
