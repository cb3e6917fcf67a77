#include "membox/base/metrics.h"

#include <gtest/gtest.h>

namespace membox {
namespace {

using namespace std::chrono_literals;

TEST(MetricsTest, HistogramBucketsAreCumulative) {
  LatencyHistogram h;
  h.Observe(5us);  // <= 10 us
  h.Observe(2ms);  // <= 5 ms
  h.Observe(2ms);
  h.Observe(60s);  // +Inf only
  auto c = h.Cumulative();
  EXPECT_EQ(c[0], 1u);
  EXPECT_EQ(c[4], 1u);   // <= 1 ms
  EXPECT_EQ(c[5], 3u);   // <= 5 ms
  EXPECT_EQ(c[12], 3u);  // <= 10 s
  EXPECT_EQ(c[13], 4u);  // +Inf
  EXPECT_EQ(h.count(), 4u);
  EXPECT_NEAR(h.sum_seconds(), 60.004005, 1e-6);
}

TEST(MetricsTest, FamiliesAreGroupedAndLabelsEscaped) {
  MetricsWriter w;
  w.Counter("membox_requests_total", "Requests.", 3, {{"service", "a"}});
  w.Gauge("membox_pool_bytes", "Pool size.", 1.5);
  w.Counter("membox_requests_total", "ignored", 4,
            {{"service", "b \"x\"\\\n"}});
  LatencyHistogram h;
  h.Observe(1ms);
  w.Histogram("membox_latency_seconds", "Latency.", h, {{"service", "a"}});
  std::string t = w.Text();
  EXPECT_NE(t.find("# HELP membox_requests_total Requests.\n"
                   "# TYPE membox_requests_total counter\n"
                   "membox_requests_total{service=\"a\"} 3\n"
                   "membox_requests_total{service=\"b \\\"x\\\"\\\\\\n\"} 4\n"
                   "# HELP membox_pool_bytes"),
            std::string::npos)
      << t;
  EXPECT_NE(t.find("membox_pool_bytes 1.5\n"), std::string::npos) << t;
  EXPECT_NE(
      t.find("membox_latency_seconds_bucket{service=\"a\",le=\"0.0005\"} "
             "0\nmembox_latency_seconds_bucket{service=\"a\",le=\"0.001\"} 1"),
      std::string::npos)
      << t;
  EXPECT_NE(
      t.find("membox_latency_seconds_bucket{service=\"a\",le=\"+Inf\"} 1\n"
             "membox_latency_seconds_sum{service=\"a\"} 0.001\n"
             "membox_latency_seconds_count{service=\"a\"} 1\n"),
      std::string::npos)
      << t;
  EXPECT_EQ(t.find("ignored"), std::string::npos);
}

}  // namespace
}  // namespace membox
