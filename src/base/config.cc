#include "membox/base/config.h"

#include <cctype>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace membox {
namespace {

std::string_view Trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front())))
    s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back())))
    s.remove_suffix(1);
  return s;
}

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out)
    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// Splits "123abc" into its number and its suffix. Returns false when there is
// no leading digit or the number overflows.
bool SplitNumber(std::string_view text, uint64_t* number, std::string* suffix) {
  text = Trim(text);
  size_t i = 0;
  uint64_t n = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) {
    uint64_t d = static_cast<uint64_t>(text[i] - '0');
    if (n > (UINT64_MAX - d) / 10) return false;
    n = n * 10 + d;
    ++i;
  }
  if (i == 0) return false;
  *number = n;
  *suffix = Lower(Trim(text.substr(i)));
  return true;
}

}  // namespace

Result<uint64_t> ParseByteSize(std::string_view text) {
  uint64_t n = 0;
  std::string suffix;
  if (!SplitNumber(text, &n, &suffix)) {
    return InvalidArgumentError("not a byte size: '" + std::string(text) + "'");
  }
  int shift = 0;
  if (suffix.empty() || suffix == "b")
    shift = 0;
  else if (suffix == "k" || suffix == "kb" || suffix == "kib")
    shift = 10;
  else if (suffix == "m" || suffix == "mb" || suffix == "mib")
    shift = 20;
  else if (suffix == "g" || suffix == "gb" || suffix == "gib")
    shift = 30;
  else if (suffix == "t" || suffix == "tb" || suffix == "tib")
    shift = 40;
  else {
    return InvalidArgumentError("unknown size unit '" + suffix + "' in '" +
                                std::string(text) + "'");
  }
  if (shift > 0 && n > (UINT64_MAX >> shift)) {
    return OutOfRangeError("byte size overflows 64 bits: '" +
                           std::string(text) + "'");
  }
  return n << shift;
}

std::string FormatByteSize(uint64_t bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (u < 4 && bytes >= 1024 && bytes % 1024 == 0) {
    bytes /= 1024;
    ++u;
  }
  return std::to_string(bytes) + kUnits[u];
}

Result<std::chrono::nanoseconds> ParseDuration(std::string_view text) {
  uint64_t n = 0;
  std::string suffix;
  if (!SplitNumber(text, &n, &suffix)) {
    return InvalidArgumentError("not a duration: '" + std::string(text) + "'");
  }
  uint64_t mult;
  if (suffix == "ns")
    mult = 1;
  else if (suffix == "us")
    mult = 1000;
  else if (suffix.empty() || suffix == "ms")
    mult = 1000000;
  else if (suffix == "s")
    mult = 1000000000ULL;
  else if (suffix == "m" || suffix == "min")
    mult = 60000000000ULL;
  else {
    return InvalidArgumentError("unknown duration unit '" + suffix + "'");
  }
  if (n > static_cast<uint64_t>(INT64_MAX) / mult) {
    return OutOfRangeError("duration overflows: '" + std::string(text) + "'");
  }
  return std::chrono::nanoseconds(static_cast<int64_t>(n * mult));
}

Result<ConfigFile> ConfigFile::Load(const std::string& path) {
  std::ifstream in(path);
  if (!in) return NotFoundError("cannot open config file '" + path + "'");
  std::stringstream ss;
  ss << in.rdbuf();
  return Parse(ss.str(), path);
}

Result<ConfigFile> ConfigFile::Parse(std::string_view text,
                                     std::string_view origin) {
  ConfigFile cf;
  int line_no = 0;
  while (!text.empty()) {
    size_t nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    text =
        nl == std::string_view::npos ? std::string_view() : text.substr(nl + 1);
    ++line_no;
    size_t hash = line.find('#');
    if (hash != std::string_view::npos) line = line.substr(0, hash);
    line = Trim(line);
    if (line.empty()) continue;
    size_t eq = line.find('=');
    if (eq == std::string_view::npos) {
      return InvalidArgumentError(std::string(origin) + ":" +
                                  std::to_string(line_no) +
                                  ": expected 'key = value'");
    }
    std::string key(Trim(line.substr(0, eq)));
    std::string value(Trim(line.substr(eq + 1)));
    if (value.size() >= 2 && value.front() == '"' && value.back() == '"') {
      value = value.substr(1, value.size() - 2);
    }
    if (key.empty()) {
      return InvalidArgumentError(std::string(origin) + ":" +
                                  std::to_string(line_no) + ": empty key");
    }
    cf.kv_[key] = value;
  }
  return cf;
}

std::optional<std::string> ConfigFile::Get(const std::string& key) const {
  auto it = kv_.find(key);
  if (it == kv_.end()) return std::nullopt;
  return it->second;
}

}  // namespace membox
