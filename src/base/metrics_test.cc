#include "base/metrics.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>


namespace orbitkv {
namespace {

using ::testing::HasSubstr;

TEST(MetricsTest, CounterRendersWithHelpAndType) {
  MetricsRegistry r;
  r.GetCounter("orbitkv_hits_total", "Blocks served", {{"tier", "dram"}}).Increment(3);
  std::string text = r.RenderPrometheus();
  EXPECT_THAT(text, HasSubstr("# HELP orbitkv_hits_total Blocks served\n"));
  EXPECT_THAT(text, HasSubstr("# TYPE orbitkv_hits_total counter\n"));
  EXPECT_THAT(text, HasSubstr("orbitkv_hits_total{tier=\"dram\"} 3\n"));
}

TEST(MetricsTest, SameNameAndLabelsReturnSameMetricInAnyLabelOrder) {
  MetricsRegistry r;
  Counter& a = r.GetCounter("c_total", "h", {{"a", "1"}, {"b", "2"}});
  Counter& b = r.GetCounter("c_total", "h", {{"b", "2"}, {"a", "1"}});
  Counter& other = r.GetCounter("c_total", "h", {{"a", "1"}, {"b", "3"}});
  EXPECT_EQ(&a, &b);
  EXPECT_NE(&a, &other);
  a.Increment();
  b.Increment();
  EXPECT_EQ(a.Value(), 2u);
  EXPECT_THAT(r.RenderPrometheus(), HasSubstr("c_total{a=\"1\",b=\"2\"} 2\n"));
  EXPECT_THAT(r.RenderPrometheus(), HasSubstr("c_total{a=\"1\",b=\"3\"} 0\n"));
}

TEST(MetricsTest, GaugeSetAndAdd) {
  MetricsRegistry r;
  Gauge& g = r.GetGauge("orbitkv_pool_bytes", "Pool bytes in use");
  g.Set(1024);
  g.Add(-24);
  g.Add(0.5);
  EXPECT_DOUBLE_EQ(g.Value(), 1000.5);
  EXPECT_THAT(r.RenderPrometheus(), HasSubstr("orbitkv_pool_bytes 1000.5\n"));
}

TEST(MetricsTest, HistogramBucketsAreCumulativeWithInf) {
  MetricsRegistry r;
  Histogram& h = r.GetHistogram("lat_seconds", "Latency", {0.001, 0.01, 0.1});
  h.Observe(0.0005);
  h.Observe(0.001);  // Exactly on a bound: le is inclusive.
  h.Observe(0.05);
  h.Observe(5);
  EXPECT_EQ(h.BucketCounts(), (std::vector<uint64_t>{2, 0, 1, 1}));
  std::string text = r.RenderPrometheus();
  EXPECT_THAT(text, HasSubstr("# TYPE lat_seconds histogram\n"));
  EXPECT_THAT(text, HasSubstr("lat_seconds_bucket{le=\"0.001\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("lat_seconds_bucket{le=\"0.01\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("lat_seconds_bucket{le=\"0.1\"} 3\n"));
  EXPECT_THAT(text, HasSubstr("lat_seconds_bucket{le=\"+Inf\"} 4\n"));
  EXPECT_THAT(text, HasSubstr("lat_seconds_count 4\n"));
  EXPECT_THAT(text, HasSubstr("lat_seconds_sum 5.0515\n"));
}

TEST(MetricsTest, HistogramIgnoresNaNAndCountsInfinityInLastBucket) {
  MetricsRegistry r;
  Histogram& h = r.GetHistogram("x", "x", {1});
  h.Observe(std::nan(""));
  h.Observe(INFINITY);
  EXPECT_EQ(h.BucketCounts(), (std::vector<uint64_t>{0, 1}));
  EXPECT_EQ(h.Count(), 1u);
}

TEST(MetricsTest, HistogramLabelsPrecedeLe) {
  MetricsRegistry r;
  r.GetHistogram("size_bytes", "Sizes", {10}, {{"op", "save"}}).Observe(3);
  EXPECT_THAT(r.RenderPrometheus(), HasSubstr("size_bytes_bucket{op=\"save\",le=\"10\"} 1\n"));
  EXPECT_THAT(r.RenderPrometheus(), HasSubstr("size_bytes_count{op=\"save\"} 1\n"));
}

TEST(MetricsTest, EscapesLabelValuesAndHelp) {
  MetricsRegistry r;
  r.GetGauge("g", "line one\nline \\two", {{"path", "a\"b\\c\nd"}}).Set(1);
  std::string text = r.RenderPrometheus();
  EXPECT_THAT(text, HasSubstr("# HELP g line one\\nline \\\\two\n"));
  EXPECT_THAT(text, HasSubstr("g{path=\"a\\\"b\\\\c\\nd\"} 1\n"));
}

TEST(MetricsTest, FamiliesRenderSortedByName) {
  MetricsRegistry r;
  r.GetCounter("z_total", "z");
  r.GetCounter("a_total", "a");
  std::string text = r.RenderPrometheus();
  EXPECT_LT(text.find("a_total"), text.find("z_total"));
}

TEST(MetricsTest, ExponentialBounds) {
  EXPECT_EQ(Histogram::ExponentialBounds(1, 2, 4), (std::vector<double>{1, 2, 4, 8}));
}

TEST(MetricsTest, NameValidation) {
  EXPECT_TRUE(MetricsRegistry::IsValidMetricName("orbitkv:hits_total"));
  EXPECT_FALSE(MetricsRegistry::IsValidMetricName("9lives"));
  EXPECT_FALSE(MetricsRegistry::IsValidMetricName("has-dash"));
  EXPECT_FALSE(MetricsRegistry::IsValidMetricName(""));
  EXPECT_TRUE(MetricsRegistry::IsValidLabelName("tier"));
  EXPECT_FALSE(MetricsRegistry::IsValidLabelName("__reserved"));
  EXPECT_FALSE(MetricsRegistry::IsValidLabelName("a:b"));
}

TEST(MetricsDeathTest, MisuseCrashes) {
  MetricsRegistry r;
  r.GetCounter("x_total", "x");
  EXPECT_DEATH(r.GetGauge("x_total", "x"), "another type");
  EXPECT_DEATH(r.GetCounter("bad-name", "x"), "invalid metric name");
  EXPECT_DEATH(r.GetCounter("y_total", "x", {{"a", "1"}, {"a", "2"}}), "duplicate label");
  r.GetHistogram("h", "h", {1, 2});
  EXPECT_DEATH(r.GetHistogram("h", "h", {1, 3}, {{"k", "v"}}), "other bounds");
  EXPECT_DEATH(r.GetHistogram("h2", "h", {2, 1}), "strictly increasing");
}

}  // namespace
}  // namespace orbitkv
