#include "membox/collective/point_to_point.h"

#include <map>
#include <set>
#include <thread>

#include <gtest/gtest.h>

#include "membox/transport/device.h"

#include "src/collective/loopback_group_test_util.h"
#include "src/collective/ring_message.h"

namespace membox::collective {
namespace {

// `world` workers on loopback with slots of 64 KiB and messages of up to
// 1 KiB inline, each told the others' endpoints; body(rank, p2p) on one
// thread per rank (connections are made as they are used).
template <typename Body>
void OnPairs(int world, Body body, size_t inline_bytes = 1024,
             size_t max_bytes = 0 /* 64 KiB slots */) {
  std::vector<std::unique_ptr<PointToPoint>> all;
  std::vector<std::string> eps;
  StartLoopback<PointToPoint, PointToPointOptions>(
      world,
      [&](PointToPointOptions& o) {
        o.max_bytes = max_bytes;
        o.inline_bytes = inline_bytes;
        o.timeout = std::chrono::seconds(20);
      },
      &all, &eps);
  ASSERT_EQ(all.size(), size_t(world));
  for (int r = 0; r < world; ++r) {
    for (int q = 0; q < world; ++q) {
      if (q != r) {
        ASSERT_TRUE(all[r]->AddPeer(q, eps[q]).ok());
      }
    }
  }
  OnEachRank(world, [&](int r) { body(r, *all[r]); });
}

std::vector<uint8_t> Message(int from, int to, int i, size_t n) {
  std::vector<uint8_t> v(n);
  for (size_t k = 0; k < n; ++k) v[k] = uint8_t(from * 31 + to * 7 + i + k);
  return v;
}

// Every worker sends every other a run of messages (empty, inline, one
// piece, several pieces) while receiving theirs, a thread per peer and
// direction.
TEST(PointToPointTest, MessagesOfAnySizeBetweenEveryPair) {
  const std::vector<size_t> sizes = {0, 5, 1024, 1025, 64 << 10, 200 << 10, 3};
  OnPairs(3, [&](int r, PointToPoint& p2p) {
    std::vector<std::thread> th;
    for (int q = 0; q < 3; ++q) {
      if (q == r) continue;
      th.emplace_back([&, q] {
        for (size_t i = 0; i < sizes.size(); ++i) {
          Status s = p2p.Send(q, Message(r, q, int(i), sizes[i]), 7);
          ASSERT_TRUE(s.ok()) << s.ToString();
        }
      });
      th.emplace_back([&, q] {
        for (size_t i = 0; i < sizes.size(); ++i) {
          std::vector<uint8_t> got(sizes[i], 0xEE);
          Status s = p2p.Recv(q, got, 7);
          ASSERT_TRUE(s.ok()) << s.ToString();
          ASSERT_EQ(got, Message(q, r, int(i), sizes[i]))
              << "rank " << r << " from " << q << " message " << i;
        }
      });
    }
    for (auto& t : th) t.join();
  });
}

// A receive for a tag takes that tag's next message; what comes first
// under other tags (a multi-piece one too) is taken in whole and kept for
// its own receive, so the sender never waits on the receiver's order.
// Both workers send (on a thread of their own: a multi-piece message is a
// rendezvous) while they receive in another order.
TEST(PointToPointTest, TagsAreMatchedWhateverTheOrder) {
  OnPairs(2, [&](int r, PointToPoint& p2p) {
    const int peer = 1 - r;
    std::thread sender([&] {
      ASSERT_TRUE(p2p.Send(peer, Message(r, peer, 1, 300 << 10), 1).ok());
      ASSERT_TRUE(p2p.Send(peer, Message(r, peer, 2, 10), 2).ok());
      ASSERT_TRUE(p2p.Send(peer, Message(r, peer, 3, 2000), 1).ok());
    });
    std::vector<uint8_t> b(10), a(300 << 10), c(2000);
    ASSERT_TRUE(p2p.Recv(peer, b, 2).ok());
    EXPECT_EQ(b, Message(peer, r, 2, 10));
    ASSERT_TRUE(p2p.Recv(peer, a, 1).ok());
    EXPECT_EQ(a, Message(peer, r, 1, 300 << 10));
    ASSERT_TRUE(p2p.Recv(peer, c, 1).ok());
    EXPECT_EQ(c, Message(peer, r, 3, 2000));
    sender.join();
  });
}

// Messages that fit one buffer are not a rendezvous: both workers send
// one, then receive.
TEST(PointToPointTest, OneBufferfulNeedsNoReceiverYet) {
  OnPairs(2, [&](int r, PointToPoint& p2p) {
    const int peer = 1 - r;
    ASSERT_TRUE(p2p.Send(peer, Message(r, peer, 0, 60 << 10), 4).ok());
    ASSERT_TRUE(p2p.Send(peer, Message(r, peer, 1, 100), 4).ok());  // inline
    std::vector<uint8_t> a(60 << 10), b(100);
    ASSERT_TRUE(p2p.Recv(peer, a, 4).ok());
    ASSERT_TRUE(p2p.Recv(peer, b, 4).ok());
    EXPECT_EQ(a, Message(peer, r, 0, 60 << 10));
    EXPECT_EQ(b, Message(peer, r, 1, 100));
  });
}

// On one host a message inline by size but above 64 KiB is copied into
// the peer's mapped buffer when that buffer is free, and goes inline when
// it still holds an earlier one: sends never wait for the receiver, and
// every message arrives intact and in order, round after round.
TEST(PointToPointTest, MappedOrInlineWhicheverIsFreeNeverWaits) {
  OnPairs(
      2,
      [&](int r, PointToPoint& p2p) {
        const int peer = 1 - r;
        const std::vector<size_t> sizes = {200 << 10, 200 << 10, 150 << 10,
                                           20 << 10};
        for (int round = 0; round < 3; ++round) {
          for (size_t i = 0; i < sizes.size(); ++i) {
            ASSERT_TRUE(p2p.Send(peer,
                                 Message(r, peer, int(i) + round * 8, sizes[i]),
                                 5)
                            .ok());
          }
          for (size_t i = 0; i < sizes.size(); ++i) {
            std::vector<uint8_t> got(sizes[i]);
            Status s = p2p.Recv(peer, got, 5);
            ASSERT_TRUE(s.ok()) << s.ToString();
            ASSERT_EQ(got, Message(peer, r, int(i) + round * 8, sizes[i]))
                << "round " << round << " message " << i;
          }
        }
      },
      /*inline_bytes=*/512 << 10, /*max_bytes=*/1 << 20);
}

// A receive from any worker takes the first message under its tag from
// whoever sent one, says who, and keeps what it meets under other tags for
// their own receives; multi-piece messages too.
TEST(PointToPointTest, ReceiveFromAnyWorker) {
  OnPairs(3, [&](int r, PointToPoint& p2p) {
    if (r == 2) {
      ASSERT_TRUE(p2p.Send(0, Message(2, 0, 1, 300), 6).ok());
      ASSERT_TRUE(p2p.Send(0, Message(2, 0, 2, 40), 5).ok());
      return;
    }
    if (r == 1) {
      ASSERT_TRUE(p2p.Send(0, Message(1, 0, 0, 40), 5).ok());
      return;
    }
    std::set<int> from;
    for (int i = 0; i < 2; ++i) {
      std::vector<uint8_t> got(40);
      Result<int> q = p2p.RecvAny(got, 5);
      ASSERT_TRUE(q.ok()) << q.status().ToString();
      EXPECT_EQ(got, Message(*q, 0, *q == 1 ? 0 : 2, 40));
      from.insert(*q);
    }
    EXPECT_EQ(from, (std::set<int>{1, 2}));
    std::vector<uint8_t> kept(300);
    ASSERT_TRUE(p2p.Recv(2, kept, 6).ok());
    EXPECT_EQ(kept, Message(2, 0, 1, 300));
  });
}

// A receive from any worker is not starved by a receive naming the same
// sender that waits on that sender's stream: the latter lets the stream go
// while nothing arrives, and a message it kept under the other tag goes to
// the receive from any. (Worker 1 sends its second message only once the
// receive from any has its first.)
TEST(PointToPointTest, ReceiveFromAnyBesideAReceiveNamingTheSender) {
  OnPairs(2, [&](int r, PointToPoint& p2p) {
    if (r == 1) {
      ASSERT_TRUE(p2p.Send(0, Message(1, 0, 0, 16), 2).ok());
      std::vector<uint8_t> go(4);
      Status s = p2p.Recv(0, go, 9);
      ASSERT_TRUE(s.ok()) << s.ToString();
      ASSERT_TRUE(p2p.Send(0, Message(1, 0, 1, 16), 1).ok());
      return;
    }
    std::vector<uint8_t> a(16), b(16);
    std::thread named([&] {
      Status s = p2p.Recv(1, a, 1);
      EXPECT_TRUE(s.ok()) << s.ToString();
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    Result<int> q = p2p.RecvAny(b, 2);
    ASSERT_TRUE(q.ok()) << q.status().ToString();
    EXPECT_EQ(*q, 1);
    EXPECT_EQ(b, Message(1, 0, 0, 16));
    ASSERT_TRUE(p2p.Send(1, std::vector<uint8_t>(4), 9).ok());
    named.join();
    EXPECT_EQ(a, Message(1, 0, 1, 16));
  });
}

// Messages of one size from every worker, received from any: each
// arrives once, intact, with its sender named.
TEST(PointToPointTest, ReceiveFromAnyTakesEveryWorkersMessages) {
  const int world = 4, each = 5;
  const size_t n = 70 << 10;  // two pieces of the 64 KiB slots
  OnPairs(world, [&](int r, PointToPoint& p2p) {
    if (r != 0) {
      for (int i = 0; i < each; ++i) {
        ASSERT_TRUE(p2p.Send(0, Message(r, 0, i, n), 3).ok());
      }
      return;
    }
    std::map<int, int> next;  // per sender, the message expected next
    for (int k = 0; k < (world - 1) * each; ++k) {
      std::vector<uint8_t> got(n);
      Result<int> q = p2p.RecvAny(got, 3);
      ASSERT_TRUE(q.ok()) << q.status().ToString();
      ASSERT_EQ(got, Message(*q, 0, next[*q]++, n)) << "from " << *q;
    }
    for (int q = 1; q < world; ++q) EXPECT_EQ(next[q], each);
  });
}

// A message of another size than the receive's buffer is reported, and
// the next message arrives intact.
TEST(PointToPointTest, ASizeThatDiffersIsReportedAndTheStreamGoesOn) {
  OnPairs(2, [&](int r, PointToPoint& p2p) {
    if (r == 0) {
      ASSERT_TRUE(p2p.Send(1, Message(0, 1, 0, 100 << 10), 0).ok());
      ASSERT_TRUE(p2p.Send(1, Message(0, 1, 1, 12), 0).ok());
      ASSERT_TRUE(p2p.Send(1, Message(0, 1, 2, 8), 0).ok());
      return;
    }
    std::vector<uint8_t> small(20);
    Status s = p2p.Recv(0, small, 0);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.ToString().find("the send was 102400 bytes, the buffer "
                                "holds 20"),
              std::string::npos)
        << s.ToString();
    s = p2p.Recv(0, small, 0);
    EXPECT_NE(s.ToString().find("the send was 12 bytes"), std::string::npos);
    std::vector<uint8_t> ok(8);
    ASSERT_TRUE(p2p.Recv(0, ok, 0).ok());
    EXPECT_EQ(ok, Message(0, 1, 2, 8));
  });
}

// A receive waits for its sender's connection, which comes with the
// sender's first send.
TEST(PointToPointTest, AReceiveWaitsForTheSendersConnection) {
  OnPairs(2, [&](int r, PointToPoint& p2p) {
    if (r == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      ASSERT_TRUE(p2p.Send(1, Message(0, 1, 0, 100 << 10), 3).ok());
      return;
    }
    std::vector<uint8_t> got(100 << 10);
    Status s = p2p.Recv(0, got, 3);
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(got, Message(0, 1, 0, 100 << 10));
  });
}

// What reaches the acceptor from a holder of the secret that is not a
// worker of the job (garbage, a hello naming no worker, a second hello
// from a worker already connected) is refused without harm: the workers'
// own messages still go through.
TEST(PointToPointTest, HostileConnectionsAreRefused) {
  OnPairs(2, [&](int r, PointToPoint& p2p) {
    if (r == 1) {
      std::vector<uint8_t> got(100);
      Status s = p2p.Recv(0, got, 9);
      ASSERT_TRUE(s.ok()) << s.ToString();
      EXPECT_EQ(got, Message(0, 1, 0, 100));
      return;
    }
    transport::DeviceOptions o;
    o.listen_address = "127.0.0.1:0";
    o.name = "intruder";
    auto dev = transport::Device::Create(o);
    ASSERT_TRUE(dev.ok());
    auto bad = [&](std::vector<uint8_t> first) {
      auto ch = (*dev)->GetChannel(p2p.endpoint());
      ASSERT_TRUE(ch.ok()) << ch.status().ToString();
      ASSERT_TRUE((*ch)->SendControl(first).ok());
      // Refused: closed, with no descriptor sent.
      auto reply = (*ch)->RecvControl(std::chrono::seconds(10));
      EXPECT_FALSE(reply.ok());
    };
    bad({1, 2, 3});
    bad(EncodeRing({RingType::kHello, 0, 7}));  // no worker 7
    bad(EncodeRing({RingType::kHello, 0, 0}));  // itself
    bad(EncodeRing({RingType::kAck, 0, 1}));    // not a hello
    ASSERT_TRUE(p2p.Send(1, Message(0, 1, 0, 100), 9).ok());
  });
}

TEST(PointToPointTest, BadArgumentsAreRefused) {
  PointToPointOptions bad;
  bad.world = 2;
  bad.rank = 2;
  EXPECT_EQ(PointToPoint::Create(bad).status().code(),
            StatusCode::kInvalidArgument);
  PointToPointOptions o;
  o.world = 2;
  o.listen = "127.0.0.1:0";
  o.timeout = std::chrono::milliseconds(200);
  auto p = PointToPoint::Create(o);
  ASSERT_TRUE(p.ok());
  std::vector<uint8_t> v(4);
  // No endpoint for worker 1, and worker 1 never connects.
  EXPECT_EQ((*p)->Send(1, v, 0).code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ((*p)->Recv(1, v, 0).code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ((*p)->RecvAny(v, 0).status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ((*p)->Send(0, v, 0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*p)->Recv(5, v, 0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*p)->AddPeer(-1, "x").code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace membox::collective
