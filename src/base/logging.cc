#include "membox/base/logging.h"

#include <string>

#include <spdlog/sinks/stdout_color_sinks.h>

namespace membox {

void InitLogging(std::string_view role) {
  auto logger =
      spdlog::stderr_color_mt(std::string(role.empty() ? "membox" : role));
  logger->set_pattern("[%H:%M:%S.%e] [%n] [%^%l%$] %v");
  spdlog::set_default_logger(logger);
  spdlog::set_level(spdlog::level::info);
}

Status SetLogLevel(std::string_view level) {
  auto lvl = spdlog::level::from_str(std::string(level));
  // from_str returns off for unknown names; only accept "off" when asked.
  if (lvl == spdlog::level::off && level != "off") {
    return InvalidArgumentError("unknown log level '" + std::string(level) +
                                "' (trace, debug, info, warn, error, off)");
  }
  spdlog::set_level(lvl);
  return Status::Ok();
}

}  // namespace membox
