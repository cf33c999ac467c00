#include "agent/fkserve/fusermount.h"

#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
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

std::unique_ptr<FusermountService> FusermountService::Start(Loop& loop, const std::string& socket_path,
                                                            int fuse_fd, bool agent_read_only, std::string* error) {
  std::unique_ptr<FusermountService> s(new FusermountService(loop));
  s->agent_read_only_ = agent_read_only;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (socket_path.size() >= sizeof(addr.sun_path)) {
    *error = absl::StrCat("the launcher's socket path ", socket_path, " is longer than 107 bytes (set --work_dir)");
    return nullptr;
  }
  memcpy(addr.sun_path, socket_path.data(), socket_path.size());
  s->listen_fd_ = UniqueFd(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  const mode_t old = umask(0077);  // the program runs as the launcher's uid: nobody else connects
  const bool bound =
      s->listen_fd_.valid() && bind(s->listen_fd_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  umask(old);
  if (!bound || listen(s->listen_fd_.get(), 8) != 0) {
    *error = absl::StrCat("cannot listen on ", socket_path, ": ", strerror(errno));
    return nullptr;
  }
  s->fuse_fd_ = UniqueFd(fcntl(fuse_fd, F_DUPFD_CLOEXEC, 3));
  s->listening_ = std::make_unique<PollWatch>(loop, s->listen_fd_.get(), POLLIN, /*multishot=*/true,
                                              [raw = s.get()](int res) {
                                                if (res > 0) raw->Accept();
                                              });
  return s;
}

FusermountService::~FusermountService() = default;

void FusermountService::OnProblem(std::function<void(const std::string&)> fn) {
  on_problem_ = std::move(fn);
  if (!on_problem_) return;
  for (const auto& p : problems_) on_problem_(p);
}

void FusermountService::AddProblem(const std::string& p) {
  if (problems_.size() < 8) problems_.push_back(p);
  if (on_problem_) on_problem_(p);
}

void FusermountService::Accept() {
  while (true) {
    UniqueFd conn(accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (!conn.valid()) return;  // EAGAIN: all taken (an error: the next connection tries again)
    const int fd = conn.get();
    Client& c = clients_[fd];
    c.fd = std::move(conn);
    // A bounded wait for the request: a client that connects and says nothing is dropped.
    c.timeout = std::make_unique<Timer>(loop_);
    c.timeout->Arm(std::chrono::seconds(5), [this, fd] { Drop(fd); });
    c.watch = std::make_unique<PollWatch>(loop_, fd, POLLIN, /*multishot=*/false, [this, fd](int res) {
      if (res > 0) Answer(fd);
      Drop(fd);
    });
  }
}

void FusermountService::Drop(int conn) {
  auto it = clients_.find(conn);
  if (it == clients_.end()) return;
  clients_.erase(it);  // its timer and watch with it (either may be the one running: both allow that)  // its watch with it (it may be the one running: PollWatch allows that)
}

void FusermountService::Answer(int conn) {
  // A bounded wait for the request: a client that connects and says nothing is dropped.
  std::string request;
  int ignored = -1;
  if (!ReceiveWithFd(conn, &request, &ignored)) return;
  if (ignored >= 0) close(ignored);
  std::vector<std::string> lines = absl::StrSplit(request, absl::MaxSplits('\n', 2));
  auto refuse = [&](const std::string& why) {
    fprintf(stderr, "fkserve: fusermount refused: %s\n", why.c_str());
    AddProblem(absl::StrCat("refused: ", why));
    SendWithFd(conn, why, -1);
  };
  if (lines.size() == 3 && lines[0] == "claim") {
    if (!on_claim_) {
      SendWithFd(conn, "refused: this launcher relays the connection itself", -1);
      return;
    }
    return on_claim_(conn, lines[1], lines[2]);
  }
  if (lines.size() != 3 || lines[0] != "mount") return refuse("a request that is not fkserve's fusermount's");
  const bool second = handed_;
  handed_ = true;
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
  SendWithFd(conn, line, fuse_fd_.get());
}

}  // namespace fusekeeper
