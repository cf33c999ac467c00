// Paths that arrive in RPCs are untrusted. KubeletDir accepts a target or staging path only if it
// is absolute, normalised (no "", "." or ".." components) and below --kubelet_dir, and opens it
// relative to a directory fd held since start-up with openat2(RESOLVE_BENEATH |
// RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS): a symlink anywhere below the kubelet dir, planted
// before or between RPCs, is refused rather than followed out.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "agent/base/unique_fd.h"

namespace fusekeeper {

class KubeletDir {
 public:
  // Blocking (start-up). `path` may itself be a symlink (e.g. /var/lib/kubelet → /data/kubelet):
  // it is the operator's choice and is resolved once here.
  static absl::StatusOr<KubeletDir> Open(const std::string& path);

  const std::string& path() const { return path_; }
  // The kubelet dir with symlinks resolved: what the mount table shows.
  const std::string& real_path() const { return real_; }
  // An absolute path below path() as the mount table shows it (prefix replaced by real_path()).
  std::string MountTablePath(const std::string& path) const;
  int fd() const { return fd_.get(); }

  // Pure. Checks shape and containment; returns the path relative to the kubelet dir.
  // INVALID_ARGUMENT naming `field` otherwise.
  absl::StatusOr<std::string> Relative(absl::string_view path, absl::string_view field) const;

  // Blocking. Opens the parent directory of `rel` beneath the kubelet dir, following no symlinks.
  absl::StatusOr<UniqueFd> OpenParentBlocking(const std::string& rel) const;
  // Blocking. O_PATH handle on `rel` itself (no symlink anywhere). NOT_FOUND if it does not exist.
  absl::StatusOr<UniqueFd> OpenPathBlocking(const std::string& rel) const;

 private:
  KubeletDir(std::string path, std::string real, UniqueFd fd)
      : path_(std::move(path)), real_(std::move(real)), fd_(std::move(fd)) {}
  std::string path_;  // as configured, without trailing slash
  std::string real_;
  UniqueFd fd_;
};

// The last component of a relative path ("a/b/c" → "c").
absl::string_view BaseName(absl::string_view rel);

}  // namespace fusekeeper
