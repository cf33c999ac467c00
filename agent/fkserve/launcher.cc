#include "agent/fkserve/launcher.h"

#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "agent/fkserve/agent_link.h"
#include "agent/fkserve/fusermount.h"
#include "agent/fkserve/fusermount_protocol.h"
#include "agent/fkserve/stop_signals.h"

namespace fusekeeper {
namespace {

volatile sig_atomic_t pending_stop_signal = 0;
void RecordStopSignal(int sig) { pending_stop_signal = sig; }


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

// The launcher's children: the program, and (as a subreaper) whatever it left running.
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

// The private directory: the program's mount point, the fusermount links, the launcher's socket.
struct PrivateDir {
  std::string dir, mountpoint, bin, socket;
  ~PrivateDir() {
    if (dir.empty()) return;
    for (const char* name : {"fusermount", "fusermount3"}) unlink(absl::StrCat(bin, "/", name).c_str());
    rmdir(bin.c_str());
    unlink(socket.c_str());
    rmdir(mountpoint.c_str());
    rmdir(dir.c_str());
  }
};

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

// The program's stderr (and its descendants'), passed through to ours; the last lines are kept
// for the report to the agent, so that its Event says why a program stopped.
class StderrTail {
 public:
  explicit StderrTail(int fd) : fd_(fd), thread_(StartWithoutStopSignals([this] { Run(); })) {}
  ~StderrTail() {
    if (thread_.joinable()) thread_.join();
  }
  // Waits for the end of the stream (every process that held it has ended), then the last lines.
  std::string Last() {
    if (thread_.joinable()) thread_.join();
    return absl::StrJoin(lines_, " | ");
  }

 private:
  static constexpr size_t kLines = 4, kLineBytes = 200;
  void Run() {
    std::string pending;
    char buf[4096];
    while (true) {
      ssize_t n = read(fd_.get(), buf, sizeof(buf));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      (void)!write(STDERR_FILENO, buf, static_cast<size_t>(n));
      pending.append(buf, static_cast<size_t>(n));
      for (size_t nl; (nl = pending.find('\n')) != std::string::npos;) {
        Keep(pending.substr(0, nl));
        pending.erase(0, nl + 1);
      }
      if (pending.size() > 4 * kLineBytes) pending.erase(0, pending.size() - kLineBytes);
    }
    Keep(pending);
  }
  void Keep(const std::string& line) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) return;
    lines_.push_back(line.substr(0, kLineBytes));
    if (lines_.size() > kLines) lines_.erase(lines_.begin());
  }
  UniqueFd fd_;
  std::vector<std::string> lines_;
  std::thread thread_;
};

}  // namespace

std::vector<std::string> ExpandProgramArgs(const std::vector<std::string>& program, int fd,
                                           const std::string& mountpoint) {
  std::vector<std::string> out;
  for (const std::string& a : program) {
    out.push_back(absl::StrReplaceAll(a, {{"{fd}", std::to_string(fd)}, {"{mountpoint}", mountpoint}}));
  }
  return out;
}

int Launch(UniqueFd sock_fd, UniqueFd fuse_fd, const LaunchOptions& o) {
  const int sock = sock_fd.get();
  auto fail = [sock](int code, const std::string& why) {
    ReplyToAgent(sock, false, why);
    fprintf(stderr, "fkserve: %s\n", why.c_str());
    return code;
  };
  if (o.program.empty()) return fail(2, "launch: no program given (fkserve launch -- <program> [args])");
  PrivateDir dir;
  std::string error;
  if (!MakePrivateDir(o, &dir, &error)) return fail(5, error);
  // fkserve's fusermount asks for the connection here.
  auto service = FusermountService::Start(dir.socket, fuse_fd.get(), o.read_only, &error);
  if (!service) return fail(5, error);
  // The program also inherits the connection as a plain (non close-on-exec) fd: /dev/fd/{fd},
  // and the preload library's stand-in for a missing /dev/fuse.
  const int inherit = fcntl(fuse_fd.get(), F_DUPFD, 3);
  if (inherit < 0) return fail(5, absl::StrCat("dup: ", strerror(errno)));
  const std::vector<std::string> args = ExpandProgramArgs(o.program, inherit, dir.mountpoint);
  // Learn whether exec worked through a close-on-exec pipe: it closes on success.
  int p[2];
  int err_pipe[2];
  if (pipe2(p, O_CLOEXEC) != 0 || pipe2(err_pipe, O_CLOEXEC) != 0) return fail(5, "pipe");
  // Orphans the program leaves (a daemonizing program's real server) become our children.
  if (prctl(PR_SET_CHILD_SUBREAPER, 1) != 0) {
    fprintf(stderr, "fkserve: cannot become a child subreaper (%s): a daemonizing program is not followed\n",
            strerror(errno));
  }
  pid_t child = fork();
  if (child < 0) return fail(5, absl::StrCat("fork: ", strerror(errno)));
  if (child == 0) {
    close(p[0]);
    dup2(err_pipe[1], STDERR_FILENO);
    const char* path = getenv("PATH");
    setenv("PATH", absl::StrCat(dir.bin, ":", path != nullptr ? path : "/usr/local/bin:/usr/bin:/bin").c_str(), 1);
    setenv(kFuseFdEnv, std::to_string(inherit).c_str(), 1);
    setenv(kServiceSocketEnv, dir.socket.c_str(), 1);
    setenv(kFusermountEnv, absl::StrCat(dir.bin, "/fusermount3").c_str(), 1);
    // A program given /dev/fd/{fd} mounts nothing: it needs no fusermount, and no library in its
    // way (a sanitized program must load its runtime first).
    bool given_fd = false;
    for (const std::string& a : o.program) given_fd = given_fd || a.find("{fd}") != std::string::npos;
    if (!o.preload.empty() && !given_fd) {
      const char* old = getenv("LD_PRELOAD");
      setenv("LD_PRELOAD", old != nullptr && old[0] ? absl::StrCat(o.preload, ":", old).c_str() : o.preload.c_str(), 1);
    }
    // No setuid binary gains anything from here on (the system's setuid fusermount3 among them;
    // ntfs-3g is setuid root on Debian): they run as the launcher's uid, and take the preload
    // library like any other program. A container with allowPrivilegeEscalation: false has this
    // already.
    prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
    for (int sig : kStopSignals) signal(sig, SIG_DFL);
    std::vector<char*> argv;
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execvp(argv[0], argv.data());
    int err = errno;
    (void)!write(p[1], &err, sizeof(err));
    _exit(127);
  }
  // Without SA_RESTART: the wait is interrupted, and the launcher passes the signal on.
  HandleStopSignals(RecordStopSignal, /*restart=*/false);
  close(p[1]);
  close(err_pipe[1]);
  close(inherit);
  StderrTail tail(err_pipe[0]);
  // Our own dup (close-on-exec: the program never sees it) is only for re-depositing.
  UniqueFd keep(fcntl(fuse_fd.get(), F_DUPFD_CLOEXEC, 3));
  fuse_fd.Reset();
  int exec_errno = 0;
  ssize_t n;
  do {
    n = read(p[0], &exec_errno, sizeof(exec_errno));
  } while (n < 0 && errno == EINTR);
  close(p[0]);
  const std::string name = o.program[0];
  if (n == sizeof(exec_errno)) {
    waitpid(child, nullptr, 0);
    return fail(127, absl::StrCat("could not start ", name, ": ", strerror(exec_errno)));
  }
  ReplyToAgent(sock, true, "");
  if (o.mark_ready) o.mark_ready(true);
  // The connection stays open while the program serves (and is re-deposited with a restarted
  // agent); its end is reported to the agent. A launched program's FUSE_INIT is its own, so
  // there is none to re-deposit: its successors get a fresh connection.
  AgentLink link(std::move(sock_fd), std::move(keep), "", o.socket_path, o.agent_uid);
  link.Start();
  // What fkserve's fusermount refused or did not apply reaches the volume's Events now.
  service->OnProblem([&link, name](const std::string& p) { link.Notice(absl::StrCat(name, ": fusermount ", p)); });
  // Until the last of the program's processes has ended.
  int program_status = 0, last_status = 0;
  pid_t last_pid = child;
  bool program_done = false;
  int reaped = 0;
  while (true) {
    if (const int sig = pending_stop_signal; sig != 0) {
      pending_stop_signal = 0;
      for (pid_t pid : Children()) kill(pid, sig);
    }
    int status = 0;
    pid_t pid = waitpid(-1, &status, 0);
    if (pid < 0) {
      if (errno == EINTR) continue;
      break;  // ECHILD: nothing of the program is left
    }
    ++reaped;
    last_pid = pid;
    last_status = status;
    if (pid == child) {
      program_done = true;
      program_status = status;
      if (!Children().empty()) {
        fprintf(stderr, "fkserve: %s %s and left %zu process(es) running: following them\n", name.c_str(),
                Describe(status).c_str(), Children().size());
      }
    }
  }
  if (o.mark_ready) o.mark_ready(false);
  std::string why = absl::StrCat(name, " ", Describe(program_done && reaped == 1 ? program_status : last_status));
  if (reaped > 1) {
    why = absl::StrCat(name, " ", Describe(program_status), "; its last process (pid ", last_pid, ") ",
                       Describe(last_status));
  }
  service->OnProblem(nullptr);  // the link is about to go
  const std::vector<std::string> problems = service->problems();
  if (!problems.empty()) absl::StrAppend(&why, " [fusermount: ", absl::StrJoin(problems, "; "), "]");
  if (const std::string last = tail.Last(); !last.empty()) absl::StrAppend(&why, "; its last words: ", last);
  link.Report(false, why);
  fprintf(stderr, "fkserve: %s\n", why.c_str());
  const int final_status = reaped > 1 ? last_status : program_status;
  return WIFEXITED(final_status) ? WEXITSTATUS(final_status) : 128 + WTERMSIG(final_status);
}

}  // namespace fusekeeper
