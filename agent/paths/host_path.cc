#include "agent/paths/host_path.h"

#include <fcntl.h>
#include <sys/stat.h>
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

// mkdir -p that never follows a symlink: each component is created relative to its parent's fd
// and opened O_NOFOLLOW.
absl::Status MakeDirsNoFollow(const std::string& path, bool include_last) {
  UniqueFd dir(open("/", O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (!dir) return ErrnoStatus(errno, "open", "/");
  std::vector<std::string> parts = absl::StrSplit(path.substr(1), '/');
  std::string cur;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i + 1 == parts.size() && !include_last) break;
    cur += "/" + parts[i];
    if (mkdirat(dir.get(), parts[i].c_str(), 0755) != 0 && errno != EEXIST) {
      return ErrnoStatus(errno, "creating directory", cur);
    }
    int next = openat(dir.get(), parts[i].c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (next < 0) {
      if (errno == ELOOP || errno == ENOTDIR) {
        return absl::FailedPreconditionError(
            absl::StrCat(cur, " is a symlink or not a directory; not following it"));
      }
      return ErrnoStatus(errno, "open", cur);
    }
    dir.Reset(next);
  }
  return absl::OkStatus();
}

// mkdir -p for the parents of path (and path itself if include_last), mode 0755.
absl::Status MakeDirs(const std::string& path, bool include_last) {
  std::string cur;
  std::vector<std::string> parts = absl::StrSplit(path.substr(1), '/');
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i + 1 == parts.size() && !include_last) break;
    cur += "/" + parts[i];
    if (mkdir(cur.c_str(), 0755) != 0 && errno != EEXIST) {
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
                                                    bool untrusted) {
  if (auto s = ValidateHostPath(path); !s.ok()) return s;
  auto make_dirs = untrusted ? MakeDirsNoFollow : MakeDirs;
  if (type == HostPathType::kDirectoryOrCreate) {
    if (auto s = make_dirs(path, /*include_last=*/true); !s.ok()) return s;
  } else if (type == HostPathType::kFileOrCreate) {
    if (auto s = make_dirs(path, /*include_last=*/false); !s.ok()) return s;
    int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd >= 0) {
      close(fd);
    } else if (errno != EEXIST) {
      return ErrnoStatus(errno, "creating file", path);
    }
  }
  int fd = open(path.c_str(), O_PATH | O_NOFOLLOW | O_CLOEXEC);
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

}  // namespace fusekeeper
