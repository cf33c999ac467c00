#include "agent/fkserve/handoff_client.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/inotify.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "agent/base/fd_passing.h"
#include "agent/version.h"

namespace fusekeeper {

std::string ServerName() { return absl::StrCat("fkserve ", kVersion); }

absl::StatusOr<UniqueFd> TryConnectToAgent(const std::string& path, uid_t agent_uid, bool nonblocking) {
  UniqueFd sock = ConnectSeqpacket(path, nonblocking);
  if (!sock.valid()) {
    const int err = errno;
    if (err == ENAMETOOLONG) {
      return absl::InvalidArgumentError(absl::StrCat("socket path ", path, " is longer than 107 bytes; pass it "
                                                     "through a shorter path or /proc/self/fd/<dirfd>/name"));
    }
    const std::string why = absl::StrCat("cannot connect to ", path, ": ", strerror(err));
    if (err == ENOENT) return absl::NotFoundError(why);
    // EACCES too: the agent makes the socket, then gives it to the server's user (chown).
    if (err == ECONNREFUSED || err == EACCES || err == EAGAIN) return absl::UnavailableError(why);
    return absl::InternalError(why);
  }
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(sock.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.uid != agent_uid) {
    return absl::PermissionDeniedError(absl::StrCat("the peer on ", path, " runs as uid ", cred.uid,
                                                    ", not the agent's uid ", agent_uid, "; refusing it"));
  }
  return sock;
}

absl::StatusOr<UniqueFd> ConnectToAgentBlocking(const std::string& path, uid_t agent_uid,
                                                std::chrono::milliseconds wait,
                                                const std::function<void(const std::string&)>& waiting) {
  const auto deadline = std::chrono::steady_clock::now() + std::max(wait, std::chrono::milliseconds(0));
  const std::string dir = path.find('/') == std::string::npos ? "." : path.substr(0, std::max<size_t>(1, path.rfind('/')));
  UniqueFd watch(inotify_init1(IN_CLOEXEC | IN_NONBLOCK));
  if (watch.valid()) inotify_add_watch(watch.get(), dir.c_str(), IN_CREATE | IN_MOVED_TO | IN_ATTRIB);
  bool said = false;
  for (;;) {
    // Events so far are drained before the attempt, never after it: a change that lands between
    // the attempt and the poll still wakes the poll.
    char drain[4096];
    while (watch.valid() && read(watch.get(), drain, sizeof(drain)) > 0) {
    }
    absl::StatusOr<UniqueFd> sock = TryConnectToAgent(path, agent_uid);
    const bool not_yet = absl::IsNotFound(sock.status()) || absl::IsUnavailable(sock.status());
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (sock.ok() || !not_yet) return sock;
    if (left.count() <= 0) {
      return absl::UnavailableError(absl::StrCat(sock.status().message(), absl::IsNotFound(sock.status())
                                                                              ? " (does the agent publish this volume?)"
                                                                              : ""));
    }
    if (!said && waiting) {
      waiting(absl::StrCat(sock.status().message(), "; waiting up to ", wait.count(), " ms for the agent"));
      said = true;
    }
    pollfd p{watch.get(), POLLIN, 0};
    poll(&p, watch.valid() ? 1 : 0, static_cast<int>(std::min<int64_t>(left.count(), 1000)));
  }
}

absl::StatusOr<Handoff> ReceiveHandoffBlocking(int sock, const std::string& mode,
                                               const std::function<bool(const Handoff&)>& can_adopt) {
  for (int round = 0;; ++round) {
    absl::StatusOr<ReceivedMessage> msg = ReceiveHandoffMessage(sock);
    if (!msg.ok()) {
      return absl::UnavailableError(absl::StrCat("receiving from the agent: ", msg.status().message()));
    }
    absl::StatusOr<MountConfig> config = DecodeMountConfig(msg->payload);
    if (!config.ok()) return absl::FailedPreconditionError(config.status().message());
    struct stat st;
    if (!msg->fd.valid() || fstat(msg->fd.get(), &st) != 0 || !S_ISCHR(st.st_mode) || major(st.st_rdev) != 10 ||
        minor(st.st_rdev) != 229) {
      ReplyToAgent(sock, false, "the fd received is not /dev/fuse");
      return absl::FailedPreconditionError("the agent's message did not carry a /dev/fuse fd");
    }
    // Blocking, as libfuse and the launched programs expect it (a relay before us read it
    // non-blocking; the flag is the open file's).
    if (const int fl = fcntl(msg->fd.get(), F_GETFL); fl >= 0 && (fl & O_NONBLOCK)) {
      fcntl(msg->fd.get(), F_SETFL, fl & ~O_NONBLOCK);
    }
    Handoff h;
    h.config = std::move(*config);
    h.fuse = std::move(msg->fd);
    if (h.config.live) h.relay_state = std::move(msg->fd2);
    if (h.config.live && !ConnectionAlive(h.fuse.get())) {
      return absl::AbortedError("the live connection the agent offered has ended (aborted); its fresh one comes next");
    }
    if (!h.config.live || can_adopt(h)) return h;
    if (round > 0) {
      return absl::FailedPreconditionError("the agent offered a live connection again after a fresh one was asked for");
    }
    fprintf(stderr, "fkserve: volume %s: cannot adopt the live connection in %s mode; asking for a fresh one\n",
            h.config.volume_id.c_str(), mode.c_str());
    ReplyToAgent(sock, false, absl::StrCat(mode, " mode cannot adopt a live connection"), /*fresh=*/true);
  }
}

absl::StatusOr<NextHandoff> ReceiveNextHandoffBlocking(const std::string& path, uid_t agent_uid, const std::string& mode,
                                                       const std::function<bool(const Handoff&)>& can_adopt,
                                                       std::chrono::milliseconds wait) {
  const auto deadline = std::chrono::steady_clock::now() + wait;
  std::chrono::milliseconds pause = kNextHandoffDelay;
  absl::Status last;
  for (;;) {
    // A plain sleep: nothing else happens in this process while it waits (it serves nothing).
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(2000));
    absl::StatusOr<UniqueFd> sock = TryConnectToAgent(path, agent_uid);
    if (absl::IsNotFound(sock.status())) return sock.status();
    if (sock.ok()) {
      absl::StatusOr<Handoff> h = ReceiveHandoffBlocking(sock->get(), mode, can_adopt);
      if (h.ok()) return NextHandoff{std::move(*sock), std::move(*h)};
      last = h.status();
    } else {
      last = sock.status();
    }
    // A refusal (the agent has not yet seen this server's last connection end), the dead
    // connection offered (the abort not yet seen), the agent restarting: all pass.
    if (std::chrono::steady_clock::now() >= deadline) {
      return absl::UnavailableError(absl::StrCat("no next connection from the agent within ", wait.count(),
                                                 " ms: ", last.message()));
    }
  }
}

bool ConnectionAlive(int fuse_fd) {
  pollfd p{fuse_fd, 0, 0};
  // An ended connection polls POLLERR (fuse_dev_poll); a live one, nothing or POLLIN.
  return poll(&p, 1, 0) >= 0 && (p.revents & POLLERR) == 0;
}

void SendToAgent(int sock, HandoffReply r, const char* what, int fd, int fd2) {
  r.server = ServerName();
  auto s = SendHandoffMessage(sock, EncodeHandoffReply(r), fd, fd2);
  if (!s.ok()) fprintf(stderr, "fkserve: %s: %s\n", what, std::string(s.message()).c_str());
}

void ReplyToAgent(int sock, bool ok, const std::string& error, bool fresh, const std::string& init, bool relayed,
                  int relay_state) {
  HandoffReply r;
  r.relayed = relayed;
  r.relay_state = relay_state >= 0;
  r.ok = ok;
  r.error = error;
  r.fresh = fresh;
  r.init = init;
  SendToAgent(sock, std::move(r), "replying to the agent", relay_state);
}

}  // namespace fusekeeper
