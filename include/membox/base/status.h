// Status and Result<T>: the one error convention of membox.
//
// Every fallible call returns a Status or a Result<T>; libraries never throw.
// The code tells the caller what to do next (abseil's semantics):
//   kUnavailable        the same call may be retried (peer busy, transient);
//   kDeadlineExceeded   a wait timed out; the operation itself is still alive;
//   kAborted            retry at a higher level (e.g. reconnect, redo the
//   step); kFailedPrecondition do not retry until the state is fixed;
//   kInvalidArgument / kOutOfRange / kPermissionDenied: the request is wrong,
//                       retrying it unchanged fails the same way;
//   kDataLoss           stored or transmitted bytes are corrupt.
//
// Thread-safety: a Status is an immutable value once built; const methods may
// be called from any thread. Copying is cheap (OK carries no allocation).
#ifndef MEMBOX_BASE_STATUS_H_
#define MEMBOX_BASE_STATUS_H_

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace membox {

enum class StatusCode : int {
  kOk = 0,
  kCancelled = 1,
  kUnknown = 2,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kNotFound = 5,
  kAlreadyExists = 6,
  kPermissionDenied = 7,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
  kDataLoss = 15,
  kUnauthenticated = 16,
};

// Returns the canonical name ("UNAVAILABLE", ...) of `code`.
std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message);

  static Status Ok() { return Status(); }

  bool ok() const { return rep_ == nullptr; }
  StatusCode code() const { return rep_ ? rep_->code : StatusCode::kOk; }
  std::string_view message() const {
    return rep_ ? std::string_view(rep_->message) : std::string_view();
  }
  // True when repeating the same call unchanged may succeed.
  bool IsRetryable() const {
    return code() == StatusCode::kUnavailable ||
           code() == StatusCode::kDeadlineExceeded;
  }
  // "CODE: message" or "OK".
  std::string ToString() const;

  // Returns a copy whose message is "context: <old message>".
  Status WithContext(std::string_view context) const;

 private:
  struct Rep {
    StatusCode code;
    std::string message;
  };
  std::shared_ptr<const Rep> rep_;  // null means OK
};

inline bool operator==(const Status& a, const Status& b) {
  return a.code() == b.code() && a.message() == b.message();
}

// Constructors named after the codes.
Status InvalidArgumentError(std::string message);
Status NotFoundError(std::string message);
Status AlreadyExistsError(std::string message);
Status PermissionDeniedError(std::string message);
Status ResourceExhaustedError(std::string message);
Status FailedPreconditionError(std::string message);
Status AbortedError(std::string message);
Status OutOfRangeError(std::string message);
Status UnimplementedError(std::string message);
Status InternalError(std::string message);
Status UnavailableError(std::string message);
Status DataLossError(std::string message);
Status DeadlineExceededError(std::string message);
Status CancelledError(std::string message);
Status UnauthenticatedError(std::string message);

// Result<T> holds either a value or a non-OK Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status)
      : v_(std::move(status)) {}  // NOLINT: implicit by design

  bool ok() const { return std::holds_alternative<T>(v_); }
  Status status() const { return ok() ? Status() : std::get<Status>(v_); }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }

 private:
  std::variant<T, Status> v_;
};

// The one rule for a factory of an interface: construct the implementation
// from `args`, run its `Status Init()`, and hand it out as `Base` only if
// Init succeeded (a failed one is destroyed here, never returned half made).
template <typename Base, typename Impl, typename... Args>
Result<std::unique_ptr<Base>> MakeInitialized(Args&&... args) {
  auto impl = std::make_unique<Impl>(std::forward<Args>(args)...);
  if (Status s = impl->Init(); !s.ok()) return s;
  return std::unique_ptr<Base>(std::move(impl));
}

}  // namespace membox

#define MEMBOX_CONCAT_INNER_(a, b) a##b
#define MEMBOX_CONCAT_(a, b) MEMBOX_CONCAT_INNER_(a, b)

// Returns from the enclosing function when `expr` (a Status) is not OK.
#define RETURN_IF_ERROR(expr)                        \
  do {                                               \
    ::membox::Status membox_status_ = (expr);        \
    if (!membox_status_.ok()) return membox_status_; \
  } while (0)

// ASSIGN_OR_RETURN(auto x, ResultExpr()): binds the value or returns the error.
#define ASSIGN_OR_RETURN(lhs, expr)                           \
  auto MEMBOX_CONCAT_(membox_result_, __LINE__) = (expr);     \
  if (!MEMBOX_CONCAT_(membox_result_, __LINE__).ok())         \
    return MEMBOX_CONCAT_(membox_result_, __LINE__).status(); \
  lhs = std::move(MEMBOX_CONCAT_(membox_result_, __LINE__)).value()

#endif  // MEMBOX_BASE_STATUS_H_
