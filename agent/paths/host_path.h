// hostPath volumes with kubelet's type qualifiers, without kubelet's check-then-use race: the
// path is opened once (O_PATH, final component never followed), the *opened object's* type is
// checked, and that same object is what gets mounted (open_tree on the fd).
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "agent/base/unique_fd.h"

namespace fusekeeper {

enum class HostPathType {
  kUnset,  // "": no check, the path must exist
  kDirectoryOrCreate,
  kDirectory,
  kFileOrCreate,
  kFile,
  kSocket,
  kCharDevice,
  kBlockDevice,
};

// INVALID_ARGUMENT listing the valid values for anything else.
absl::StatusOr<HostPathType> ParseHostPathType(absl::string_view type);
absl::string_view HostPathTypeName(HostPathType type);

// Pure: absolute, no "..", ".", or empty components, no NUL. INVALID_ARGUMENT otherwise.
absl::Status ValidateHostPath(absl::string_view path);

struct OpenedHostPath {
  UniqueFd fd;       // O_PATH on the object itself
  bool is_directory;
};

// Blocking. For ...OrCreate types creates what is missing first (directories 0755, the file 0644,
// as kubelet does), then opens and checks. A wrong type → FAILED_PRECONDITION saying what was
// expected and what was found; a final-component symlink is refused (give the real path);
// a missing path → NOT_FOUND. With `untrusted` (a path a pod author chose), creation follows no
// symlink in any component either.
absl::StatusOr<OpenedHostPath> OpenHostPathBlocking(const std::string& path, HostPathType type,
                                                    bool untrusted = false);

// Pure: whether `path` is `prefix` or below it (component-wise; both normalised absolute paths).
bool IsAtOrBelow(absl::string_view path, absl::string_view prefix);

// Blocking: the real path of an open fd (via /proc/self/fd), for checking where an opened object
// actually is.
absl::StatusOr<std::string> RealPathOfFd(int fd);

}  // namespace fusekeeper
