#include "membox/ps/client_environment.h"

#include <cstdlib>
#include <sstream>
#include <string>

#include "membox/base/config.h"
#include "membox/base/environment.h"

namespace membox::ps {
namespace {

// Seconds in [0, 86400] -> milliseconds.
Status Seconds(const char* name, const std::string& v, const char* zero,
               std::chrono::milliseconds* out) {
  char* end = nullptr;
  double sec = std::strtod(v.c_str(), &end);
  if (*end != '\0' || !(sec >= 0) || sec > 86400) {
    return InvalidArgumentError(std::string(name) + ": bad value '" + v +
                                "' (seconds, 0..86400; 0: " + zero + ")");
  }
  *out = std::chrono::milliseconds(static_cast<int64_t>(sec * 1000));
  return Status::Ok();
}

Status Delays(const std::string& v, size_t proxies,
              std::vector<transport::FaultPolicy>* links) {
  std::vector<transport::FaultPolicy> out;
  std::stringstream in(v);
  std::string item;
  bool any = false;
  while (std::getline(in, item, ',')) {
    char* end = nullptr;
    double ms = std::strtod(item.c_str(), &end);
    if (item.empty() || *end != '\0' || !(ms >= 0) || ms > 60000) {
      return InvalidArgumentError("MEMBOX_PROXY_DELAYS_MS: bad delay '" + item +
                                  "' (milliseconds, 0..60000)");
    }
    transport::FaultPolicy p;
    p.fixed_latency = std::chrono::nanoseconds(static_cast<int64_t>(ms * 1e6));
    any = any || ms > 0;
    out.push_back(p);
  }
  if (out.size() != proxies) {
    return InvalidArgumentError("MEMBOX_PROXY_DELAYS_MS lists " +
                                std::to_string(out.size()) + " delays for " +
                                std::to_string(proxies) + " proxies");
  }
  if (any) *links = std::move(out);
  return Status::Ok();
}

}  // namespace

Status ApplyClientEnvironment(ParamClientOptions* o) {
  if (auto v = GetEnv("MEMBOX_RESTART")) o->restarted = *v != "0";
  if (auto v = GetEnv("MEMBOX_PROXY_DELAYS_MS"); v && o->links.empty()) {
    RETURN_IF_ERROR(Delays(*v, o->proxies.size(), &o->links));
  }
  if (auto v = GetEnv("MEMBOX_HANG_REPORT_S")) {
    RETURN_IF_ERROR(
        Seconds("MEMBOX_HANG_REPORT_S", *v, "never", &o->hang_report));
  }
  if (auto v = GetEnv("MEMBOX_FAILOVER_S")) {
    RETURN_IF_ERROR(Seconds("MEMBOX_FAILOVER_S", *v, "off", &o->failover));
  }
  if (auto v = GetEnv("MEMBOX_COMBINE")) {
    if (*v != "0" && *v != "1") {
      return InvalidArgumentError("MEMBOX_COMBINE: bad value '" + *v +
                                  "' (0 or 1)");
    }
    o->combine = *v == "1";
  }
  if (auto v = GetEnv("MEMBOX_HOLD_PUSHES")) {
    using Hold = ParamClientOptions::HoldPushes;
    if (*v == "across-hosts") {
      o->hold_pushes = Hold::kAcrossHosts;
    } else if (*v == "always") {
      o->hold_pushes = Hold::kAlways;
    } else if (*v == "never") {
      o->hold_pushes = Hold::kNever;
    } else {
      return InvalidArgumentError("MEMBOX_HOLD_PUSHES: bad value '" + *v +
                                  "' (across-hosts, always or never)");
    }
  }
  return Status::Ok();
}

}  // namespace membox::ps
