#include "membox/base/status.h"

#include <string>

namespace membox {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "OK";
    case StatusCode::kCancelled:
      return "CANCELLED";
    case StatusCode::kUnknown:
      return "UNKNOWN";
    case StatusCode::kInvalidArgument:
      return "INVALID_ARGUMENT";
    case StatusCode::kDeadlineExceeded:
      return "DEADLINE_EXCEEDED";
    case StatusCode::kNotFound:
      return "NOT_FOUND";
    case StatusCode::kAlreadyExists:
      return "ALREADY_EXISTS";
    case StatusCode::kPermissionDenied:
      return "PERMISSION_DENIED";
    case StatusCode::kResourceExhausted:
      return "RESOURCE_EXHAUSTED";
    case StatusCode::kFailedPrecondition:
      return "FAILED_PRECONDITION";
    case StatusCode::kAborted:
      return "ABORTED";
    case StatusCode::kOutOfRange:
      return "OUT_OF_RANGE";
    case StatusCode::kUnimplemented:
      return "UNIMPLEMENTED";
    case StatusCode::kInternal:
      return "INTERNAL";
    case StatusCode::kUnavailable:
      return "UNAVAILABLE";
    case StatusCode::kDataLoss:
      return "DATA_LOSS";
    case StatusCode::kUnauthenticated:
      return "UNAUTHENTICATED";
  }
  return "UNKNOWN";
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
