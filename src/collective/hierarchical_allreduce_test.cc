#include "membox/collective/hierarchical_allreduce.h"

#include <thread>

#include <gtest/gtest.h>

#include "src/collective/loopback_group_test_util.h"

namespace membox::collective {
namespace {

void RunHier(int world, int local, size_t count, int calls) {
  std::vector<std::unique_ptr<HierarchicalAllreduce>> w;
  std::vector<std::string> eps;
  StartLoopback<HierarchicalAllreduce, HierarchicalOptions>(
      world,
      [&](HierarchicalOptions& o) {
        o.local_size = local;
        o.max_bytes = count * 4;
      },
      &w, &eps);
  ASSERT_EQ(w.size(), size_t(world));
  OnEachRank(world, [&](int r) {
    Status c = w[r]->Connect(eps);
    ASSERT_TRUE(c.ok()) << c.ToString();
    std::vector<float> v(count);
    for (int call = 0; call < calls; ++call) {
      for (size_t i = 0; i < count; ++i) v[i] = float(r * 3 + call + i % 5);
      Status s = w[r]->Allreduce(v.data(), count);
      ASSERT_TRUE(s.ok()) << s.ToString();
      for (size_t i = 0; i < count; i += 97) {
        float want = 0;
        for (int q = 0; q < world; ++q) want += float(q * 3 + call + i % 5);
        ASSERT_EQ(v[i], want) << "rank " << r << " call " << call;
      }
    }
  });
}

TEST(HierarchicalAllreduceTest, NodesTimesLocalRanks) {
  RunHier(8, 2, 3001, 3);  // 4 nodes of 2: trees + 2 doubling steps
  RunHier(6, 3, 1000, 2);  // 2 nodes of 3
  RunHier(4, 4, 500, 2);   // one node: the tree only
  RunHier(4, 1, 500, 2);   // four nodes of one: doubling only
}

TEST(HierarchicalAllreduceTest, RejectsBadShapes) {
  HierarchicalOptions o;
  o.world = 6;
  o.local_size = 2;  // 3 nodes: not a power of two
  EXPECT_EQ(HierarchicalAllreduce::Create(o).status().code(),
            StatusCode::kInvalidArgument);
  o.local_size = 4;  // 6 % 4 != 0
  EXPECT_FALSE(HierarchicalAllreduce::Create(o).ok());
}

}  // namespace
}  // namespace membox::collective
