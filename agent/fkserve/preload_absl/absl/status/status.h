// See ../strings/string_view.h: for libfkserve_preload.so only.
#pragma once
#include <string>
#include <string_view>
namespace absl {
enum class StatusCode { kOk = 0, kInvalidArgument = 3, kFailedPrecondition = 9, kInternal = 13, kUnavailable = 14 };
class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string_view message) : code_(code), message_(message) {}
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  std::string_view message() const { return message_; }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};
inline Status OkStatus() { return Status(); }
inline Status InvalidArgumentError(std::string_view m) { return Status(StatusCode::kInvalidArgument, m); }
inline Status FailedPreconditionError(std::string_view m) { return Status(StatusCode::kFailedPrecondition, m); }
inline Status InternalError(std::string_view m) { return Status(StatusCode::kInternal, m); }
inline Status UnavailableError(std::string_view m) { return Status(StatusCode::kUnavailable, m); }
}  // namespace absl
