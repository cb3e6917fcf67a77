// Test helper for the collective tests: `world` instances of one
// collective on loopback, and a body run on one thread per rank.
//
// Threading: StartLoopback runs on the test's thread; OnEachRank runs
// body(rank) on `world` threads and joins them before it returns.
#ifndef MEMBOX_SRC_COLLECTIVE_LOOPBACK_GROUP_TEST_UTIL_H_
#define MEMBOX_SRC_COLLECTIVE_LOOPBACK_GROUP_TEST_UTIL_H_

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace membox::collective {

// `world` instances of T (RingAllreduce, Mesh, PointToPoint, ...), rank r
// made by T::Create with rank r of `world`, listening on 127.0.0.1, and the
// rest of its options set by set(options). Appends them to `out` and their
// endpoints to `eps`; a failed Create fails the test (ASSERT: the caller
// checks HasFatalFailure, or just goes on to a test already failed).
template <typename T, typename Options, typename Set>
void StartLoopback(int world, Set set, std::vector<std::unique_ptr<T>>* out,
                   std::vector<std::string>* eps) {
  for (int r = 0; r < world; ++r) {
    Options o;
    o.rank = r;
    o.world = world;
    o.listen = "127.0.0.1:0";
    set(o);
    auto made = T::Create(o);
    ASSERT_TRUE(made.ok()) << "rank " << r << ": " << made.status().ToString();
    eps->push_back((*made)->endpoint());
    out->push_back(std::move(*made));
  }
}

// body(rank) on one thread per rank, all joined.
template <typename Body>
void OnEachRank(int world, Body body) {
  std::vector<std::thread> th;
  for (int r = 0; r < world; ++r) th.emplace_back([&body, r] { body(r); });
  for (auto& t : th) t.join();
}

}  // namespace membox::collective

#endif  // MEMBOX_SRC_COLLECTIVE_LOOPBACK_GROUP_TEST_UTIL_H_
