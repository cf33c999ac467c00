// Status helpers: errno → absl::Status with the operation and path in the message.
// Canonical codes map one-to-one onto gRPC codes at the CSI boundary (agent/csi).
#pragma once

#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fusekeeper {

// Maps an errno value to the closest canonical code (ENOENT → NOT_FOUND, EACCES/EPERM →
// PERMISSION_DENIED, EEXIST → ALREADY_EXISTS, EINVAL/ENAMETOOLONG → INVALID_ARGUMENT,
// EAGAIN/EBUSY → UNAVAILABLE, ETIMEDOUT → DEADLINE_EXCEEDED, ECANCELED → CANCELLED, else INTERNAL).
absl::StatusCode ErrnoToCode(int err);

// "<op> <path>: <strerror> (errno N)"; path may be empty. err is an errno value (positive).
absl::Status ErrnoStatus(int err, absl::string_view op, absl::string_view path = {});

}  // namespace fusekeeper
