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
#include "agent/fkserve/fusermount_protocol.h"
#include "agent/fkserve/stop_signals.h"

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

}  // namespace

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
  s->thread_ = StartWithoutStopSignals([raw = s.get()] { raw->Run(); });
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

void FusermountService::OnClaim(ClaimHandler fn) {
  std::lock_guard<std::mutex> lock(mu_);
  on_claim_ = std::move(fn);
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
  if (lines.size() == 3 && lines[0] == "claim") {
    ClaimHandler claim;
    {
      std::lock_guard<std::mutex> lock(mu_);
      claim = on_claim_;
    }
    if (!claim) {
      SendWithFd(conn, "refused: this launcher relays the connection itself", -1);
      return;
    }
    return claim(conn, lines[1], lines[2]);
  }
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
