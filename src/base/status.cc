#include "membox/base/status.h"

#include <iterator>
#include <string>

namespace membox {

std::string_view StatusCodeName(StatusCode code) {
  // The canonical codes (gRPC's), indexed by value: 0 to 16, none missing.
  static constexpr std::string_view kNames[] = {
      "OK",
      "CANCELLED",
      "UNKNOWN",
      "INVALID_ARGUMENT",
      "DEADLINE_EXCEEDED",
      "NOT_FOUND",
      "ALREADY_EXISTS",
      "PERMISSION_DENIED",
      "RESOURCE_EXHAUSTED",
      "FAILED_PRECONDITION",
      "ABORTED",
      "OUT_OF_RANGE",
      "UNIMPLEMENTED",
      "INTERNAL",
      "UNAVAILABLE",
      "DATA_LOSS",
      "UNAUTHENTICATED",
  };
  static_assert(std::size(kNames) ==
                static_cast<size_t>(StatusCode::kUnauthenticated) + 1);
  const auto i = static_cast<size_t>(code);
  return i < std::size(kNames) ? kNames[i] : "UNKNOWN";
}

Status::Status(StatusCode code, std::string message) {
  if (code != StatusCode::kOk) {
    rep_ = std::make_shared<const Rep>(Rep{code, std::move(message)});
  }
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string s(StatusCodeName(code()));
  s += ": ";
  s += message();
  return s;
}

Status Status::WithContext(std::string_view context) const {
  if (ok()) return *this;
  std::string m(context);
  m += ": ";
  m += message();
  return Status(code(), std::move(m));
}

#define MEMBOX_DEFINE_ERROR_(Name, Code)                 \
  Status Name(std::string message) {                     \
    return Status(StatusCode::Code, std::move(message)); \
  }
MEMBOX_DEFINE_ERROR_(InvalidArgumentError, kInvalidArgument)
MEMBOX_DEFINE_ERROR_(NotFoundError, kNotFound)
MEMBOX_DEFINE_ERROR_(AlreadyExistsError, kAlreadyExists)
MEMBOX_DEFINE_ERROR_(PermissionDeniedError, kPermissionDenied)
MEMBOX_DEFINE_ERROR_(ResourceExhaustedError, kResourceExhausted)
MEMBOX_DEFINE_ERROR_(FailedPreconditionError, kFailedPrecondition)
MEMBOX_DEFINE_ERROR_(AbortedError, kAborted)
MEMBOX_DEFINE_ERROR_(OutOfRangeError, kOutOfRange)
MEMBOX_DEFINE_ERROR_(UnimplementedError, kUnimplemented)
MEMBOX_DEFINE_ERROR_(InternalError, kInternal)
MEMBOX_DEFINE_ERROR_(UnavailableError, kUnavailable)
MEMBOX_DEFINE_ERROR_(DataLossError, kDataLoss)
MEMBOX_DEFINE_ERROR_(DeadlineExceededError, kDeadlineExceeded)
MEMBOX_DEFINE_ERROR_(CancelledError, kCancelled)
MEMBOX_DEFINE_ERROR_(UnauthenticatedError, kUnauthenticated)
#undef MEMBOX_DEFINE_ERROR_

}  // namespace membox
