// HandoffEndpoint: its listening socket files (made, renamed into place, removed), blocking.
#include "agent/fuse/handoff_endpoint.h"

#include <dirent.h>
#include <errno.h>
#include <poll.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "agent/base/crash_point.h"
#include "agent/base/status.h"
#include "agent/fuse/fuse_mount.h"
#include "glog/logging.h"


namespace fusekeeper {

namespace {

// Whether `entry` is a temporary socket name (".<name>.<pid>.tmp"); `name` empty: of any socket.
// Sets *pid.
bool IsTempSocketName(absl::string_view entry, absl::string_view name, pid_t* pid) {
  if (!absl::ConsumePrefix(&entry, ".") || !absl::ConsumeSuffix(&entry, ".tmp")) return false;
  const size_t dot = entry.rfind('.');
  if (dot == absl::string_view::npos || dot == 0) return false;
  if (!name.empty() && entry.substr(0, dot) != name) return false;
  const absl::string_view digits = entry.substr(dot + 1);
  if (digits.empty() || digits.size() > 10) return false;
  uint64_t n = 0;
  for (char ch : digits) {
    if (ch < '0' || ch > '9') return false;
    n = n * 10 + static_cast<uint64_t>(ch - '0');
  }
  *pid = static_cast<pid_t>(n);
  return true;
}

// Removes the temporary socket names in `dir_fd` that `doomed` picks (sockets only: a file of
// another kind under such a name is not ours). Returns how many.
template <typename Doomed>
int RemoveTempSocketsBlocking(int dir_fd, Doomed doomed) {
  // dir_fd may be an O_PATH descriptor: a readable one of the same directory lists it.
  const int list_fd = openat(dir_fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (list_fd < 0) return 0;
  DIR* d = fdopendir(list_fd);
  if (d == nullptr) {
    close(list_fd);
    return 0;
  }
  std::vector<std::string> names;
  while (dirent* e = readdir(d)) {
    pid_t pid = 0;
    if ((e->d_type == DT_SOCK || e->d_type == DT_UNKNOWN) && doomed(e->d_name, &pid)) names.push_back(e->d_name);
  }
  closedir(d);
  int removed = 0;
  for (const std::string& n : names) {
    struct stat st;
    if (fstatat(dir_fd, n.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISSOCK(st.st_mode) &&
        unlinkat(dir_fd, n.c_str(), 0) == 0) {
      LOG(INFO) << "removed " << n << ", a handoff socket's temporary name an earlier agent left";
      ++removed;
    }
  }
  return removed;
}

}  // namespace

std::string HandoffEndpoint::TempSocketName(const std::string& name, pid_t pid) {
  return absl::StrCat(".", name, ".", pid, ".tmp");
}

void HandoffEndpoint::RemoveSocketBlocking(int dir_fd, const std::string& name) {
  unlinkat(dir_fd, name.c_str(), 0);
  RemoveTempSocketsBlocking(dir_fd, [&name](const char* entry, pid_t* pid) {
    return IsTempSocketName(entry, name, pid);
  });
}

int HandoffEndpoint::RemoveStaleTempSocketsBlocking(int dir_fd) {
  const pid_t me = getpid();
  return RemoveTempSocketsBlocking(dir_fd, [me](const char* entry, pid_t* pid) {
    return IsTempSocketName(entry, "", pid) && *pid != me;
  });
}

absl::StatusOr<UniqueFd> HandoffEndpoint::ListenBlocking(int dir_fd, const std::string& name,
                                                        uid_t owner_uid, gid_t owner_gid) {
  if (name.empty() || name.find('/') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("handoff socket name '", name, "' is not a plain name"));
  }
  UniqueFd sock(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!sock) return ErrnoStatus(errno, "socket(AF_UNIX, SOCK_SEQPACKET)");
  // Made under a temporary name, given to its owner and listening before it is renamed into
  // place: a server waiting for it (inotify) never meets it half made (refused, or not listening).
  const std::string tmp = TempSocketName(name, getpid());
  const std::string via = absl::StrCat("/proc/self/fd/", dir_fd, "/", tmp);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (via.size() >= sizeof(addr.sun_path)) return absl::InvalidArgumentError("handoff socket name too long");
  std::memcpy(addr.sun_path, via.data(), via.size());
  // A socket file left by an earlier agent is ours to replace; anything else is refused.
  struct stat st;
  for (const std::string& n : {name, tmp}) {
    if (fstatat(dir_fd, n.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && !S_ISSOCK(st.st_mode)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "handoff socket path ", n, " exists and is not a socket; refusing to replace it"));
    }
  }
  // Ours, and any an earlier agent killed between its bind and its rename left (unrenamed, they
  // would stay forever: nothing else knows their pid).
  RemoveTempSocketsBlocking(dir_fd, [&name](const char* entry, pid_t* pid) {
    return IsTempSocketName(entry, name, pid);
  });
  // Created 0600 from its first instant (fchmod on a socket fd does not change the file).
  const mode_t old = umask(0177);
  int r = bind(sock.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  umask(old);
  if (r != 0) return ErrnoStatus(errno, "bind handoff socket", name);
  auto fail = [&](absl::Status s) {
    unlinkat(dir_fd, tmp.c_str(), 0);
    return s;
  };
  if (fchownat(dir_fd, tmp.c_str(), owner_uid, owner_gid, AT_SYMLINK_NOFOLLOW) != 0) {
    return fail(ErrnoStatus(errno, "chown handoff socket", name));
  }
  if (listen(sock.get(), 8) != 0) return fail(ErrnoStatus(errno, "listen on handoff socket", name));
  CrashPoint("handoff-socket-unnamed");
  if (renameat(dir_fd, tmp.c_str(), dir_fd, name.c_str()) != 0) {
    return fail(ErrnoStatus(errno, "renaming the handoff socket into place", name));
  }
  return sock;
}

}  // namespace fusekeeper
