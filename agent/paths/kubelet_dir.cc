#include "agent/paths/kubelet_dir.h"

#include <fcntl.h>
#include <linux/openat2.h>
#include <stdlib.h>
#include <sys/stat.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "agent/base/status.h"
#include "agent/sys/syscalls.h"

namespace fusekeeper {
namespace {

constexpr uint64_t kResolveStrict = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;

absl::Status CheckComponents(absl::string_view path, absl::string_view field) {
  // path starts with '/'; every component must be a real name.
  for (absl::string_view c : absl::StrSplit(path.substr(1), '/')) {
    if (c.empty() || c == "." || c == "..") {
      return absl::InvalidArgumentError(absl::StrCat(
          field, " '", path, "' is not a normalised absolute path (empty, '.' or '..' component)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::string_view BaseName(absl::string_view rel) {
  size_t slash = rel.rfind('/');
  return slash == absl::string_view::npos ? rel : rel.substr(slash + 1);
}

absl::StatusOr<KubeletDir> KubeletDir::Open(const std::string& path) {
  if (path.empty() || path[0] != '/') {
    return absl::InvalidArgumentError(absl::StrCat("--kubelet_dir '", path, "' must be absolute"));
  }
  std::string trimmed = path;
  while (trimmed.size() > 1 && trimmed.back() == '/') trimmed.pop_back();
  if (trimmed != "/") {
    if (auto s = CheckComponents(trimmed, "--kubelet_dir"); !s.ok()) return s;
  }
  int fd = open(trimmed.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, "opening --kubelet_dir", trimmed);
  char* real = realpath(trimmed.c_str(), nullptr);
  if (real == nullptr) return ErrnoStatus(errno, "resolving --kubelet_dir", trimmed);
  std::string real_path(real);
  free(real);
  return KubeletDir(trimmed, real_path, UniqueFd(fd));
}

std::string KubeletDir::MountTablePath(const std::string& path) const {
  if (path_ == real_ || path.compare(0, path_.size(), path_) != 0) return path;
  return real_ + path.substr(path_.size());
}

absl::StatusOr<std::string> KubeletDir::Relative(absl::string_view path,
                                                 absl::string_view field) const {
  if (path.empty() || path[0] != '/') {
    return absl::InvalidArgumentError(absl::StrCat(field, " '", path, "' must be absolute"));
  }
  if (auto s = CheckComponents(path, field); !s.ok()) return s;
  absl::string_view rest = path;
  if (path_ != "/") {
    if (rest.substr(0, path_.size()) != path_ || rest.size() <= path_.size() + 1 ||
        rest[path_.size()] != '/') {
      return absl::InvalidArgumentError(absl::StrCat(field, " '", path, "' is not below the kubelet directory ",
                                                      path_));
    }
    rest.remove_prefix(path_.size() + 1);
  } else {
    rest.remove_prefix(1);
  }
  return std::string(rest);
}

absl::StatusOr<UniqueFd> KubeletDir::OpenParentBlocking(const std::string& rel) const {
  size_t slash = rel.rfind('/');
  std::string parent = slash == std::string::npos ? "." : rel.substr(0, slash);
  int fd = sys::OpenAt2(fd_.get(), parent.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC, 0, kResolveStrict);
  if (fd < 0) {
    if (errno == ELOOP || errno == EXDEV) {
      return absl::InvalidArgumentError(absl::StrCat(
          path_, "/", parent, " contains a symlink or leaves the kubelet directory; refusing it"));
    }
    return ErrnoStatus(errno, "opening parent directory", absl::StrCat(path_, "/", parent));
  }
  return UniqueFd(fd);
}

absl::StatusOr<UniqueFd> KubeletDir::OpenPathBlocking(const std::string& rel) const {
  int fd = sys::OpenAt2(fd_.get(), rel.c_str(), O_PATH | O_NOFOLLOW | O_CLOEXEC, 0, kResolveStrict);
  if (fd < 0) {
    if (errno == ELOOP || errno == EXDEV) {
      return absl::InvalidArgumentError(absl::StrCat(
          path_, "/", rel, " is or contains a symlink, or leaves the kubelet directory; refusing it"));
    }
    return ErrnoStatus(errno, "opening", absl::StrCat(path_, "/", rel));
  }
  UniqueFd opened(fd);
  // With O_PATH|O_NOFOLLOW, openat2 returns a final-component symlink itself instead of failing.
  // (No plain fstat: on an unserved FUSE mount point it would wait for the server.)
  mode_t type = 0;
  if (sys::StatxTypeNoSync(opened.get(), "", &type) != 0) {
    return ErrnoStatus(errno, "statx", absl::StrCat(path_, "/", rel));
  }
  if (type == S_IFLNK) {
    return absl::InvalidArgumentError(
        absl::StrCat(path_, "/", rel, " is a symlink; refusing to follow it"));
  }
  return opened;
}

}  // namespace fusekeeper
