#include "base/metrics.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
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

// A part that keeps its own figures: what a collector visits.
struct Figures {
  std::atomic<uint64_t> served{0};
  std::atomic<int64_t> open{0};
  void Visit(StatsVisitor& v) const {
    v.Counter("served", served.load(), {"b_served_total", "Requests served"});
    v.Gauge("open", open.load(), {"d_open", "Open now"});
    v.Counter("", 7, {"c_rejected_total", "Refused", "reason", "stale"});
    v.Counter("", 2, {"c_rejected_total", "Refused", "reason", "busy"});
    v.Real("uptime_s", 1.26, 1, {});  // JSON only
    v.Text("state", "up \"now\"");    // JSON only
  }
};

TEST(MetricsTest, CollectedFiguresRenderSortedAmongRegisteredOnesUntilTheirHandleGoes) {
  MetricsRegistry r;
  r.GetCounter("a_total", "a").Increment(1);
  r.GetGauge("e_level", "e").Set(3);
  Figures figures;
  figures.served = 5;
  figures.open = -2;
  {
    auto handle = r.AddCollector([&figures](StatsVisitor& v) { figures.Visit(v); });
    std::string text = r.RenderPrometheus();
    EXPECT_THAT(text, ::testing::HasSubstr("# HELP b_served_total Requests served\n# TYPE b_served_total counter\n"
                                           "b_served_total 5\n"));
    EXPECT_THAT(text, ::testing::HasSubstr("# TYPE d_open gauge\nd_open -2\n"));
    EXPECT_THAT(text,
                ::testing::HasSubstr("c_rejected_total{reason=\"busy\"} 2\nc_rejected_total{reason=\"stale\"} 7\n"));
    EXPECT_EQ(text.find("uptime"), std::string::npos);  // no metric named: JSON only
    EXPECT_LT(text.find("a_total"), text.find("b_served_total"));
    EXPECT_LT(text.find("c_rejected_total"), text.find("d_open"));
    EXPECT_LT(text.find("d_open"), text.find("e_level"));
    figures.served = 6;  // read at each render: counted in one place
    EXPECT_THAT(r.RenderPrometheus(), ::testing::HasSubstr("b_served_total 6\n"));
  }
  EXPECT_EQ(r.RenderPrometheus().find("b_served_total"), std::string::npos);  // its handle went
}

TEST(MetricsTest, TheJsonWriterWritesEachKeyOnceInItsForm) {
  Figures figures;
  figures.served = 5;
  figures.open = -2;
  JsonStatsWriter json;
  figures.Visit(json);
  EXPECT_EQ(json.json(), ", \"served\": 5, \"open\": -2, \"uptime_s\": 1.3, \"state\": \"up \\\"now\\\"\"");
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
  auto twice = r.AddCollector([](StatsVisitor& v) { v.Counter("", 1, {"x_total", "x"}); });
  EXPECT_DEATH(r.RenderPrometheus(), "both registered and collected");
}

}  // namespace
}  // namespace orbitkv
