#include "agent/fkserve/fusermount.h"

#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "agent/base/unique_fd.h"

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

int Refuse(const std::string& why) {
  fprintf(stderr, "fusermount (fkserve): %s\n", why.c_str());
  return 1;
}

int EnvFd(const char* name) {
  const char* text = getenv(name);
  int fd = -1;
  if (text == nullptr || !absl::SimpleAtoi(text, &fd) || fd < 0 || fcntl(fd, F_GETFD) < 0) return -1;
  return fd;
}

// One message (SOCK_SEQPACKET), with `fd` attached if >= 0. Blocking.
bool SendWithFd(int sock, const std::string& text, int fd) {
  iovec iov{const_cast<char*>(text.data()), text.size()};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (fd >= 0) {
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  ssize_t n;
  do {
    n = sendmsg(sock, &msg, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  return n == static_cast<ssize_t>(text.size());
}

// One message and the fd it carries (-1 if none). Blocking.
bool ReceiveWithFd(int sock, std::string* text, int* fd) {
  char buf[8192];
  iovec iov{buf, sizeof(buf)};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t n;
  do {
    n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return false;
  *fd = -1;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS && c->cmsg_len == CMSG_LEN(sizeof(int))) {
      memcpy(fd, CMSG_DATA(c), sizeof(int));
    }
  }
  text->assign(buf, static_cast<size_t>(n));
  return true;
}

// Where the launcher answers: $FKSERVE_FUSERMOUNT_SOCKET, or, for a program that runs its
// fusermount with an environment of its own (go-fuse passes only _FUSE_COMMFD), beside the bin
// directory this link is in (found from argv[0], or on $PATH).
std::string ServiceSocket(const char* argv0) {
  if (const char* env = getenv(kServiceSocketEnv); env != nullptr && env[0] != '\0') return env;
  auto beside = [](const std::string& link) -> std::string {
    const size_t bin = link.rfind('/');
    if (bin == std::string::npos) return "";
    const size_t dir = link.rfind('/', bin == 0 ? 0 : bin - 1);
    if (dir == std::string::npos) return "";
    const std::string sock = link.substr(0, dir) + "/fusermount.sock";
    struct stat st;
    return stat(sock.c_str(), &st) == 0 && S_ISSOCK(st.st_mode) ? sock : "";
  };
  const std::string self = argv0 != nullptr ? argv0 : "";
  if (self.find('/') != std::string::npos) return beside(self);
  const char* path = getenv("PATH");
  for (absl::string_view d : absl::StrSplit(path != nullptr ? path : "", ':', absl::SkipEmpty())) {
    const std::string candidate = absl::StrCat(d, "/", self);
    if (access(candidate.c_str(), X_OK) != 0) continue;
    if (std::string sock = beside(candidate); !sock.empty()) return sock;
  }
  return "";
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
  int type = 0;
  socklen_t type_len = sizeof(type);
  if (commfd < 0 || getsockopt(commfd, SOL_SOCKET, SO_TYPE, &type, &type_len) != 0) {
    return Refuse("_FUSE_COMMFD is not set to an open socket: not called by a FUSE library");
  }
  const std::string found = ServiceSocket(argv[0]);
  const char* service = found.c_str();
  if (found.empty()) {
    return Refuse(absl::StrCat("no launcher to ask: ", kServiceSocketEnv,
                               " is not set and this fusermount is not in a launcher's directory; run the program "
                               "under `fkserve launch`"));
  }
  UniqueFd sock(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (strlen(service) >= sizeof(addr.sun_path)) return Refuse(absl::StrCat(service, " is too long a socket path"));
  strcpy(addr.sun_path, service);
  if (!sock || connect(sock.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return Refuse(absl::StrCat("cannot reach the launcher at ", service, ": ", strerror(errno)));
  }
  char real[PATH_MAX];
  const std::string where = realpath(mountpoint.c_str(), real) != nullptr ? real : mountpoint;
  std::string reply;
  int fuse_fd = -1;
  if (!SendWithFd(sock.get(), absl::StrCat("mount\n", where, "\n", absl::StrJoin(options, ",")), -1) ||
      !ReceiveWithFd(sock.get(), &reply, &fuse_fd)) {
    return Refuse(absl::StrCat("asking the launcher for the connection: ", strerror(errno)));
  }
  if (fuse_fd < 0) return Refuse(reply);
  UniqueFd owned(fuse_fd);
  // The handover, as fusermount does it: one data byte and the fd.
  if (!SendWithFd(commfd, std::string(1, '\0'), fuse_fd)) {
    return Refuse(absl::StrCat("handing over the connection on _FUSE_COMMFD: ", strerror(errno)));
  }
  if (!quiet) fprintf(stderr, "fusermount (fkserve): %s\n", reply.c_str());
  return 0;
}

std::unique_ptr<FusermountService> FusermountService::Start(const std::string& socket_path, int fuse_fd,
                                                            bool agent_read_only, std::string* error) {
  std::unique_ptr<FusermountService> s(new FusermountService());
  s->agent_read_only_ = agent_read_only;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (socket_path.size() >= sizeof(addr.sun_path)) {
    *error = absl::StrCat("the launcher's socket path ", socket_path, " is longer than 107 bytes (set --work_dir)");
    return nullptr;
  }
  memcpy(addr.sun_path, socket_path.data(), socket_path.size());
  s->listen_fd_ = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  const mode_t old = umask(0077);  // the program runs as the launcher's uid: nobody else connects
  const bool bound = s->listen_fd_ >= 0 && bind(s->listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  umask(old);
  if (!bound || listen(s->listen_fd_, 8) != 0 || pipe2(s->stop_, O_CLOEXEC) != 0) {
    *error = absl::StrCat("cannot listen on ", socket_path, ": ", strerror(errno));
    return nullptr;
  }
  s->fuse_fd_ = fcntl(fuse_fd, F_DUPFD_CLOEXEC, 3);
  // Stop signals are for the launcher's main thread (they interrupt its wait).
  sigset_t stop, prev;
  sigemptyset(&stop);
  for (int sig : {SIGTERM, SIGINT, SIGHUP}) sigaddset(&stop, sig);
  pthread_sigmask(SIG_BLOCK, &stop, &prev);
  s->thread_ = std::thread([raw = s.get()] { raw->Run(); });
  pthread_sigmask(SIG_SETMASK, &prev, nullptr);
  return s;
}

FusermountService::~FusermountService() {
  if (stop_[1] >= 0) (void)!write(stop_[1], "x", 1);
  if (thread_.joinable()) thread_.join();
  for (int fd : {listen_fd_, fuse_fd_, stop_[0], stop_[1]}) {
    if (fd >= 0) close(fd);
  }
}

std::vector<std::string> FusermountService::problems() {
  std::lock_guard<std::mutex> lock(mu_);
  return problems_;
}

void FusermountService::OnProblem(std::function<void(const std::string&)> fn) {
  std::lock_guard<std::mutex> lock(mu_);
  on_problem_ = std::move(fn);
  if (!on_problem_) return;
  for (const auto& p : problems_) on_problem_(p);
}

void FusermountService::AddProblem(const std::string& p) {
  std::lock_guard<std::mutex> lock(mu_);
  if (problems_.size() < 8) problems_.push_back(p);
  if (on_problem_) on_problem_(p);
}

bool FusermountService::handed() {
  std::lock_guard<std::mutex> lock(mu_);
  return handed_;
}

void FusermountService::Run() {
  while (true) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {stop_[0], POLLIN, 0}};
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    UniqueFd conn(accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC));
    if (conn) Answer(conn.get());
  }
}

void FusermountService::Answer(int conn) {
  // A bounded wait for the request: a client that connects and says nothing is dropped.
  pollfd pfd{conn, POLLIN, 0};
  std::string request;
  int ignored = -1;
  if (poll(&pfd, 1, 5000) != 1 || !ReceiveWithFd(conn, &request, &ignored)) return;
  if (ignored >= 0) close(ignored);
  std::vector<std::string> lines = absl::StrSplit(request, absl::MaxSplits('\n', 2));
  auto refuse = [&](const std::string& why) {
    fprintf(stderr, "fkserve: fusermount refused: %s\n", why.c_str());
    AddProblem(absl::StrCat("refused: ", why));
    SendWithFd(conn, why, -1);
  };
  if (lines.size() != 3 || lines[0] != "mount") return refuse("a request that is not fkserve's fusermount's");
  bool second = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    second = handed_;
    handed_ = true;
  }
  if (second) {
    return refuse(absl::StrCat("a second mount (of ", lines[1],
                               ") is refused: this volume's connection was handed over already"));
  }
  const OptionVerdict verdict = ClassifyMountOptions({lines[2]}, agent_read_only_);
  std::string line = absl::StrCat("handed the volume's FUSE connection over for ", lines[1]);
  if (!verdict.accepted.empty()) absl::StrAppend(&line, "; options accepted: ", absl::StrJoin(verdict.accepted, ","));
  if (!verdict.not_applied.empty()) {
    absl::StrAppend(&line, "; options NOT applied (the volume's mount is the agent's): ",
                    absl::StrJoin(verdict.not_applied, ", "));
    AddProblem(absl::StrCat("options not applied: ", absl::StrJoin(verdict.not_applied, ", ")));
  }
  fprintf(stderr, "fkserve: fusermount: %s\n", line.c_str());
  SendWithFd(conn, line, fuse_fd_);
}

}  // namespace fusekeeper
