#include "agent/paths/host_path.h"

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/syscall.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <limits.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "agent/base/status.h"
#include "agent/base/unique_fd.h"

namespace fusekeeper {
namespace {

const char* Describe(mode_t mode) {
  switch (mode & S_IFMT) {
    case S_IFDIR: return "a directory";
    case S_IFREG: return "a regular file";
    case S_IFSOCK: return "a socket";
    case S_IFCHR: return "a character device";
    case S_IFBLK: return "a block device";
    case S_IFIFO: return "a FIFO";
    case S_IFLNK: return "a symlink";
    default: return "an unknown file type";
  }
}

// Opens `rel` (relative, no leading '/') beneath the host root `root` (an O_PATH directory fd):
// an absolute symlink on the way resolves inside the host root, never into the agent's own root
// (RESOLVE_IN_ROOT); with `no_symlinks`, no symlink is followed at all.
int OpenInRoot(int root, const std::string& rel, uint64_t flags, mode_t mode, bool no_symlinks) {
  open_how how{};
  how.flags = flags | O_CLOEXEC;
  how.mode = (flags & O_CREAT) ? mode : 0;
  how.resolve = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | (no_symlinks ? RESOLVE_NO_SYMLINKS : 0);
  return static_cast<int>(syscall(SYS_openat2, root, rel.empty() ? "." : rel.c_str(), &how, sizeof(how)));
}

// mkdir -p beneath the host root, one component at a time relative to its parent's fd (the
// parent opened in-root; with `no_symlinks`, following no symlink anywhere).
absl::Status MakeDirsInRoot(int root, const std::string& path, bool include_last, bool no_symlinks) {
  std::vector<std::string> parts = absl::StrSplit(path.substr(1), '/');
  std::string cur;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i + 1 == parts.size() && !include_last) break;
    const std::string parent_rel = cur.empty() ? "" : cur.substr(1);
    UniqueFd parent(OpenInRoot(root, parent_rel, O_PATH | O_DIRECTORY, 0, no_symlinks));
    cur += "/" + parts[i];
    if (!parent) {
      if (errno == ELOOP || errno == ENOTDIR || errno == EXDEV) {
        return absl::FailedPreconditionError(absl::StrCat(cur, ": a symlink or not a directory on the way; not following it"));
      }
      return ErrnoStatus(errno, "open", cur);
    }
    if (mkdirat(parent.get(), parts[i].c_str(), 0755) != 0 && errno != EEXIST) {
      return ErrnoStatus(errno, "creating directory", cur);
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<HostPathType> ParseHostPathType(absl::string_view type) {
  if (type.empty()) return HostPathType::kUnset;
  if (type == "DirectoryOrCreate") return HostPathType::kDirectoryOrCreate;
  if (type == "Directory") return HostPathType::kDirectory;
  if (type == "FileOrCreate") return HostPathType::kFileOrCreate;
  if (type == "File") return HostPathType::kFile;
  if (type == "Socket") return HostPathType::kSocket;
  if (type == "CharDevice") return HostPathType::kCharDevice;
  if (type == "BlockDevice") return HostPathType::kBlockDevice;
  return absl::InvalidArgumentError(absl::StrCat(
      "hostPath type '", type,
      "' is not one of \"\", DirectoryOrCreate, Directory, FileOrCreate, File, Socket, "
      "CharDevice, BlockDevice"));
}

absl::string_view HostPathTypeName(HostPathType type) {
  switch (type) {
    case HostPathType::kUnset: return "";
    case HostPathType::kDirectoryOrCreate: return "DirectoryOrCreate";
    case HostPathType::kDirectory: return "Directory";
    case HostPathType::kFileOrCreate: return "FileOrCreate";
    case HostPathType::kFile: return "File";
    case HostPathType::kSocket: return "Socket";
    case HostPathType::kCharDevice: return "CharDevice";
    case HostPathType::kBlockDevice: return "BlockDevice";
  }
  return "?";
}

absl::Status ValidateHostPath(absl::string_view path) {
  if (path.empty() || path[0] != '/') {
    return absl::InvalidArgumentError(absl::StrCat("hostPath path '", path, "' must be absolute"));
  }
  if (path.find('\0') != absl::string_view::npos) {
    return absl::InvalidArgumentError("hostPath path contains a NUL byte");
  }
  if (path == "/") return absl::OkStatus();
  for (absl::string_view c : absl::StrSplit(path.substr(1), '/')) {
    if (c == "..") {
      return absl::InvalidArgumentError(
          absl::StrCat("hostPath path '", path, "' contains '..'; give the real path"));
    }
    if (c.empty() || c == ".") {
      return absl::InvalidArgumentError(
          absl::StrCat("hostPath path '", path, "' is not normalised (empty or '.' component)"));
    }
  }
  return absl::OkStatus();
}

bool IsAtOrBelow(absl::string_view path, absl::string_view prefix) {
  if (prefix == "/") return true;
  if (path.substr(0, prefix.size()) != prefix) return false;
  return path.size() == prefix.size() || path[prefix.size()] == '/';
}

absl::StatusOr<std::string> RealPathOfFd(int fd) {
  char buf[PATH_MAX + 1];
  const std::string link = absl::StrCat("/proc/self/fd/", fd);
  ssize_t n = readlink(link.c_str(), buf, PATH_MAX);
  if (n < 0) return ErrnoStatus(errno, "readlink", link);
  return std::string(buf, static_cast<size_t>(n));
}

absl::StatusOr<OpenedHostPath> OpenHostPathBlocking(const std::string& path, HostPathType type,
                                                    bool untrusted, const std::string& host_root) {
  if (auto s = ValidateHostPath(path); !s.ok()) return s;
  const std::string root_path = host_root.empty() ? "/" : host_root;
  UniqueFd root(open(root_path.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (!root) return ErrnoStatus(errno, "opening the host root", root_path);
  const std::string rel = path.substr(1);
  if (type == HostPathType::kDirectoryOrCreate) {
    if (auto s = MakeDirsInRoot(root.get(), path, /*include_last=*/true, untrusted); !s.ok()) return s;
  } else if (type == HostPathType::kFileOrCreate) {
    if (auto s = MakeDirsInRoot(root.get(), path, /*include_last=*/false, untrusted); !s.ok()) return s;
    int fd = OpenInRoot(root.get(), rel, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW, 0644, untrusted);
    if (fd >= 0) {
      close(fd);
    } else if (errno != EEXIST) {
      return ErrnoStatus(errno, "creating file", path);
    }
  }
  // Opening may follow symlinks (beneath the host root): the caller checks where an untrusted
  // path really led (RealPathOfFd) against its allowed prefixes. Creating never follows one.
  int fd = OpenInRoot(root.get(), rel, O_PATH | O_NOFOLLOW, 0, /*no_symlinks=*/false);
  if (fd < 0) {
    if (errno == ENOENT) {
      return absl::NotFoundError(absl::StrCat("hostPath ", path, " does not exist",
                                              type == HostPathType::kUnset ? "" : " (type ",
                                              HostPathTypeName(type),
                                              type == HostPathType::kUnset ? "" : ")"));
    }
    return ErrnoStatus(errno, "opening hostPath", path);
  }
  UniqueFd opened(fd);
  struct stat st;
  if (fstat(opened.get(), &st) != 0) return ErrnoStatus(errno, "fstat hostPath", path);
  const mode_t kind = st.st_mode & S_IFMT;
  if (kind == S_IFLNK) {
    return absl::FailedPreconditionError(absl::StrCat(
        "hostPath ", path, " is a symlink; symlinks are not followed, give the path it points to"));
  }
  mode_t want = 0;
  switch (type) {
    case HostPathType::kUnset: break;
    case HostPathType::kDirectoryOrCreate:
    case HostPathType::kDirectory: want = S_IFDIR; break;
    case HostPathType::kFileOrCreate:
    case HostPathType::kFile: want = S_IFREG; break;
    case HostPathType::kSocket: want = S_IFSOCK; break;
    case HostPathType::kCharDevice: want = S_IFCHR; break;
    case HostPathType::kBlockDevice: want = S_IFBLK; break;
  }
  if (want != 0 && kind != want) {
    return absl::FailedPreconditionError(absl::StrCat("hostPath ", path, " is ", Describe(st.st_mode),
                                                      ", but type ", HostPathTypeName(type),
                                                      " expects ", Describe(want)));
  }
  return OpenedHostPath{std::move(opened), kind == S_IFDIR};
}

std::string ContainerRootProblem(const std::string& host_root) {
  if (!host_root.empty()) return "";
  constexpr long kOverlayfsMagic = 0x794c7630;
  struct statfs sf{};
  if (statfs("/", &sf) != 0 || static_cast<long>(sf.f_type) != kOverlayfsMagic) return "";
  return "the agent's root filesystem is an overlay (a container image): hostPath volumes would be "
         "resolved (and ...OrCreate paths created) inside the container, not on the node. Mount the "
         "node's / into the container (k8s/ mounts it at /host) and pass --host_root=/host";
}

}  // namespace fusekeeper
