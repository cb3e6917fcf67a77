// Configuration helpers shared by every layer: human-readable sizes and
// durations ("64MiB", "250ms"), environment look-ups, and "key = value" config
// files (one setting per line, '#' starts a comment). Command-line parsing
// itself is CLI11's job in tools/; these helpers parse what crosses into the
// libraries so every layer reads sizes and times the same way.
//
// Thread-safety: free functions are reentrant; a ConfigFile is immutable
// after Load() and may then be read from any thread.
#ifndef MEMBOX_BASE_CONFIG_H_
#define MEMBOX_BASE_CONFIG_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "membox/base/status.h"

namespace membox {

// "4096", "4k", "4KiB", "64MiB", "1GiB", "1G" (binary units). Rejects
// negative numbers, unknown suffixes and values that overflow 64 bits.
Result<uint64_t> ParseByteSize(std::string_view text);
// Formats with the largest binary unit that divides evenly ("64MiB").
std::string FormatByteSize(uint64_t bytes);
// "250ms", "2s", "10us", "1m"; a bare number is milliseconds.
Result<std::chrono::nanoseconds> ParseDuration(std::string_view text);

class ConfigFile {
 public:
  // Parses `path`; errors name the file and line.
  static Result<ConfigFile> Load(const std::string& path);
  // Parses text directly (used by tests and by Load).
  static Result<ConfigFile> Parse(std::string_view text,
                                  std::string_view origin = "<string>");

  std::optional<std::string> Get(const std::string& key) const;
  const std::map<std::string, std::string>& entries() const { return kv_; }

 private:
  std::map<std::string, std::string> kv_;
};

}  // namespace membox

#endif  // MEMBOX_BASE_CONFIG_H_
