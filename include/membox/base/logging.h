// Logging: a thin layer over spdlog so every process prints the same format
// ("[time] [role] [level] message"). The level is info until SetLogLevel
// (the edges apply MEMBOX_LOG_LEVEL and --log-level: base/environment.h).
//
// Log once, where an error is decided (UCX CodeStyle): functions that return
// a Status do not also log it unless they are the ones that decided it.
//
// Thread-safety: all functions may be called from any thread.
#ifndef MEMBOX_BASE_LOGGING_H_
#define MEMBOX_BASE_LOGGING_H_

#include <string_view>

#include <spdlog/spdlog.h>

#include "membox/base/status.h"

namespace membox {

// Sets the role shown in every line ("bench-recv", "server", ...). Call early.
void InitLogging(std::string_view role);
// Sets the level: trace, debug, info, warn, error or off. Another name is
// kInvalidArgument, naming the choices, and leaves the level unchanged.
Status SetLogLevel(std::string_view level);

}  // namespace membox

#define MEMBOX_LOG_TRACE(...) SPDLOG_TRACE(__VA_ARGS__)
#define MEMBOX_LOG_DEBUG(...) ::spdlog::debug(__VA_ARGS__)
#define MEMBOX_LOG_INFO(...) ::spdlog::info(__VA_ARGS__)
#define MEMBOX_LOG_WARN(...) ::spdlog::warn(__VA_ARGS__)
#define MEMBOX_LOG_ERROR(...) ::spdlog::error(__VA_ARGS__)

#endif  // MEMBOX_BASE_LOGGING_H_
