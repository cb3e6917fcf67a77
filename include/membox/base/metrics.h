// Metrics in the Prometheus text exposition format (version 0.0.4): a
// latency histogram cheap enough for every request, and a writer that
// groups samples by metric name (one HELP and TYPE line each, whichever
// component adds samples first) and escapes label values.
//
// Thread-safety: LatencyHistogram::Observe and reads may run on any thread
// at once (relaxed atomics: a scrape sees each counter, not one instant).
// A MetricsWriter belongs to one scrape on one thread.
#ifndef MEMBOX_BASE_METRICS_H_
#define MEMBOX_BASE_METRICS_H_

#include <array>
#include <atomic>
#include <chrono>
#include <concepts>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace membox {

class LatencyHistogram {
 public:
  // Upper bounds in seconds: 10 us ... 10 s, then +Inf.
  static constexpr std::array<double, 13> kBounds = {
      1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1, 5, 10};

  void Observe(std::chrono::nanoseconds d);
  // Cumulative counts per bound (Prometheus buckets), +Inf last.
  std::array<uint64_t, kBounds.size() + 1> Cumulative() const;
  uint64_t count() const { return count_.load(std::memory_order_relaxed); }
  double sum_seconds() const {
    return sum_ns_.load(std::memory_order_relaxed) * 1e-9;
  }

 private:
  std::array<std::atomic<uint64_t>, kBounds.size() + 1> buckets_{};
  std::atomic<uint64_t> count_{0}, sum_ns_{0};
};

class MetricsWriter {
 public:
  using Labels = std::vector<std::pair<std::string, std::string>>;

  void Counter(const std::string& name, const std::string& help, double value,
               const Labels& labels = {});
  void Gauge(const std::string& name, const std::string& help, double value,
             const Labels& labels = {});
  // Counts (exact in the text up to 2^53).
  template <std::unsigned_integral T>
  void Counter(const std::string& name, const std::string& help, T value,
               const Labels& labels = {}) {
    Counter(name, help, static_cast<double>(value), labels);
  }
  template <std::unsigned_integral T>
  void Gauge(const std::string& name, const std::string& help, T value,
             const Labels& labels = {}) {
    Gauge(name, help, static_cast<double>(value), labels);
  }
  void Histogram(const std::string& name, const std::string& help,
                 const LatencyHistogram& h, const Labels& labels = {});

  // The exposition text, metrics in the order first added.
  std::string Text() const;

 private:
  struct Family {
    std::string type, help;
    std::vector<std::string> samples;
  };
  Family& Get(const std::string& name, const char* type,
              const std::string& help);
  static std::string Render(const Labels& labels);

  std::vector<std::string> order_;
  std::map<std::string, Family> families_;
};

}  // namespace membox

#endif  // MEMBOX_BASE_METRICS_H_
