#include "membox/ps/client_environment.h"

#include <cstdlib>

#include <gtest/gtest.h>

namespace membox::ps {
namespace {

// Sets the client's variables for one test and clears them after it.
class ClientEnvironmentTest : public ::testing::Test {
 protected:
  void TearDown() override {
    for (const char* v :
         {"MEMBOX_RESTART", "MEMBOX_PROXY_DELAYS_MS", "MEMBOX_HANG_REPORT_S",
          "MEMBOX_FAILOVER_S", "MEMBOX_COMBINE", "MEMBOX_HOLD_PUSHES"}) {
      ::unsetenv(v);
    }
  }
  static ParamClientOptions TwoProxies() {
    ParamClientOptions o;
    o.proxies = {"a:1", "b:2"};
    return o;
  }
};

TEST_F(ClientEnvironmentTest, UnsetLeavesTheOptions) {
  ParamClientOptions o = TwoProxies();
  ASSERT_TRUE(ApplyClientEnvironment(&o).ok());
  ParamClientOptions d = TwoProxies();
  EXPECT_EQ(o.restarted, d.restarted);
  EXPECT_TRUE(o.links.empty());
  EXPECT_EQ(o.hang_report, d.hang_report);
  EXPECT_EQ(o.failover, d.failover);
  EXPECT_EQ(o.combine, d.combine);
  EXPECT_EQ(o.hold_pushes, d.hold_pushes);
}

TEST_F(ClientEnvironmentTest, EachVariableSetsItsOption) {
  ::setenv("MEMBOX_RESTART", "1", 1);
  ::setenv("MEMBOX_PROXY_DELAYS_MS", "0,2.5", 1);
  ::setenv("MEMBOX_HANG_REPORT_S", "0", 1);
  ::setenv("MEMBOX_FAILOVER_S", "1.5", 1);
  ::setenv("MEMBOX_COMBINE", "0", 1);
  ::setenv("MEMBOX_HOLD_PUSHES", "always", 1);
  ParamClientOptions o = TwoProxies();
  ASSERT_TRUE(ApplyClientEnvironment(&o).ok());
  EXPECT_TRUE(o.restarted);
  ASSERT_EQ(o.links.size(), 2u);
  EXPECT_EQ(o.links[0].fixed_latency, std::chrono::nanoseconds(0));
  EXPECT_EQ(o.links[1].fixed_latency, std::chrono::microseconds(2500));
  EXPECT_EQ(o.hang_report, std::chrono::milliseconds(0));
  EXPECT_EQ(o.failover, std::chrono::milliseconds(1500));
  EXPECT_FALSE(o.combine);
  EXPECT_EQ(o.hold_pushes, ParamClientOptions::HoldPushes::kAlways);
}

TEST_F(ClientEnvironmentTest, ZeroDelaysAndExplicitLinksAddNoLinkModel) {
  ::setenv("MEMBOX_PROXY_DELAYS_MS", "0,0", 1);
  ParamClientOptions o = TwoProxies();
  ASSERT_TRUE(ApplyClientEnvironment(&o).ok());
  EXPECT_TRUE(o.links.empty());
  ::setenv("MEMBOX_PROXY_DELAYS_MS", "5,5", 1);
  o.links.resize(2);  // the caller's own link models win
  ASSERT_TRUE(ApplyClientEnvironment(&o).ok());
  EXPECT_EQ(o.links[0].fixed_latency, std::chrono::nanoseconds(0));
  ::setenv("MEMBOX_RESTART", "0", 1);
  ASSERT_TRUE(ApplyClientEnvironment(&o).ok());
  EXPECT_FALSE(o.restarted);
}

TEST_F(ClientEnvironmentTest, MalformedValuesAreErrorsNamingTheVariable) {
  const std::pair<const char*, const char*> bad[] = {
      {"MEMBOX_PROXY_DELAYS_MS", "1,x"},   {"MEMBOX_PROXY_DELAYS_MS", "1"},
      {"MEMBOX_PROXY_DELAYS_MS", "1,,2"},  {"MEMBOX_PROXY_DELAYS_MS", "-1,0"},
      {"MEMBOX_HANG_REPORT_S", "ten"},     {"MEMBOX_HANG_REPORT_S", "-1"},
      {"MEMBOX_FAILOVER_S", "1e9"},        {"MEMBOX_COMBINE", "yes"},
      {"MEMBOX_HOLD_PUSHES", "sometimes"},
  };
  for (const auto& [name, value] : bad) {
    ::setenv(name, value, 1);
    ParamClientOptions o = TwoProxies();
    Status s = ApplyClientEnvironment(&o);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << name << "=" << value;
    EXPECT_NE(std::string(s.message()).find(name), std::string::npos)
        << s.ToString();
    ::unsetenv(name);
  }
}

}  // namespace
}  // namespace membox::ps
