#include "agent/fkserve/fusermount.h"

#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace fusekeeper {
namespace {

// Options that change nothing a pod could notice, or that the agent's own mount already has
// (nosuid,nodev,allow_other,default_permissions): accepted as asked.
bool Harmless(absl::string_view name) {
  static const char* kHarmless[] = {"fsname",      "subtype",  "allow_other", "allow_root", "default_permissions",
                                    "nosuid",      "nodev",    "max_read",    "blksize",    "auto_unmount",
                                    "nonempty",    "noatime",  "relatime",    "nodiratime", "strictatime",
                                    "atime",       "diratime", "sync",        "async",      "dirsync",
                                    "user",        "big_writes", "kernel_cache", "auto_cache", "large_read"};
  for (const char* h : kHarmless) {
    if (name == h) return true;
  }
  return false;
}

// Best effort: a line for the launcher (FKSERVE_REPORT_FD), which passes it on to the agent.
void ReportLine(const std::string& line) {
  const char* fd_text = getenv(kReportFdEnv);
  int fd = -1;
  if (fd_text == nullptr || !absl::SimpleAtoi(fd_text, &fd) || fd < 0) return;
  const std::string text = line + "\n";
  (void)!write(fd, text.data(), text.size());
}

int Refuse(const std::string& why) {
  fprintf(stderr, "fusermount (fkserve): %s\n", why.c_str());
  ReportLine(absl::StrCat("refused: ", why));
  return 1;
}

int EnvFd(const char* name) {
  const char* text = getenv(name);
  int fd = -1;
  if (text == nullptr || !absl::SimpleAtoi(text, &fd) || fd < 0 || fcntl(fd, F_GETFD) < 0) return -1;
  return fd;
}

}  // namespace

bool IsFusermountName(const char* argv0) {
  if (argv0 == nullptr) return false;
  const char* base = strrchr(argv0, '/');
  base = base == nullptr ? argv0 : base + 1;
  return strcmp(base, "fusermount") == 0 || strcmp(base, "fusermount3") == 0;
}

OptionVerdict ClassifyMountOptions(const std::vector<std::string>& options, bool agent_read_only) {
  OptionVerdict v;
  for (const std::string& list : options) {
    for (absl::string_view opt : absl::StrSplit(list, ',', absl::SkipEmpty())) {
      const absl::string_view name = opt.substr(0, opt.find('='));
      std::string o(opt);
      if (name == "rw") {
        (agent_read_only ? v.not_applied : v.accepted)
            .push_back(agent_read_only ? "rw (the agent mounted the volume read-only)" : o);
      } else if (name == "ro") {
        (agent_read_only ? v.accepted : v.not_applied)
            .push_back(agent_read_only ? o : "ro (the agent mounted the volume read-write)");
      } else if (name == "exec" || name == "noexec") {
        v.not_applied.push_back(absl::StrCat(o, " (the volume's mount flags decide)"));
      } else if (name == "suid" || name == "dev") {
        v.not_applied.push_back(absl::StrCat(o, " (never: the agent mounts nosuid,nodev)"));
      } else if (Harmless(name)) {
        v.accepted.push_back(o);
      } else {
        v.not_applied.push_back(absl::StrCat(o, " (not known to fkserve)"));
      }
    }
  }
  return v;
}

int FusermountMain(int argc, char** argv) {
  std::vector<std::string> options;
  std::string mountpoint;
  bool unmount = false, quiet = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-u") {
      unmount = true;
    } else if (a == "-q") {
      quiet = true;
    } else if (a == "-z" || a == "--auto-unmount") {
      // -z: lazy unmount; --auto-unmount: unmount when the program dies. The agent owns the
      // mount either way.
    } else if (a == "-o" && i + 1 < argc) {
      options.push_back(argv[++i]);
    } else if (absl::StartsWith(a, "-o") && a.size() > 2) {
      options.push_back(a.substr(2));
    } else if (a == "-V" || a == "--version") {
      printf("fusermount (fkserve): hands over the volume's FUSE connection instead of mounting\n");
      return 0;
    } else if (a == "-h" || a == "--help") {
      printf("fusermount (fkserve) [-o options] [--] mountpoint | -u [-q] [-z] [--] mountpoint\n");
      return 0;
    } else if (a == "--") {
      if (i + 1 < argc) mountpoint = argv[++i];
    } else if (!a.empty() && a[0] != '-') {
      mountpoint = a;
    } else {
      return Refuse(absl::StrCat("unknown argument '", a, "'"));
    }
  }
  if (unmount) {
    // The program ends its session: the mount is the agent's, and stays for the next server.
    if (!quiet) fprintf(stderr, "fusermount (fkserve): not unmounting %s: the volume's mount is the agent's\n",
                        mountpoint.c_str());
    return 0;
  }
  if (mountpoint.empty()) return Refuse("no mountpoint given");
  const int commfd = EnvFd("_FUSE_COMMFD");
  if (commfd < 0) return Refuse("_FUSE_COMMFD is not set to an open socket: not called by a FUSE library");
  int type = 0;
  socklen_t type_len = sizeof(type);
  if (getsockopt(commfd, SOL_SOCKET, SO_TYPE, &type, &type_len) != 0) {
    return Refuse(absl::StrCat("_FUSE_COMMFD ", commfd, " is not a socket"));
  }
  const int fuse_fd = EnvFd(kFuseFdEnv);
  if (fuse_fd < 0) {
    return Refuse(absl::StrCat(kFuseFdEnv, " is not set to the volume's connection: run the program under `fkserve launch`"));
  }
  // One connection, one mount: a second request (the program mounting twice, or another program
  // started from it) is refused.
  if (const char* marker = getenv(kHandedMarkerEnv); marker != nullptr) {
    int m = open(marker, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (m < 0) {
      return Refuse(errno == EEXIST ? absl::StrCat("a second mount (of ", mountpoint,
                                                   ") is refused: this volume's connection was handed over already")
                                    : absl::StrCat("cannot record the handover in ", marker, ": ", strerror(errno)));
    }
    close(m);
  }
  const char* ro = getenv(kAgentReadOnlyEnv);
  const OptionVerdict verdict = ClassifyMountOptions(options, ro != nullptr && std::string(ro) == "1");
  const char* given = getenv(kMountpointEnv);
  char real[PATH_MAX];
  const std::string mount_real = realpath(mountpoint.c_str(), real) != nullptr ? real : mountpoint;
  std::string where = mountpoint;
  if (given != nullptr && mount_real != given) {
    where = absl::StrCat(mountpoint, " (not the directory fkserve made, ", given, ")");
  }
  // The handover: one data byte and the fd, as fusermount does.
  char byte = 0;
  iovec iov{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  memcpy(CMSG_DATA(c), &fuse_fd, sizeof(int));
  ssize_t sent;
  do {
    sent = sendmsg(commfd, &msg, MSG_NOSIGNAL);
  } while (sent < 0 && errno == EINTR);
  if (sent != 1) return Refuse(absl::StrCat("handing over the connection on _FUSE_COMMFD: ", strerror(errno)));
  std::string line = absl::StrCat("handed the volume's FUSE connection over for ", where);
  if (!verdict.accepted.empty()) absl::StrAppend(&line, "; options accepted: ", absl::StrJoin(verdict.accepted, ","));
  if (!verdict.not_applied.empty()) {
    absl::StrAppend(&line, "; options NOT applied (the volume's mount is the agent's): ",
                    absl::StrJoin(verdict.not_applied, ", "));
  }
  fprintf(stderr, "fusermount (fkserve): %s\n", line.c_str());
  ReportLine(verdict.not_applied.empty() ? absl::StrCat("ok: ", line) : absl::StrCat("options: ", line));
  return 0;
}

}  // namespace fusekeeper
