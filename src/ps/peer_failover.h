// PeerFailover: what one proxy knows of its peers' deaths and replacements
// (docs/design/ps.md, "Node failover"), and the decisions that follow from
// it. The proxy acts on them (ProxyImpl: pausing and restarting rounds,
// dropping a dead incarnation's links, telling the others kResume).
//
// It keeps, per peer proxy:
//   incarnation  the nonce of its latest hello, and the link that hello came
//                on: notices from any other link are an older incarnation's;
//   down         peers lost and not yet replaced, and since when the first
//                of them is down (the failover deadline runs from then);
//   resume       survivors whose ring notices are ignored until they say
//                they restarted their rounds too (kResume): notices sent
//                before that belong to rounds that are being redone;
//   count        how many incarnations of each peer this proxy has taken
//                in: a link made to an older one is ignored when it fails;
//   claims       which standby node (by its endpoint) this proxy let take a
//                down peer's place (kClaim), until when: one replacement
//                per place, the first to claim it.
//
// Ownership: plain state, no I/O. Threading: the proxy's event loop only.
#ifndef MEMBOX_SRC_PS_PEER_FAILOVER_H_
#define MEMBOX_SRC_PS_PEER_FAILOVER_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <set>
#include <string>

#include "membox/base/status.h"

namespace membox::ps {

class PeerFailover {
 public:
  using Clock = std::chrono::steady_clock;

  // `self`: this proxy's rank among `proxies`.
  PeerFailover(uint32_t self, uint32_t proxies)
      : self_(self), proxies_(proxies) {}

  // A kPeerHello from `rank` on link `conn`, incarnation `nonce`; that link
  // is the peer's from now on.
  //   kFirst        the peer's first hello (or its incarnation's again), and
  //                 it is not down: nothing to resume;
  //   kReplacement  a new incarnation, or a hello of a peer that is down:
  //                 the caller pauses for it first if it is not down yet
  //                 (Lost), then takes it in (Replaced).
  enum class Hello { kFirst, kReplacement };
  Hello OnHello(uint32_t rank, uint64_t conn, uint32_t nonce);

  // Peer `rank` is gone. True when it was not down before: the caller
  // pauses then (restarts the rounds in flight). The first peer down
  // starts the failover clock; every other live peer's notices are
  // ignored until its kResume.
  bool Lost(uint32_t rank, Clock::time_point now);

  // `rank`'s replacement is taken in: a new incarnation (links to the old
  // one are stale), up, with nothing of it to resume. True when no peer is
  // down any more: the rounds resume.
  bool Replaced(uint32_t rank);

  // A kResume says peer `rank` was replaced by incarnation `nonce`: whether
  // that is news here (the caller then pauses for it: Lost).
  bool ResumeIsNews(uint32_t rank, uint32_t nonce) const;
  // Peer `from` restarted its rounds: its notices count again.
  void Resumed(uint32_t from);

  // Whether ring notices from `rank` on `conn` count: the current
  // incarnation's link, the peer up and not awaiting its kResume.
  bool Current(uint32_t rank, uint64_t conn) const;
  // Whether `conn` is the current incarnation's link of `rank` (whatever
  // the rounds' state): its backups count, and its loss is a death.
  bool IsLink(uint32_t rank, uint64_t conn) const;
  // Incarnations of `rank` taken in so far.
  uint64_t incarnation(uint32_t rank) const;

  bool down(uint32_t rank) const { return down_.count(rank) != 0; }
  const std::set<uint32_t>& down() const { return down_; }
  // When the first of the peers down now went down (meaningful while any
  // is, and for the pause just ended after Replaced returned true).
  Clock::time_point down_since() const { return down_since_; }
  // Some peer has been down for `timeout` or longer.
  bool Overdue(Clock::time_point now, Clock::duration timeout) const;

  // How long a granted claim holds without its claimant's hello.
  static constexpr Clock::duration kClaimHold = std::chrono::seconds(30);
  // The standby at `endpoint` asks for down peer `rank`'s place; `linked`:
  // this proxy has a live link to `rank` now. OK: `rank` is down here and
  // the place is the standby's (again, when it asks again). NOT_FOUND:
  // this proxy has no link to `rank` and so cannot know whether it is
  // down; the claim is recorded all the same (a proxy that knows decides).
  // UNAVAILABLE: `rank` is up here; ALREADY_EXISTS: another standby's
  // claim holds; INVALID_ARGUMENT: `rank` is this proxy or not a peer.
  Status Claim(uint32_t rank, const std::string& endpoint, bool linked,
               Clock::time_point now);
  // The standby at `endpoint` lets its claim on `rank` go.
  void Unclaim(uint32_t rank, const std::string& endpoint);
  // Whether a replacement at `endpoint` may take `rank`'s place: OK unless
  // another standby's claim holds (ALREADY_EXISTS, naming it).
  Status MayReplace(uint32_t rank, const std::string& endpoint,
                    Clock::time_point now) const;

 private:
  const uint32_t self_;
  const uint32_t proxies_;
  std::map<uint32_t, uint32_t> nonce_;  // rank -> latest hello's nonce
  std::map<uint32_t, uint64_t> conn_;   // rank -> that hello's link
  std::map<uint32_t, uint64_t> incarnations_;
  std::set<uint32_t> down_;
  Clock::time_point down_since_{};
  std::set<uint32_t> awaiting_resume_;
  struct HeldClaim {
    std::string endpoint;
    Clock::time_point until;
  };
  std::map<uint32_t, HeldClaim> claims_;
};

}  // namespace membox::ps

#endif  // MEMBOX_SRC_PS_PEER_FAILOVER_H_
