#include "agent/base/fd_limit.h"
#include "agent/fkserve/program_instance.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "agent/fkserve/fusermount_protocol.h"
#include "agent/fkserve/relay/in_program.h"
#include "agent/fkserve/stop_signals.h"

namespace fusekeeper {
namespace {

constexpr size_t kLines = 4, kLineBytes = 200;

// A pid as /proc shows it, as this process's pid namespace numbers it: the last NSpid entry. (A
// /proc mounted for another pid namespace, e.g. an outer one, numbers processes its own way.)
pid_t InOurNamespace(pid_t proc_pid) {
  FILE* f = fopen(absl::StrCat("/proc/", proc_pid, "/status").c_str(), "re");
  if (f == nullptr) return -1;
  char line[512];
  pid_t last = -1;
  while (fgets(line, sizeof(line), f) != nullptr) {
    if (strncmp(line, "NSpid:", 6) != 0) continue;
    for (char* p = line + 6; *p != '\0';) {
      char* end = nullptr;
      const long v = strtol(p, &end, 10);
      if (end == p) break;
      last = static_cast<pid_t>(v);
      p = end;
    }
  }
  fclose(f);
  return last;
}

}  // namespace

std::set<pid_t> Children() {
  std::set<pid_t> out;
  DIR* tasks = opendir("/proc/self/task");
  if (tasks == nullptr) return out;
  while (dirent* t = readdir(tasks)) {
    if (t->d_name[0] == '.') continue;
    FILE* f = fopen(absl::StrCat("/proc/self/task/", t->d_name, "/children").c_str(), "re");
    if (f == nullptr) continue;
    int pid;
    while (fscanf(f, "%d", &pid) == 1) {
      if (const pid_t ours = InOurNamespace(pid); ours > 0) out.insert(ours);
    }
    fclose(f);
  }
  closedir(tasks);
  return out;
}

std::string Describe(int status) {
  return WIFEXITED(status) ? absl::StrCat("exited with status ", WEXITSTATUS(status))
                           : absl::StrCat("was killed by signal ", WTERMSIG(status));
}

PrivateDir::~PrivateDir() {
  if (dir.empty()) return;
  for (const char* name : {"fusermount", "fusermount3"}) unlink(absl::StrCat(bin, "/", name).c_str());
  rmdir(bin.c_str());
  unlink(socket.c_str());
  rmdir(mountpoint.c_str());
  rmdir(dir.c_str());
}

bool MakePrivateDir(const LaunchOptions& o, PrivateDir* d, std::string* error) {
  std::vector<std::string> tried;
  for (const std::string& where : o.work_dirs) {
    if (where.empty()) continue;
    std::string templ = absl::StrCat(where, "/fkserve-XXXXXX");
    if (mkdtemp(templ.data()) != nullptr) {
      d->dir = templ;
      break;
    }
    tried.push_back(absl::StrCat(where, " (", strerror(errno), ")"));
  }
  if (d->dir.empty()) {
    *error = absl::StrCat("cannot make a private directory in any of: ", absl::StrJoin(tried, ", "));
    return false;
  }
  chmod(d->dir.c_str(), 0711);  // the program may run its helpers under other uids
  d->mountpoint = d->dir + "/mnt";
  d->bin = d->dir + "/bin";
  d->socket = d->dir + "/fusermount.sock";
  if (mkdir(d->mountpoint.c_str(), 0755) != 0 || mkdir(d->bin.c_str(), 0755) != 0) {
    *error = absl::StrCat("cannot make ", d->mountpoint, ": ", strerror(errno));
    return false;
  }
  for (const char* name : {"fusermount", "fusermount3"}) {
    const std::string link = absl::StrCat(d->bin, "/", name);
    if (symlink(o.fusermount.c_str(), link.c_str()) != 0) {
      *error = absl::StrCat("cannot link ", link, " to ", o.fusermount, ": ", strerror(errno));
      return false;
    }
  }
  return true;
}


std::unique_ptr<ProgramInstance> ProgramInstance::Start(Loop& loop, Spec spec, std::string* error) {
  const LaunchOptions& o = *spec.options;
  const PrivateDir& dir = *spec.dir;
  std::unique_ptr<ProgramInstance> inst(new ProgramInstance(loop, std::move(spec)));
  inst->name_ = o.program[0];
  const int conn = inst->spec_.conn;
  const bool relayed = inst->spec_.relayed;
  unlink(dir.socket.c_str());  // an earlier instance's
  inst->service_ = FusermountService::Start(loop, dir.socket, conn, o.read_only, error);
  if (!inst->service_) return nullptr;
  const bool in_program = inst->spec_.claim != nullptr;
  inst->service_->OnClaim(inst->spec_.claim);
  if (inst->spec_.on_problem) inst->service_->OnProblem(inst->spec_.on_problem);
  struct stat conn_st{};
  fstat(conn, &conn_st);
  // The program also inherits the connection as a plain (non close-on-exec) fd: /dev/fd/{fd},
  // and the preload library's stand-in for a missing /dev/fuse.
  const int inherit = fcntl(conn, F_DUPFD, 3);
  if (inherit < 0) {
    *error = absl::StrCat("dup: ", strerror(errno));
    return nullptr;
  }
  const std::vector<std::string> args = ExpandProgramArgs(o.program, inherit, dir.mountpoint);
  // Learn whether exec worked through a close-on-exec pipe: it closes on success.
  int p[2];
  int err_pipe[2];
  if (pipe2(p, O_CLOEXEC) != 0 || pipe2(err_pipe, O_CLOEXEC) != 0) {
    close(inherit);
    *error = absl::StrCat("pipe: ", strerror(errno));
    return nullptr;
  }
  const pid_t child = fork();
  if (child < 0) {
    *error = absl::StrCat("fork: ", strerror(errno));
    for (int fd : {inherit, p[0], p[1], err_pipe[0], err_pipe[1]}) close(fd);
    return nullptr;
  }
  if (child == 0) {
    close(p[0]);
    dup2(err_pipe[1], STDERR_FILENO);
    const char* path = getenv("PATH");
    setenv("PATH", absl::StrCat(dir.bin, ":", path != nullptr ? path : "/usr/local/bin:/usr/bin:/bin").c_str(), 1);
    setenv(kFuseFdEnv, std::to_string(inherit).c_str(), 1);
    setenv(kServiceSocketEnv, dir.socket.c_str(), 1);
    setenv(kFusermountEnv, absl::StrCat(dir.bin, "/fusermount3").c_str(), 1);
    if (in_program) {
      // The preload library claims the kernel's connection at the first read of this socket.
      setenv(relay::kRelaySocketEnv, std::to_string(conn_st.st_ino).c_str(), 1);
    } else {
      unsetenv(relay::kRelaySocketEnv);
    }
    // A program given /dev/fd/{fd} mounts nothing: it needs no fusermount, but relayed it takes
    // the relay's core, or on the hop the library's splice of a reply into the socket as one
    // message (without it fuse-overlayfs's spliced READ replies reached the relay in pieces: 0.02
    // of direct). A sanitized program must load its runtime first: ASan is told the preload
    // library comes before it.
    bool given_fd = false;
    for (const std::string& a : o.program) given_fd = given_fd || a.find("{fd}") != std::string::npos;
    if (given_fd && relayed) {
      const char* asan = getenv("ASAN_OPTIONS");
      setenv("ASAN_OPTIONS", absl::StrCat(asan != nullptr && asan[0] ? absl::StrCat(asan, ":") : "",
                                          "verify_asan_link_order=0").c_str(), 1);
    }
    if (!o.preload.empty() && (!given_fd || relayed)) {
      const char* old = getenv("LD_PRELOAD");
      setenv("LD_PRELOAD", old != nullptr && old[0] ? absl::StrCat(o.preload, ":", old).c_str() : o.preload.c_str(), 1);
    }
    // No setuid binary gains anything from here on (the system's setuid fusermount3 among them;
    // ntfs-3g is setuid root on Debian): they run as the launcher's uid, and take the preload
    // library like any other program. A container with allowPrivilegeEscalation: false has this
    // already.
    prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
    // It ends with the launcher (as in a container, where the launcher is its PID 1): the next
    // launcher starts its own instance.
    prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
    for (int sig : kStopSignals) signal(sig, SIG_DFL);
    RestoreFdLimitForExec(o.program_fd_limit);
    // The launcher takes its signals from a signalfd, with them blocked: a mask survives exec.
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    std::vector<char*> argv;
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execvp(argv[0], argv.data());
    int err = errno;
    (void)!write(p[1], &err, sizeof(err));
    _exit(127);
  }
  close(p[1]);
  close(err_pipe[1]);
  close(inherit);
  inst->child_ = child;
  inst->started_ = std::chrono::steady_clock::now();
  inst->exec_pipe_ = UniqueFd(p[0]);
  inst->stderr_ = UniqueFd(err_pipe[0]);
  fcntl(err_pipe[0], F_SETFL, O_NONBLOCK);
  ProgramInstance* raw = inst.get();
  inst->stderr_watch_ = std::make_unique<PollWatch>(loop, err_pipe[0], POLLIN, /*multishot=*/true, [raw](int) {
    raw->ReadStderr();
  });
  inst->exec_watch_ = std::make_unique<PollWatch>(loop, p[0], POLLIN, /*multishot=*/false, [raw](int) {
    int exec_errno = 0;
    const ssize_t n = read(raw->exec_pipe_.get(), &exec_errno, sizeof(exec_errno));
    if (n == static_cast<ssize_t>(sizeof(exec_errno))) {
      raw->exec_error_ = absl::StrCat("could not start ", raw->name_, ": ", strerror(exec_errno));
    }
    raw->exec_known_ = true;
    raw->exec_pipe_.Reset();
    // Last: the callback may end the instance.
    if (raw->spec_.on_exec) raw->spec_.on_exec(raw->exec_error_);
    raw->MaybeEnded();
  });
  return inst;
}

ProgramInstance::~ProgramInstance() = default;

void ProgramInstance::ReadStderr() {
  char buf[4096];
  while (stderr_) {
    const ssize_t n = read(stderr_.get(), buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) return;
    if (n <= 0) {
      // Every process that held it has ended (or closed it).
      KeepLine(pending_);
      pending_.clear();
      stderr_watch_.reset();
      stderr_.Reset();
      MaybeEnded();
      return;
    }
    (void)!write(STDERR_FILENO, buf, static_cast<size_t>(n));
    pending_.append(buf, static_cast<size_t>(n));
    for (size_t nl; (nl = pending_.find('\n')) != std::string::npos;) {
      KeepLine(pending_.substr(0, nl));
      pending_.erase(0, nl + 1);
    }
    if (pending_.size() > 4 * kLineBytes) pending_.erase(0, pending_.size() - kLineBytes);
  }
}

void ProgramInstance::KeepLine(const std::string& line) {
  if (line.find_first_not_of(" \t\r") == std::string::npos) return;
  lines_.push_back(line.substr(0, kLineBytes));
  if (lines_.size() > kLines) lines_.erase(lines_.begin());
}

std::string ProgramInstance::LastWords() const { return absl::StrJoin(lines_, " | "); }

void ProgramInstance::AddReports(UniqueFd conn, std::function<void(const std::string& line)> on_line) {
  auto r = std::make_unique<Reports>();
  r->fd = std::move(conn);
  fcntl(r->fd.get(), F_SETFL, fcntl(r->fd.get(), F_GETFL) | O_NONBLOCK);
  Reports* raw = r.get();
  r->watch = std::make_unique<PollWatch>(loop_, raw->fd.get(), POLLIN, /*multishot=*/true,
                                         [this, raw, on_line = std::move(on_line)](int) {
    char buf[4096];
    while (true) {
      const ssize_t n = recv(raw->fd.get(), buf, sizeof(buf), MSG_DONTWAIT);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno == EAGAIN) return;
      if (n <= 0) break;  // the instance has ended
      on_line(std::string(buf, static_cast<size_t>(n)));
    }
    for (auto it = reports_.begin(); it != reports_.end(); ++it) {
      if (it->get() == raw) {
        reports_.erase(it);  // its watch with it: PollWatch allows that from its own callback
        break;
      }
    }
    MaybeEnded();
  });
  reports_.push_back(std::move(r));
}

void ProgramInstance::Reap() {
  while (!processes_gone_) {
    int status = 0;
    const pid_t pid = waitpid(-1, &status, WNOHANG | WUNTRACED | WCONTINUED);
    if (pid == 0) return;  // some still run
    if (pid < 0) {
      if (errno == EINTR) continue;
      processes_gone_ = true;  // ECHILD: nothing of the program is left
      break;
    }
    // Stopped (every thread of it: a debugger, SIGSTOP) or continued: said, since a stopped
    // program answers nothing and the relay's stall bound will end it.
    if (WIFSTOPPED(status) || WIFCONTINUED(status)) {
      fprintf(stderr, "fkserve: %s (pid %d) %s\n", name_.c_str(), pid,
              WIFCONTINUED(status) ? "was continued"
                                   : absl::StrCat("was stopped by signal ", WSTOPSIG(status), ": it answers nothing until "
                                                  "continued").c_str());
      continue;
    }
    ++reaped_;
    last_pid_ = pid;
    last_status_ = status;
    if (pid == child_) {
      program_done_ = true;
      program_status_ = status;
      if (const size_t left = Children().size(); left > 0 && exec_known_ && !exec_failed()) {
        fprintf(stderr, "fkserve: %s %s and left %zu process(es) running: following them\n", name_.c_str(),
                Describe(status).c_str(), left);
      }
    }
  }
  MaybeEnded();
}

void ProgramInstance::MaybeEnded() {
  if (ended_ || !processes_gone_ || !exec_known_ || stderr_.valid() || !reports_.empty()) return;
  ended_ = true;
  if (spec_.on_end) spec_.on_end();
}

std::string ProgramInstance::why() const {
  if (reaped_ > 1) {
    return absl::StrCat(name_, " ", Describe(program_status_), "; its last process (pid ", last_pid_, ") ",
                        Describe(last_status_));
  }
  return absl::StrCat(name_, " ", Describe(program_done_ ? program_status_ : last_status_));
}

int ProgramInstance::status() const { return reaped_ > 1 ? last_status_ : program_status_; }

}  // namespace fusekeeper
