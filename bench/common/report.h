// The benchmark contract shared by every `membox bench <name>` (docs/design/
// benchmarks.md): records {"bench","variant","size_bytes","workers","metric",
// "value","unit"[,"case"]}, written as JSON and CSV, printed as a table with
// ratios to the baselines, and plotted to PNG by bench/plot_bench.py.
//
// Thread-safety: a Report is used by one thread.
#ifndef MEMBOX_BENCH_COMMON_REPORT_H_
#define MEMBOX_BENCH_COMMON_REPORT_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "membox/base/status.h"

namespace membox::bench {

struct Record {
  std::string bench;
  std::string variant;
  uint64_t size_bytes = 0;
  int workers = 0;
  std::string metric;
  double value = 0;
  std::string unit;
  std::string case_name;  // optional: model or scenario
};

struct CommonFlags {
  bool quick = false;
  std::string csv;
  std::string plot;
  std::string json;
};

// The interpreter that runs the Python baselines (Gloo through torch) and
// the plots: MEMBOX_PYTHON when set (a venv with PyPI's torch 2.x, as
// scripts/run-demo.sh sets it), else Debian's /usr/bin/python3.
std::string BaselinePython();

class Report {
 public:
  explicit Report(std::string bench) : bench_(std::move(bench)) {}
  void Add(Record r);
  const std::vector<Record>& records() const { return records_; }
  // Value of one record, if measured.
  std::optional<double> Find(const std::string& variant, uint64_t size,
                             const std::string& metric) const;

  Status WriteJson(const std::string& path) const;
  Status WriteCsv(const std::string& path) const;
  // Calls bench/plot_bench.py (matplotlib, under BaselinePython()) on a CSV.
  // `spec` tells the plotter which metric to draw and how.
  // `metric` may list several, comma-separated; `x` is "size" or "workers".
  Status Plot(const std::string& png, const std::string& metric,
              const std::string& title, bool log_y,
              const std::string& x = "size") const;
  // Writes what the flags ask for.
  Status Finish(const CommonFlags& flags, const std::string& plot_metric,
                const std::string& title, bool log_y,
                const std::string& x = "size") const;

 private:
  std::string bench_;
  std::vector<Record> records_;
};

// "1KiB", "64MiB", "1GiB".
std::string SizeLabel(uint64_t bytes);
// Progress line on stderr ("[12/40] membox 64MiB ...").
void Progress(int done, int total, const std::string& what);

}  // namespace membox::bench

#endif  // MEMBOX_BENCH_COMMON_REPORT_H_
