#include "membox/base/completion.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>

#include <gtest/gtest.h>

namespace membox {
namespace {

using std::chrono::milliseconds;
using Handle = AsyncHandle<CompletionState>;

TEST(CompletionTest, CallbackRunsBeforeDoneAndOnce) {
  std::atomic<int> calls{0};
  bool done_in_callback = true;
  auto s = std::make_shared<CompletionState>([&](const Status& st) {
    calls++;
    done_in_callback = false;
    EXPECT_EQ(st.code(), StatusCode::kNotFound);
  });
  Handle h(s);
  std::thread t([s] {
    std::this_thread::sleep_for(milliseconds(20));
    EXPECT_TRUE(s->Finish(NotFoundError("x")));
    EXPECT_FALSE(s->Finish(Status::Ok()));  // the first finish wins
  });
  // A waiter that returns sees the callback's effects.
  EXPECT_EQ(h.Wait().code(), StatusCode::kNotFound);
  EXPECT_FALSE(done_in_callback);
  t.join();
  EXPECT_EQ(calls.load(), 1);
  EXPECT_TRUE(h.done());
}

TEST(CompletionTest, WaitTimesOutWithoutCancelling) {
  auto s = std::make_shared<CompletionState>();
  Handle h(s);
  EXPECT_EQ(h.Wait(milliseconds(5)).code(), StatusCode::kDeadlineExceeded);
  EXPECT_FALSE(s->done());
  s->Finish(Status::Ok());
  EXPECT_TRUE(h.Wait(milliseconds(5)).ok());
}

TEST(CompletionTest, DestroyingAPendingHandleWaitsUntilDone) {
  auto s = std::make_shared<CompletionState>();
  std::atomic<bool> finished{false};
  std::thread t([s, &finished] {
    std::this_thread::sleep_for(milliseconds(50));
    finished = true;
    s->Finish(Status::Ok());
  });
  { Handle h(s); }  // waits here
  EXPECT_TRUE(finished.load());
  EXPECT_TRUE(s->done());
  t.join();
}

TEST(CompletionTest, AssigningOverAPendingHandleWaits) {
  auto s = std::make_shared<CompletionState>();
  std::thread t([s] {
    std::this_thread::sleep_for(milliseconds(30));
    s->Finish(Status::Ok());
  });
  Handle h(s);
  h = Handle(std::make_shared<CompletionState>());
  EXPECT_TRUE(s->done());
  (void)h.Detach();
  t.join();
}

TEST(CompletionTest, ACallbackMayDropItsOwnHandle) {
  // The handle's destructor, in the operation's own callback, does not
  // wait for it (no deadlock): the operation is released there.
  auto holder = std::make_shared<std::unique_ptr<Handle>>();
  auto s = std::make_shared<CompletionState>(
      [holder](const Status&) { holder->reset(); });
  *holder = std::make_unique<Handle>(s);
  s->Finish(Status::Ok());
  EXPECT_EQ(*holder, nullptr);
  EXPECT_TRUE(s->done());
}

TEST(CompletionTest, DetachGivesUpWithoutWaiting) {
  auto s = std::make_shared<CompletionState>();
  {
    Handle h(s);
    auto kept = h.Detach();
    EXPECT_FALSE(h.valid());
    EXPECT_EQ(kept, s);
  }  // no wait: nothing finished it
  EXPECT_FALSE(s->done());
  EXPECT_EQ(Handle().Wait().code(), StatusCode::kFailedPrecondition);
}

TEST(CompletionTest, WaitDrivesProgress) {
  auto s = std::make_shared<CompletionState>();
  int polls = 0;
  s->set_progress([&] {
    if (++polls == 3) s->Finish(Status::Ok());
  });
  EXPECT_TRUE(Handle(s).Wait(std::chrono::seconds(5)).ok());
  EXPECT_EQ(polls, 3);
}

TEST(CompletionTest, OneDefaultTimeout) {
  EXPECT_EQ(kDefaultWaitTimeout, std::chrono::minutes(10));
}

}  // namespace
}  // namespace membox
