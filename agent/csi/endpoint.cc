#include "agent/csi/endpoint.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/strip.h"
#include "absl/strings/str_cat.h"
#include "agent/base/status.h"
#include "agent/base/unique_fd.h"

namespace fusekeeper {

absl::StatusOr<std::string> ParseUnixEndpoint(absl::string_view endpoint) {
  absl::string_view path = endpoint;
  if (absl::ConsumePrefix(&path, "unix://")) {
    // unix:///abs → "/abs"; unix://relative is not a path we accept.
  } else if (absl::ConsumePrefix(&path, "unix:")) {
  } else if (absl::StrContains(path, "://")) {
    return absl::InvalidArgumentError(absl::StrCat(
        "endpoint '", endpoint, "' is not a unix socket; use unix:///path/to/csi.sock"));
  }
  if (path.empty() || path[0] != '/') {
    return absl::InvalidArgumentError(absl::StrCat(
        "endpoint '", endpoint, "' must name an absolute path, e.g. unix:///csi/csi.sock"));
  }
  if (path.find('\0') != absl::string_view::npos) {
    return absl::InvalidArgumentError("endpoint path contains a NUL byte");
  }
  if (path.size() > kMaxUnixSocketPath) {
    return absl::InvalidArgumentError(absl::StrCat(
        "endpoint path '", path, "' is ", path.size(), " bytes; a unix socket path can be at most ",
        kMaxUnixSocketPath, " bytes (sun_path). Choose a shorter directory."));
  }
  return std::string(path);
}

namespace {

// True if something accepts connections on the socket at path. A non-blocking connect never waits:
// EAGAIN means a listener whose backlog is full, which is still a live listener.
absl::StatusOr<bool> SomeoneListens(const std::string& path) {
  UniqueFd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd) return ErrnoStatus(errno, "socket");
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  if (connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) return true;
  switch (errno) {
    case EAGAIN:
    case EINPROGRESS:
      return true;
    case ECONNREFUSED:
    case ENOENT:
      return false;
    default:
      return ErrnoStatus(errno, "connect to existing socket", path);
  }
}

}  // namespace

absl::Status PrepareSocketPath(const std::string& path) {
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return ErrnoStatus(errno, "lstat endpoint", path);
  }
  if (!S_ISSOCK(st.st_mode)) {
    const char* what = S_ISLNK(st.st_mode)   ? "a symlink"
                       : S_ISDIR(st.st_mode) ? "a directory"
                                             : "not a socket";
    return absl::FailedPreconditionError(absl::StrCat(
        "endpoint path ", path, " exists and is ", what,
        "; refusing to replace it. Remove it or choose another --endpoint."));
  }
  absl::StatusOr<bool> live = SomeoneListens(path);
  if (!live.ok()) return live.status();
  if (*live) {
    return absl::FailedPreconditionError(absl::StrCat(
        "another process is serving on ", path,
        " (is a fusekeeper agent already running on this node?)"));
  }
  if (unlink(path.c_str()) != 0 && errno != ENOENT) {
    return ErrnoStatus(errno, "removing stale socket", path);
  }
  return absl::OkStatus();
}

absl::StatusOr<SocketFileId> StatSocketFile(const std::string& path) {
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) return ErrnoStatus(errno, "lstat", path);
  if (!S_ISSOCK(st.st_mode)) return absl::FailedPreconditionError(path + " is not a socket");
  return SocketFileId{st.st_dev, st.st_ino, st.st_ctim};
}

bool RemoveSocketIfOurs(const std::string& path, const SocketFileId& id) {
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) return false;
  if (!S_ISSOCK(st.st_mode) || st.st_dev != id.dev || st.st_ino != id.ino ||
      st.st_ctim.tv_sec != id.ctime.tv_sec || st.st_ctim.tv_nsec != id.ctime.tv_nsec) {
    return false;
  }
  return unlink(path.c_str()) == 0;
}

}  // namespace fusekeeper
