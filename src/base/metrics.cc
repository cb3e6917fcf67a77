#include "membox/base/metrics.h"

#include <cmath>

#include <fmt/format.h>

namespace membox {

void LatencyHistogram::Observe(std::chrono::nanoseconds d) {
  const double s = std::chrono::duration<double>(d).count();
  size_t i = 0;
  while (i < kBounds.size() && s > kBounds[i]) ++i;
  buckets_[i].fetch_add(1, std::memory_order_relaxed);
  count_.fetch_add(1, std::memory_order_relaxed);
  sum_ns_.fetch_add(static_cast<uint64_t>(std::max<int64_t>(0, d.count())),
                    std::memory_order_relaxed);
}

std::array<uint64_t, LatencyHistogram::kBounds.size() + 1>
LatencyHistogram::Cumulative() const {
  std::array<uint64_t, kBounds.size() + 1> c{};
  uint64_t run = 0;
  for (size_t i = 0; i < c.size(); ++i) {
    run += buckets_[i].load(std::memory_order_relaxed);
    c[i] = run;
  }
  return c;
}

namespace {

std::string Number(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (v == std::floor(v) && std::fabs(v) < 1e15) {
    return fmt::format("{}", static_cast<int64_t>(v));
  }
  return fmt::format("{}", v);
}

// Label values escape backslash, double quote and newline; HELP text
// escapes backslash and newline.
std::string Escape(const std::string& s, bool quotes) {
  std::string o;
  for (char c : s) {
    if (c == '\\') {
      o += "\\\\";
    } else if (c == '\n') {
      o += "\\n";
    } else if (c == '"' && quotes) {
      o += "\\\"";
    } else {
      o += c;
    }
  }
  return o;
}

}  // namespace

std::string MetricsWriter::Render(const Labels& labels) {
  if (labels.empty()) return "";
  std::string o = "{";
  for (size_t i = 0; i < labels.size(); ++i) {
    if (i) o += ",";
    o += labels[i].first + "=\"" + Escape(labels[i].second, true) + "\"";
  }
  return o + "}";
}

MetricsWriter::Family& MetricsWriter::Get(const std::string& name,
                                          const char* type,
                                          const std::string& help) {
  auto it = families_.find(name);
  if (it == families_.end()) {
    order_.push_back(name);
    it = families_.emplace(name, Family{type, help, {}}).first;
  }
  return it->second;
}

void MetricsWriter::Counter(const std::string& name, const std::string& help,
                            double value, const Labels& labels) {
  Get(name, "counter", help)
      .samples.push_back(name + Render(labels) + " " + Number(value));
}

void MetricsWriter::Gauge(const std::string& name, const std::string& help,
                          double value, const Labels& labels) {
  Get(name, "gauge", help)
      .samples.push_back(name + Render(labels) + " " + Number(value));
}

void MetricsWriter::Histogram(const std::string& name, const std::string& help,
                              const LatencyHistogram& h, const Labels& labels) {
  Family& f = Get(name, "histogram", help);
  auto c = h.Cumulative();
  for (size_t i = 0; i < c.size(); ++i) {
    Labels l = labels;
    l.emplace_back("le", i < LatencyHistogram::kBounds.size()
                             ? Number(LatencyHistogram::kBounds[i])
                             : "+Inf");
    f.samples.push_back(name + "_bucket" + Render(l) + " " +
                        Number(static_cast<double>(c[i])));
  }
  f.samples.push_back(name + "_sum" + Render(labels) + " " +
                      Number(h.sum_seconds()));
  f.samples.push_back(name + "_count" + Render(labels) + " " +
                      Number(static_cast<double>(c.back())));
}

std::string MetricsWriter::Text() const {
  std::string o;
  for (const auto& name : order_) {
    const Family& f = families_.at(name);
    o += "# HELP " + name + " " + Escape(f.help, false) + "\n";
    o += "# TYPE " + name + " " + f.type + "\n";
    for (const auto& s : f.samples) o += s + "\n";
  }
  return o;
}

}  // namespace membox
