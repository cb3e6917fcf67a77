#include "src/transport/control_inbox.h"

#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace membox::transport {
namespace {

std::vector<uint8_t> Msg(char c) { return {static_cast<uint8_t>(c)}; }

// A server installs its handlers after the peer's first messages arrived
// (they wait in the queue). A message the receiving thread delivers while
// those are handed over must come after them: a peer's hello queued before
// SetHandlers, then a notice delivered straight to the handler, reached a
// proxy in the wrong order ("say hello first").
TEST(ControlInboxTest, AMessageDuringTheHandOverWaitsBehindTheQueuedOnes) {
  ControlInbox inbox;
  inbox.Deliver(Msg('a'));
  inbox.Deliver(Msg('b'));
  std::vector<char> seen;
  inbox.SetHandlers(
      [&](std::vector<uint8_t> m) {
        if (m[0] == 'a') {
          // The receiving thread delivers the next message now.
          std::thread([&] { inbox.Deliver(Msg('c')); }).join();
        }
        seen.push_back(static_cast<char>(m[0]));
      },
      [](const Status&) {});
  EXPECT_EQ(seen, (std::vector<char>{'a', 'b', 'c'}));
  // After the hand-over, messages go straight to the handler.
  inbox.Deliver(Msg('d'));
  EXPECT_EQ(seen.back(), 'd');
  inbox.Detach();
}

// A failure during the hand-over is told once, after the queued messages.
TEST(ControlInboxTest, AFailureDuringTheHandOverComesAfterTheMessages) {
  ControlInbox inbox;
  inbox.Deliver(Msg('a'));
  inbox.Deliver(Msg('b'));
  std::vector<std::string> seen;
  inbox.SetHandlers(
      [&](std::vector<uint8_t> m) {
        if (m[0] == 'a') {
          std::thread([&] { inbox.Fail(UnavailableError("gone")); }).join();
        }
        seen.push_back(std::string(1, static_cast<char>(m[0])));
      },
      [&](const Status& s) { seen.push_back(std::string(s.message())); });
  EXPECT_EQ(seen, (std::vector<std::string>{"a", "b", "gone"}));
  inbox.Fail(UnavailableError("again"));  // first failure wins, told once
  EXPECT_EQ(seen.size(), 3u);
  inbox.Detach();
}

// A failure before the handlers exist is told when they are installed,
// after what was queued; without handlers, Receive returns the queue, then
// the failure.
TEST(ControlInboxTest, QueuedMessagesThenTheFailure) {
  ControlInbox inbox;
  inbox.Deliver(Msg('a'));
  inbox.Fail(UnavailableError("gone"));
  auto m = inbox.Receive(std::chrono::milliseconds(10), "peer");
  ASSERT_TRUE(m.ok());
  EXPECT_EQ((*m)[0], 'a');
  auto f = inbox.Receive(std::chrono::milliseconds(10), "peer");
  EXPECT_EQ(f.status().code(), StatusCode::kUnavailable);

  ControlInbox later;
  later.Deliver(Msg('x'));
  later.Fail(UnavailableError("gone"));
  std::vector<std::string> seen;
  later.SetHandlers(
      [&](std::vector<uint8_t> m) {
        seen.push_back(std::string(1, static_cast<char>(m[0])));
      },
      [&](const Status& s) { seen.push_back(std::string(s.message())); });
  EXPECT_EQ(seen, (std::vector<std::string>{"x", "gone"}));
  later.Detach();
}

// A zero timeout polls once (PointToPoint asks whether an ACK is here
// without waiting): it drives the progress hook once, takes what that
// brought, and otherwise says nothing came.
TEST(ControlInboxTest, AZeroTimeoutPollsOnce) {
  ControlInbox inbox;
  int progressed = 0;
  auto none =
      inbox.Receive(std::chrono::nanoseconds(0), "peer", [&] { ++progressed; });
  EXPECT_EQ(none.status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(progressed, 1);
  auto brought = inbox.Receive(std::chrono::nanoseconds(0), "peer", [&] {
    ++progressed;
    inbox.Deliver(Msg('p'));
  });
  ASSERT_TRUE(brought.ok()) << brought.status().ToString();
  EXPECT_EQ((*brought)[0], 'p');
  EXPECT_EQ(progressed, 2);
}

}  // namespace
}  // namespace membox::transport
