#include "src/ps/client/profiler.h"

#include <algorithm>
#include <map>

#include <fmt/format.h>

namespace membox::ps::client {
namespace {

double Median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

double Seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

}  // namespace

Result<std::vector<ProfileSample>> SampleTransfers(
    uint32_t proxies, const std::vector<uint64_t>& sizes, int repeats,
    const Transfer& transfer, const SampleRules& rules) {
  if (proxies == 0 || sizes.empty() || repeats < 1) {
    return InvalidArgumentError("profile needs proxies, sizes and repeats");
  }
  std::vector<ProfileSample> samples;
  for (uint64_t size : sizes) {
    std::vector<std::vector<double>> t(proxies);
    for (int r = 0; r <= repeats; ++r) {  // the first is a warm-up
      for (uint32_t p = 0; p < proxies; ++p) {
        const auto t0 = rules.now();
        uint64_t n = 0, moved = 0;
        do {
          RETURN_IF_ERROR(transfer(p, size));
          ++n;
          moved += size;
        } while ((moved < rules.sustain_bytes ||
                  rules.now() - t0 < rules.min_time) &&
                 rules.now() - t0 < rules.sustain_time);
        if (r > 0) {
          t[p].push_back(Seconds(rules.now() - t0) / static_cast<double>(n));
        }
      }
    }
    for (uint32_t p = 0; p < proxies; ++p) {
      samples.push_back({p, size, Median(t[p])});
    }
  }
  return samples;
}

Result<double> MeasureInOutSharing(uint64_t bytes, int repeats,
                                   const InOutTransfer& transfer,
                                   const SampleRules& rules) {
  if (bytes == 0 || repeats < 1) {
    return InvalidArgumentError("the in/out probe needs bytes and repeats");
  }
  auto time_it = [&](uint64_t in_bytes, uint64_t out_bytes) -> Result<double> {
    std::vector<double> v;
    for (int r = 0; r <= repeats; ++r) {  // the first is a warm-up
      const auto t0 = rules.now();
      uint64_t n = 0;
      do {
        RETURN_IF_ERROR(transfer(in_bytes, out_bytes));
        ++n;
      } while (rules.now() - t0 < rules.min_time);
      if (r > 0)
        v.push_back(Seconds(rules.now() - t0) / static_cast<double>(n));
    }
    return Median(std::move(v));
  };
  ASSIGN_OR_RETURN(double t_in, time_it(bytes, 0));
  ASSIGN_OR_RETURN(double t_out, time_it(0, bytes));
  ASSIGN_OR_RETURN(double t_both, time_it(bytes / 2, bytes / 2));
  return SharingFromProbe(t_in, t_out, t_both);
}

std::string DescribeSamples(const std::vector<ProfileSample>& samples) {
  if (samples.empty()) return "";
  uint64_t smallest = samples.front().bytes, largest = smallest;
  for (const auto& x : samples) {
    smallest = std::min(smallest, x.bytes);
    largest = std::max(largest, x.bytes);
  }
  std::map<uint32_t, std::pair<double, double>> by_proxy;  // latency, bw
  for (const auto& x : samples) {
    auto& [lat, bw] = by_proxy[x.proxy];
    if (x.bytes == smallest) lat = x.seconds;
    if (x.bytes == largest && x.seconds > 0) {
      bw = static_cast<double>(x.bytes) / x.seconds;
    }
  }
  std::string out;
  for (const auto& [p, v] : by_proxy) {
    out += fmt::format(" [proxy {}: {:.0f} us, {:.2f} GB/s]", p, v.first * 1e6,
                       v.second / 1e9);
  }
  return out;
}

}  // namespace membox::ps::client
