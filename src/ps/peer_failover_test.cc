// PeerFailover alone: the failover decisions of one proxy among four,
// driven by hand, with no links and no rounds.
#include "src/ps/peer_failover.h"

#include <gtest/gtest.h>

namespace membox::ps {
namespace {

using namespace std::chrono_literals;
using Hello = PeerFailover::Hello;

// This proxy is 0 of 4; peers 1, 2, 3 say hello on links 11, 12, 13.
class PeerFailoverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (uint32_t p = 1; p < 4; ++p) {
      ASSERT_EQ(f_.OnHello(p, 10 + p, 100 + p), Hello::kFirst);
    }
  }
  PeerFailover f_{0, 4};
  PeerFailover::Clock::time_point t0_ = PeerFailover::Clock::now();
};

TEST_F(PeerFailoverTest, FirstHellosNeedNothingAndTheirLinksAreCurrent) {
  for (uint32_t p = 1; p < 4; ++p) {
    EXPECT_TRUE(f_.Current(p, 10 + p));
    EXPECT_TRUE(f_.IsLink(p, 10 + p));
    EXPECT_FALSE(f_.Current(p, 99));
    EXPECT_EQ(f_.incarnation(p), 0u);
  }
  // The same incarnation again (a second link of its own): still first.
  EXPECT_EQ(f_.OnHello(2, 22, 102), Hello::kFirst);
  EXPECT_TRUE(f_.Current(2, 22));
  EXPECT_FALSE(f_.IsLink(2, 12));  // the newest link is the peer's
  EXPECT_TRUE(f_.down().empty());
  EXPECT_FALSE(f_.Overdue(t0_ + 1h, 1s));
}

TEST_F(PeerFailoverTest, ADeathPausesUntilItsReplacementSaysHello) {
  ASSERT_TRUE(f_.Lost(2, t0_));
  EXPECT_FALSE(f_.Lost(2, t0_ + 5s));  // already down: no second pause
  EXPECT_TRUE(f_.down(2));
  EXPECT_EQ(f_.down_since(), t0_);
  EXPECT_FALSE(f_.Current(2, 12));
  // The survivors' notices wait for their kResume: they belong to rounds
  // that are being redone.
  EXPECT_FALSE(f_.Current(1, 11));
  EXPECT_FALSE(f_.Current(3, 13));
  EXPECT_TRUE(f_.IsLink(1, 11));  // their backups still count
  EXPECT_FALSE(f_.Overdue(t0_ + 9s, 10s));
  EXPECT_TRUE(f_.Overdue(t0_ + 10s, 10s));

  // The replacement: any hello of a peer that is down.
  EXPECT_EQ(f_.OnHello(2, 42, 202), Hello::kReplacement);
  EXPECT_TRUE(f_.Replaced(2));  // nobody else is down: the rounds resume
  EXPECT_EQ(f_.incarnation(2), 1u);
  EXPECT_TRUE(f_.Current(2, 42));   // a replacement has nothing to resume
  EXPECT_FALSE(f_.IsLink(2, 12));   // the dead incarnation's link is stale
  EXPECT_EQ(f_.down_since(), t0_);  // the pause that just ended
  EXPECT_FALSE(f_.Overdue(t0_ + 1h, 1s));
  // Survivors count again once they resumed.
  EXPECT_FALSE(f_.Current(1, 11));
  f_.Resumed(1);
  f_.Resumed(3);
  EXPECT_TRUE(f_.Current(1, 11));
  EXPECT_TRUE(f_.Current(3, 13));
}

TEST_F(PeerFailoverTest, ANewIncarnationOfALivePeerIsAReplacementToo) {
  // Proxy 3 died and came back before this proxy noticed: its hello has a
  // new nonce. The caller pauses first (it is not down), then takes it in.
  EXPECT_EQ(f_.OnHello(3, 33, 303), Hello::kReplacement);
  EXPECT_FALSE(f_.down(3));
  EXPECT_TRUE(f_.Lost(3, t0_));
  EXPECT_TRUE(f_.Replaced(3));
  EXPECT_TRUE(f_.Current(3, 33));
}

TEST_F(PeerFailoverTest, ResumesTellOfReplacementsNotSeenHere) {
  // Proxy 1 says proxy 2 was replaced by incarnation 202, which this proxy
  // has not met: news, it pauses too.
  EXPECT_TRUE(f_.ResumeIsNews(2, 202));
  ASSERT_TRUE(f_.Lost(2, t0_));
  f_.Resumed(1);
  EXPECT_TRUE(f_.Current(1, 11));
  EXPECT_FALSE(f_.Current(3, 13));
  // Down already: not news again.
  EXPECT_FALSE(f_.ResumeIsNews(2, 202));
  EXPECT_EQ(f_.OnHello(2, 42, 202), Hello::kReplacement);
  EXPECT_TRUE(f_.Replaced(2));
  // Seen: a later kResume about the same incarnation is not news.
  EXPECT_FALSE(f_.ResumeIsNews(2, 202));
  EXPECT_TRUE(f_.ResumeIsNews(2, 999));
}

TEST_F(PeerFailoverTest, TwoDeathsResumeOnlyWhenBothAreReplaced) {
  ASSERT_TRUE(f_.Lost(1, t0_));
  ASSERT_TRUE(f_.Lost(3, t0_ + 2s));
  EXPECT_EQ(f_.down_since(), t0_);  // the clock runs from the first
  EXPECT_TRUE(f_.Overdue(t0_ + 3s, 3s));
  EXPECT_EQ(f_.OnHello(1, 41, 201), Hello::kReplacement);
  EXPECT_FALSE(f_.Replaced(1));  // 3 is still down
  EXPECT_TRUE(f_.down(3));
  EXPECT_EQ(f_.OnHello(3, 43, 203), Hello::kReplacement);
  EXPECT_TRUE(f_.Replaced(3));
  EXPECT_TRUE(f_.down().empty());
  // Proxy 2 lived through both and still owes its kResume.
  EXPECT_FALSE(f_.Current(2, 12));
  f_.Resumed(2);
  EXPECT_TRUE(f_.Current(2, 12));
}

// Standby nodes (kClaim): a down peer's place goes to the first standby
// that claims it, until that standby's hello or the claim lapses.
TEST_F(PeerFailoverTest, ADownPeersPlaceGoesToTheFirstStandbyToClaimIt) {
  const std::string a = "10.0.0.7:7410", b = "10.0.0.8:7410";
  EXPECT_EQ(f_.Claim(2, a, /*linked=*/true, t0_).code(),
            StatusCode::kUnavailable)
      << "proxy 2 is up";
  EXPECT_EQ(f_.Claim(0, a, false, t0_).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(f_.Claim(4, a, false, t0_).code(), StatusCode::kInvalidArgument);
  // Not linked to proxy 3: this proxy cannot tell, but keeps the claim.
  EXPECT_EQ(f_.Claim(3, a, false, t0_).code(), StatusCode::kNotFound);
  EXPECT_EQ(f_.Claim(3, b, false, t0_).code(), StatusCode::kAlreadyExists);
  f_.Unclaim(3, a);
  ASSERT_TRUE(f_.Lost(2, t0_));
  ASSERT_TRUE(f_.Claim(2, a, false, t0_).ok());
  EXPECT_TRUE(f_.Claim(2, a, false, t0_ + 1s).ok()) << "again: still a's";
  Status other = f_.Claim(2, b, false, t0_ + 1s);
  EXPECT_EQ(other.code(), StatusCode::kAlreadyExists);
  EXPECT_NE(other.ToString().find(a), std::string::npos) << other.ToString();
  // A replacement elsewhere (the launcher's, at the old address) is
  // refused while a's claim holds; a itself may.
  EXPECT_EQ(f_.MayReplace(2, "10.0.0.2:7410", t0_ + 1s).code(),
            StatusCode::kAlreadyExists);
  EXPECT_TRUE(f_.MayReplace(2, a, t0_ + 1s).ok());
  // A claim that lapses (its standby died before joining) frees the place.
  const auto later = t0_ + PeerFailover::kClaimHold + 1s;
  EXPECT_TRUE(f_.MayReplace(2, b, later).ok());
  ASSERT_TRUE(f_.Claim(2, b, false, later).ok());
  // Let go by another standby: nothing; by its holder: free.
  f_.Unclaim(2, a);
  EXPECT_EQ(f_.Claim(2, a, false, later).code(), StatusCode::kAlreadyExists);
  f_.Unclaim(2, b);
  ASSERT_TRUE(f_.Claim(2, a, false, later).ok());
  // The claimant's hello takes the place: no claim is left, and the peer
  // is up, so no one can claim it again.
  EXPECT_EQ(f_.OnHello(2, 32, 902), Hello::kReplacement);
  EXPECT_TRUE(f_.Replaced(2));
  EXPECT_TRUE(f_.MayReplace(2, b, later).ok());
  EXPECT_EQ(f_.Claim(2, b, true, later).code(), StatusCode::kUnavailable);
}

}  // namespace
}  // namespace membox::ps
