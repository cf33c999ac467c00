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
// symlink in any component (the caller checks where an opened path really is). `host_root` (empty: "/") is where the node's root is: the agent in
// its DaemonSet container sees the node at /host, and every path is resolved beneath it
// (openat2 RESOLVE_IN_ROOT: even an absolute symlink cannot lead out into the container's root).
absl::StatusOr<OpenedHostPath> OpenHostPathBlocking(const std::string& path, HostPathType type,
                                                    bool untrusted = false, const std::string& host_root = "");

// Blocking. Why host paths would resolve in a container's root filesystem instead of the node's
// (empty: they would not): the agent's "/" is an overlay filesystem (a container image) and no
// host root was given.
std::string ContainerRootProblem(const std::string& host_root);

// Pure: whether `path` is `prefix` or below it (component-wise; both normalised absolute paths).
bool IsAtOrBelow(absl::string_view path, absl::string_view prefix);

// Blocking: the real path of an open fd (via /proc/self/fd), for checking where an opened object
// actually is.
absl::StatusOr<std::string> RealPathOfFd(int fd);

}  // namespace fusekeeper
