#include "bench/common/report.h"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <unistd.h>

#include "membox/base/config.h"

namespace membox::bench {

std::string BaselinePython() {
  const char* p = std::getenv("MEMBOX_PYTHON");
  return p && *p ? std::string(p) : std::string("/usr/bin/python3");
}
namespace {

std::string JsonEscape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    o += c;
  }
  return o;
}

std::string FindPlotScript() {
  // Next to the source tree (build/<preset>/tools/membox -> ../../../bench).
  char exe[4096] = {0};
  ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  std::filesystem::path p =
      n > 0 ? std::filesystem::path(std::string(exe, static_cast<size_t>(n)))
            : std::filesystem::path(".");
  for (auto dir = p.parent_path(); !dir.empty() && dir != dir.root_path();
       dir = dir.parent_path()) {
    auto cand = dir / "bench" / "plot_bench.py";
    if (std::filesystem::exists(cand)) return cand.string();
  }
  if (std::filesystem::exists(MEMBOX_SOURCE_DIR "/bench/plot_bench.py")) {
    return MEMBOX_SOURCE_DIR "/bench/plot_bench.py";
  }
  return "";
}

}  // namespace

void Report::Add(Record r) {
  r.bench = bench_;
  records_.push_back(std::move(r));
}

std::optional<double> Report::Find(const std::string& variant, uint64_t size,
                                   const std::string& metric) const {
  for (const auto& r : records_) {
    if (r.variant == variant && r.size_bytes == size && r.metric == metric)
      return r.value;
  }
  return std::nullopt;
}

Status Report::WriteJson(const std::string& path) const {
  std::ofstream out(path);
  if (!out) return NotFoundError("cannot write " + path);
  out << "[\n";
  for (size_t i = 0; i < records_.size(); ++i) {
    const Record& r = records_[i];
    char value[64];
    std::snprintf(value, sizeof(value), "%.6g", r.value);
    out << "  {\"bench\": \"" << JsonEscape(r.bench) << "\", \"variant\": \""
        << JsonEscape(r.variant) << "\", \"size_bytes\": " << r.size_bytes
        << ", \"workers\": " << r.workers << ", \"metric\": \""
        << JsonEscape(r.metric) << "\", \"value\": " << value
        << ", \"unit\": \"" << JsonEscape(r.unit) << "\"";
    if (!r.case_name.empty())
      out << ", \"case\": \"" << JsonEscape(r.case_name) << "\"";
    out << "}" << (i + 1 < records_.size() ? "," : "") << "\n";
  }
  out << "]\n";
  return out.good() ? Status::Ok() : DataLossError("short write to " + path);
}

Status Report::WriteCsv(const std::string& path) const {
  std::ofstream out(path);
  if (!out) return NotFoundError("cannot write " + path);
  out << "bench,variant,size_bytes,workers,metric,value,unit,case\n";
  for (const Record& r : records_) {
    char value[64];
    std::snprintf(value, sizeof(value), "%.6g", r.value);
    out << r.bench << "," << r.variant << "," << r.size_bytes << ","
        << r.workers << "," << r.metric << "," << value << "," << r.unit << ","
        << r.case_name << "\n";
  }
  return out.good() ? Status::Ok() : DataLossError("short write to " + path);
}

Status Report::Plot(const std::string& png, const std::string& metric,
                    const std::string& title, bool log_y,
                    const std::string& x) const {
  std::string script = FindPlotScript();
  if (script.empty()) return NotFoundError("bench/plot_bench.py not found");
  std::string csv = png + ".tmp.csv";
  RETURN_IF_ERROR(WriteCsv(csv));
  std::string cmd = fmt::format(
      "'{}' '{}' --csv '{}' --out '{}' --metric '{}' --title '{}'{} --x {}",
      BaselinePython(), script, csv, png, metric, title,
      log_y ? " --log-y" : "", x);
  int rc = std::system(cmd.c_str());
  std::filesystem::remove(csv);
  if (rc != 0) return InternalError("plotting failed (" + cmd + ")");
  return Status::Ok();
}

Status Report::Finish(const CommonFlags& flags, const std::string& plot_metric,
                      const std::string& title, bool log_y,
                      const std::string& x) const {
  if (!flags.json.empty()) RETURN_IF_ERROR(WriteJson(flags.json));
  if (!flags.csv.empty()) RETURN_IF_ERROR(WriteCsv(flags.csv));
  if (!flags.plot.empty())
    RETURN_IF_ERROR(Plot(flags.plot, plot_metric, title, log_y, x));
  return Status::Ok();
}

std::string SizeLabel(uint64_t bytes) { return FormatByteSize(bytes); }

void Progress(int done, int total, const std::string& what) {
  std::fprintf(stderr, "[%d/%d] %s\n", done, total, what.c_str());
  std::fflush(stderr);
}

}  // namespace membox::bench
