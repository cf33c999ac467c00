#include "agent/base/status.h"

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace fusekeeper {

absl::StatusCode ErrnoToCode(int err) {
  switch (err) {
    case 0:
      return absl::StatusCode::kOk;
    case ENOENT:
    case ENOTDIR:
      return absl::StatusCode::kNotFound;
    case EACCES:
    case EPERM:
      return absl::StatusCode::kPermissionDenied;
    case EEXIST:
      return absl::StatusCode::kAlreadyExists;
    case EINVAL:
    case ENAMETOOLONG:
    case ELOOP:
    case EXDEV:
      return absl::StatusCode::kInvalidArgument;
    case EAGAIN:
    case EBUSY:
    case ENOTCONN:
    case ECONNREFUSED:
      return absl::StatusCode::kUnavailable;
    case ETIMEDOUT:
      return absl::StatusCode::kDeadlineExceeded;
    case ECANCELED:
      return absl::StatusCode::kCancelled;
    case ENOSPC:
    case ENOMEM:
    case EMFILE:
    case ENFILE:
      return absl::StatusCode::kResourceExhausted;
    case ENOSYS:
    case EOPNOTSUPP:
      return absl::StatusCode::kUnimplemented;
    default:
      return absl::StatusCode::kInternal;
  }
}

absl::Status ErrnoStatus(int err, absl::string_view op, absl::string_view path) {
  std::string msg(op);
  if (!path.empty()) absl::StrAppend(&msg, " ", path);
  absl::StrAppend(&msg, ": ", std::strerror(err), " (errno ", err, ")");
  return absl::Status(ErrnoToCode(err), msg);
}

}  // namespace fusekeeper
