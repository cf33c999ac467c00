#include "agent/fkserve/launcher.h"

#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <memory>
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
#include "agent/fkserve/relay/in_program.h"
#include "agent/fkserve/relay/relay.h"
#include "agent/fuse/handoff_protocol.h"
#include "agent/fkserve/stop_signals.h"

namespace fusekeeper {
namespace {

volatile sig_atomic_t pending_stop_signal = 0;
// A stop signal was passed on to the program: its end is not a crash to restart from.
bool stop_requested = false;
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

absl::Status CheckDurability(const std::string& durability) {
  if (durability == "auto" || relay::ParseDurability(durability).has_value()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("--durability=", durability,
                                                 ": say when the program stores a change: write (before it answers "
                                                 "it), sync (at fsync/close), close (after close), unmount, or auto"));
}

relay::Durability ResolveDurability(const LaunchOptions& options) {
  if (auto d = relay::ParseDurability(options.durability)) return *d;
  if (options.program.empty()) return relay::Durability::kAtSync;
  return relay::KnownDurability(options.program[0]).value_or(relay::Durability::kAtSync);
}

std::vector<std::string> ExpandProgramArgs(const std::vector<std::string>& program, int fd,
                                           const std::string& mountpoint) {
  std::vector<std::string> out;
  for (const std::string& a : program) {
    out.push_back(absl::StrReplaceAll(a, {{"{fd}", std::to_string(fd)}, {"{mountpoint}", mountpoint}}));
  }
  return out;
}

namespace {

// One instance of the program: its processes, the fusermount that hands it the connection (a
// second mount is refused, so each instance gets its own), and its stderr.
struct Instance {
  pid_t child = -1;
  std::unique_ptr<FusermountService> service;
  std::unique_ptr<StderrTail> tail;
  std::chrono::steady_clock::time_point started;
};

// Starts the program on `conn` (the connection, or the relay's socket for it: `relayed`).
// Blocking until exec has worked or failed; false with *error if it could not start.
// `claim`: relayed, what answers the preload library's claim of the kernel's connection
// (relay/in_program.h); none: the program stays on the launcher's hop.
bool Spawn(const LaunchOptions& o, const PrivateDir& dir, int conn, bool relayed, Instance* inst, std::string* error,
           FusermountService::ClaimHandler claim = nullptr) {
  unlink(dir.socket.c_str());  // an earlier instance's
  inst->service = FusermountService::Start(dir.socket, conn, o.read_only, error);
  if (!inst->service) return false;
  const bool in_program = claim != nullptr;
  inst->service->OnClaim(std::move(claim));
  struct stat conn_st{};
  fstat(conn, &conn_st);
  // The program also inherits the connection as a plain (non close-on-exec) fd: /dev/fd/{fd},
  // and the preload library's stand-in for a missing /dev/fuse.
  const int inherit = fcntl(conn, F_DUPFD, 3);
  if (inherit < 0) {
    *error = absl::StrCat("dup: ", strerror(errno));
    return false;
  }
  const std::vector<std::string> args = ExpandProgramArgs(o.program, inherit, dir.mountpoint);
  // Learn whether exec worked through a close-on-exec pipe: it closes on success.
  int p[2];
  int err_pipe[2];
  if (pipe2(p, O_CLOEXEC) != 0 || pipe2(err_pipe, O_CLOEXEC) != 0) {
    close(inherit);
    *error = absl::StrCat("pipe: ", strerror(errno));
    return false;
  }
  const pid_t child = fork();
  if (child < 0) {
    *error = absl::StrCat("fork: ", strerror(errno));
    for (int fd : {inherit, p[0], p[1], err_pipe[0], err_pipe[1]}) close(fd);
    return false;
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
  inst->child = child;
  inst->started = std::chrono::steady_clock::now();
  inst->tail = std::make_unique<StderrTail>(err_pipe[0]);
  int exec_errno = 0;
  ssize_t n;
  do {
    n = read(p[0], &exec_errno, sizeof(exec_errno));
  } while (n < 0 && errno == EINTR);
  close(p[0]);
  if (n == sizeof(exec_errno)) {
    waitpid(child, nullptr, 0);
    *error = absl::StrCat("could not start ", o.program[0], ": ", strerror(exec_errno));
    return false;
  }
  return true;
}

// How an instance ended: its name and status; for a daemonizing program, its last process's.
struct Ending {
  std::string why;
  int status = 0;  // the wait status that stands for the whole
};

// Blocking: until the last of the instance's processes has ended, passing stop signals on.
Ending WaitForInstance(const std::string& name, pid_t child) {
  int program_status = 0, last_status = 0;
  pid_t last_pid = child;
  bool program_done = false;
  int reaped = 0;
  while (true) {
    if (const int sig = pending_stop_signal; sig != 0) {
      pending_stop_signal = 0;
      stop_requested = true;
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
  Ending e;
  e.why = absl::StrCat(name, " ", Describe(program_done && reaped == 1 ? program_status : last_status));
  if (reaped > 1) {
    e.why = absl::StrCat(name, " ", Describe(program_status), "; its last process (pid ", last_pid, ") ",
                         Describe(last_status));
  }
  e.status = reaped > 1 ? last_status : program_status;
  return e;
}

// Bounded backoff between restarts: the first at once (a crash costs no more than a start), then
// 100 ms doubling to 5 s while the program keeps dying young.
std::chrono::milliseconds RestartDelay(int young_deaths) {
  if (young_deaths <= 1) return std::chrono::milliseconds(0);
  return std::min(std::chrono::milliseconds(100) * (1 << std::min(young_deaths - 2, 6)),
                  std::chrono::milliseconds(5000));
}

// Blocking; false if a stop signal came first.
bool SleepUnlessStopped(std::chrono::milliseconds d) {
  timespec left{static_cast<time_t>(d.count() / 1000), static_cast<long>(d.count() % 1000) * 1000000};
  while (nanosleep(&left, &left) != 0 && errno == EINTR) {
    if (pending_stop_signal != 0) return false;
  }
  return pending_stop_signal == 0;
}

}  // namespace

int Launch(UniqueFd sock_fd, UniqueFd fuse_fd, UniqueFd relay_state, const LaunchOptions& o) {
  const int sock = sock_fd.get();
  auto fail = [sock](int code, const std::string& why) {
    ReplyToAgent(sock, false, why);
    fprintf(stderr, "fkserve: %s\n", why.c_str());
    return code;
  };
  if (o.program.empty()) return fail(2, "launch: no program given (fkserve launch -- <program> [args])");
  const std::string name = o.program[0];
  PrivateDir dir;
  std::string error;
  if (!MakePrivateDir(o, &dir, &error)) return fail(5, error);
  // Without SA_RESTART: the wait is interrupted, and the launcher passes the signal on. (The
  // program resets them before exec.)
  HandleStopSignals(RecordStopSignal, /*restart=*/false);
  // Orphans the program leaves (a daemonizing program's real server) become our children.
  if (prctl(PR_SET_CHILD_SUBREAPER, 1) != 0) {
    fprintf(stderr, "fkserve: cannot become a child subreaper (%s): a daemonizing program is not followed\n",
            strerror(errno));
  }
  // Relayed (the default), the launcher keeps the kernel's connection and each instance of the
  // program gets a socket of its own; direct, the program gets the connection itself.
  AgentLink* link_for_callbacks = nullptr;
  std::mutex link_mu;
  std::string last_death;  // guarded by link_mu
  std::string killed_because;  // the relay found the instance not answering (guarded by link_mu)
  std::atomic<bool> connection_ended{false};
  std::string adopted;  // relayed, carrying on from a dead launcher: what was restored (else "")
  std::unique_ptr<relay::Relay> relay;
  std::atomic<int> restarts{0};  // instances started after the first
  // A new instance serves: the agent hears it (an Event, and the recovery's metrics).
  auto notice_restart = [&, name](std::chrono::nanoseconds took, uint64_t resent, uint64_t resolved,
                                  uint64_t reopened, uint64_t failures) {
    const int n = restarts.load();
    if (n == 0 && adopted.empty()) return;
    std::lock_guard<std::mutex> lock(link_mu);
    const std::string text = absl::StrCat(
        "relay: ", name, " restarted (", n + (adopted.empty() ? 0 : 1), " restart(s) so far) after ",
        n == 0 ? adopted : absl::StrCat("it ", last_death), "; serving again ",
        std::chrono::duration_cast<std::chrono::milliseconds>(took).count(),
        " ms after its start, with the connection kept: ", resent, " request(s) resent, ", resolved,
        " node(s) looked up again, ", reopened, " handle(s) reopened, ", failures,
        " request(s) that could not be restored so far");
    fprintf(stderr, "fkserve: %s\n", text.c_str());
    if (link_for_callbacks != nullptr) {
      link_for_callbacks->Notice(text, std::chrono::duration_cast<std::chrono::milliseconds>(took).count());
    }
  };
  // The relay's core in the program (relay/in_program.h): the current instance's socket, whether
  // its preload library claimed the kernel's connection, and whether it has served since.
  struct InProgramState {
    std::mutex mu;
    ino_t socket_ino = 0;
    std::chrono::steady_clock::time_point started;
    bool claimed = false;
    bool served = false;
    std::vector<std::thread> readers;  // one per claim: the instance's reports, until it ends
  } ip;
  auto claim = [&, name](int conn, const std::string& inode, const std::string&) {
    std::lock_guard<std::mutex> lock(ip.mu);
    if (relay == nullptr || inode != std::to_string(ip.socket_ino) || ip.claimed) {
      SendWithFd(conn, "refused: not the current instance's connection", -1);
      return;
    }
    UniqueFd pulse;
    if (!relay->HandOver(&pulse)) {
      SendWithFd(conn, "refused: the instance has talked to the relay already", -1);
      return;
    }
    ip.claimed = true;
    SendWithFd(conn, absl::StrCat("ok\n", relay::DurabilityName(relay->durability())), fuse_fd.get());
    SendWithFd(conn, "journal", relay->state_fd());
    SendWithFd(conn, "pulse", pulse.get());
    fprintf(stderr, "fkserve: %s reads the kernel's connection itself, the relay's core in it\n", name.c_str());
    ip.readers.emplace_back([&, report = UniqueFd(fcntl(conn, F_DUPFD_CLOEXEC, 3)), started = ip.started] {
      char buf[4096];
      while (true) {
        const ssize_t n = recv(report.get(), buf, sizeof(buf) - 1, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return;  // the instance has ended
        buf[n] = '\0';
        const absl::string_view text(buf, static_cast<size_t>(n));
        if (absl::StartsWith(text, relay::kLogReport)) {
          fprintf(stderr, "fkserve: (in the program) %s\n", buf + strlen(relay::kLogReport));
          continue;
        }
        unsigned long long resent = 0, resolved = 0, reopened = 0, failures = 0;
        if (!absl::StartsWith(text, relay::kServedReport) ||
            sscanf(buf + strlen(relay::kServedReport), "%llu %llu %llu %llu", &resent, &resolved, &reopened,
                   &failures) != 4) {
          continue;
        }
        {
          std::lock_guard<std::mutex> lock(ip.mu);
          ip.served = true;
        }
        notice_restart(std::chrono::steady_clock::now() - started, resent, resolved, reopened, failures);
      }
    });
  };
  if (o.relay) {
    relay::RelayCallbacks cb;
    cb.log = [](const std::string& line) { fprintf(stderr, "fkserve: %s\n", line.c_str()); };
    cb.connection_ended = [&connection_ended] {
      // The program's socket is closed (it reads end-of-file, as from an unmounted device); one
      // that does not stop by itself is asked to after a grace.
      connection_ended = true;
      std::thread([] {
        std::this_thread::sleep_for(std::chrono::seconds(2));
        for (pid_t pid : Children()) kill(pid, SIGTERM);
      }).detach();
    };
    cb.first_answer = [&notice_restart](std::chrono::nanoseconds took, const relay::RelayStats& st) {
      notice_restart(took, st.resent, st.resolved, st.reopened, st.restore_failures);
    };
    cb.program_unresponsive = [&, name](const std::string& why, bool initialized) {
      // Every process of this instance (the launcher is a subreaper: what it left running too).
      // The next instance is started only once they have all ended, so these are its.
      const std::set<pid_t> processes = Children();
      std::lock_guard<std::mutex> lock(link_mu);
      killed_because = why;
      const std::string text = absl::StrCat("relay: ", name, " ", why, "; killing it (", processes.size(),
                                            " process(es))");
      fprintf(stderr, "fkserve: %s\n", text.c_str());
      for (pid_t pid : processes) kill(pid, SIGKILL);
      // One that had served is restarted: the agent hears why now (an Event). One that never
      // served ends the launcher, whose report says why.
      if (link_for_callbacks != nullptr && initialized) {
        link_for_callbacks->Notice(absl::StrCat(text, ": the relay restarts it and resends what it had not answered"));
      }
    };
    const bool adopting = relay_state.valid();
    // When the program makes a change durable decides what its death may cost (durability.h).
    const relay::Durability durability = ResolveDurability(o);
    fprintf(stderr, "fkserve: %s stores changes at %s%s\n", name.c_str(), relay::DurabilityName(durability),
            o.durability.empty() || o.durability == "auto" ? " (assumed from the program's name)" : "");
    auto r = relay::Relay::Start(fuse_fd.get(), cb, std::move(relay_state), durability);
    if (!r.ok() && adopting) {
      // The state the dead launcher left cannot be carried on from: a fresh connection (the
      // agent mounts one and re-binds every pod target; open files are lost, as with --direct).
      fprintf(stderr, "fkserve: cannot carry on from the previous launcher's relay state (%s); asking for a fresh "
              "connection\n", std::string(r.status().message()).c_str());
      ReplyToAgent(sock, false, absl::StrCat("cannot carry on from the relay state: ", r.status().message()),
                   /*fresh=*/true);
      auto msg = ReceiveHandoffMessage(sock);
      if (!msg.ok()) return fail(4, absl::StrCat("receiving a fresh connection: ", msg.status().message()));
      auto config = DecodeMountConfig(msg->payload);
      if (!config.ok() || config->live || !msg->fd.valid()) {
        return fail(4, "the agent did not send a fresh connection after one was asked for");
      }
      fuse_fd = std::move(msg->fd);
      r = relay::Relay::Start(fuse_fd.get(), cb, UniqueFd(), durability);
    } else if (r.ok() && adopting) {
      adopted = absl::StrCat("the launcher before this one ended, carrying on from its relay state (",
                             (*r)->restored_nodes(), " node(s), ", (*r)->restored_handles(), " open handle(s))");
      fprintf(stderr, "fkserve: %s\n", adopted.c_str());
    }
    if (!r.ok()) {
      return fail(5, absl::StrCat("cannot relay the connection: ", r.status().message()));
    }
    relay = std::move(*r);
    // An instance that never answers FUSE_INIT, or stops answering, is killed
    // (cb.program_unresponsive).
    relay->WatchPrograms({.init_timeout = o.init_timeout, .stall = o.program_stall});
  }
  auto connection_for_instance = [&](UniqueFd* holder) -> int {
    if (!relay) return fuse_fd.get();
    auto theirs = relay->NewInstanceSocket();
    if (!theirs.ok()) return -1;
    *holder = std::move(*theirs);
    struct stat st{};
    fstat(holder->get(), &st);
    std::lock_guard<std::mutex> lock(ip.mu);
    ip.socket_ino = st.st_ino;
    ip.started = std::chrono::steady_clock::now();
    ip.claimed = ip.served = false;
    return holder->get();
  };
  FusermountService::ClaimHandler claim_handler = nullptr;
  if (relay && o.in_program) claim_handler = claim;
  Instance inst;
  {
    UniqueFd theirs;
    const int conn = connection_for_instance(&theirs);
    if (conn < 0) return fail(5, "the relay could not make a socket for the program");
    if (!Spawn(o, dir, conn, relay != nullptr, &inst, &error, claim_handler)) {
      return fail(absl::StartsWith(error, "could not start") ? 127 : 5, error);
    }
  }
  ReplyToAgent(sock, true, "", false, "", /*relayed=*/relay != nullptr, relay ? relay->state_fd() : -1);
  if (o.mark_ready) o.mark_ready(true);
  // The connection stays open while the program serves (and is re-deposited with a restarted
  // agent); its end is reported to the agent. A launched program's FUSE_INIT is its own, so
  // there is none to re-deposit: its successors get a fresh connection.
  UniqueFd keep(fcntl(fuse_fd.get(), F_DUPFD_CLOEXEC, 3));
  if (!relay) fuse_fd.Reset();
  AgentLink link(std::move(sock_fd), std::move(keep), "", o.socket_path, o.agent_uid);
  link.set_relayed(relay != nullptr);
  link.set_drain_ms(o.drain_ms);  // after HandleStopSignals above: the gate holds the SIGTERM instead
  if (relay) link.set_relay_state(UniqueFd(fcntl(relay->state_fd(), F_DUPFD_CLOEXEC, 3)));
  link.Start();
  {
    std::lock_guard<std::mutex> lock(link_mu);
    link_for_callbacks = &link;
  }
  // What fkserve's fusermount refused or did not apply reaches the volume's Events now.
  auto watch_problems = [&link, name](FusermountService* service) {
    service->OnProblem([&link, name](const std::string& p) { link.Notice(absl::StrCat(name, ": fusermount ", p)); });
  };
  watch_problems(inst.service.get());
  int young_deaths = 0, silent_deaths = 0;
  Ending end;
  bool running = true;  // an instance runs (a restart that could not start the program leaves none)
  while (true) {
    if (running) {
      end = WaitForInstance(name, inst.child);
      inst.service->OnProblem(nullptr);
    }
    // Killed for not answering: said so, rather than only the signal.
    std::string killed;
    {
      std::lock_guard<std::mutex> lock(link_mu);
      killed.swap(killed_because);
    }
    if (!killed.empty()) end.why = absl::StrCat(name, " ", killed, "; fkserve killed it (", end.why, ")");
    // An instance that served with the relay's core in it: the relay carries on from what that
    // core journaled, as after a launcher's death.
    bool in_program = false, in_program_served = false;
    // Every process of the instance has ended, so its report socket ends: what it said is all
    // read once its reader is done (a "served" still on its way would count it as silent).
    for (std::thread& t : ip.readers) t.join();
    ip.readers.clear();
    {
      std::lock_guard<std::mutex> lock(ip.mu);
      in_program = ip.claimed;
      in_program_served = ip.served;
      ip.claimed = ip.served = false;
    }
    if (relay && in_program) {
      if (absl::Status taken = relay->TakeBack(); !taken.ok()) {
        // The connection ended (unmounted), which is why the program stopped.
        if (absl::IsUnavailable(taken)) {
          connection_ended = true;
        } else {
          end.why = absl::StrCat(end.why, "; the relay cannot carry on from its state: ", taken.message());
          break;
        }
      }
    }
    if (!relay || stop_requested || connection_ended || pending_stop_signal != 0) break;
    // A program that never served (wrong arguments, a bucket it cannot reach) is not restarted:
    // its end is reported at once, as for a direct one.
    const relay::RelayStats st = relay->Snapshot();
    if (!st.served) break;
    // Relayed: the kernel's connection is kept, requests wait, and the program starts again. One
    // that keeps dying young is restarted after a growing delay; one that keeps dying before it
    // answers anything is given up on (a request that kills every instance it reaches is the
    // relay's to refuse, after three).
    if (std::chrono::steady_clock::now() - inst.started >= o.stable_after) young_deaths = 0;
    ++young_deaths;
    const bool answered = in_program ? in_program_served : st.program_answers_since_start > 0;
    silent_deaths = answered ? 0 : silent_deaths + 1;
    if (silent_deaths > o.max_restarts) {
      end.why = absl::StrCat(end.why, "; gave up after ", o.max_restarts,
                             " restarts in a row that each died before answering a request");
      break;
    }
    const auto delay = RestartDelay(young_deaths);
    const std::string last = running ? inst.tail->Last() : "";
    {
      std::lock_guard<std::mutex> lock(link_mu);
      const std::string how = killed.empty() ? Describe(end.status) : absl::StrCat(killed, ", so fkserve killed it");
      last_death = last.empty() ? how : absl::StrCat(how, " (its last words: ", last, ")");
    }
    fprintf(stderr, "fkserve: %s; the relay keeps the connection: restarting it%s\n", end.why.c_str(),
            delay.count() > 0 ? absl::StrCat(" in ", delay.count(), " ms").c_str() : "");
    if (delay.count() > 0 && !SleepUnlessStopped(delay)) break;
    Instance next;
    UniqueFd theirs;
    ++restarts;
    const int conn = connection_for_instance(&theirs);
    if (conn < 0 || !Spawn(o, dir, conn, relay != nullptr, &next, &error, claim_handler)) {
      // No instance to wait for: this attempt is the next death (young, and silent).
      end.why = absl::StrCat("restarting ", name, ": ", conn < 0 ? "the relay could not make a socket" : error);
      end.status = 127 << 8;  // as a wait status: exited 127, could not be started
      fprintf(stderr, "fkserve: %s\n", end.why.c_str());
      inst.started = std::chrono::steady_clock::now();
      running = false;
      continue;
    }
    running = true;
    inst = std::move(next);
    watch_problems(inst.service.get());
  }
  if (o.mark_ready) o.mark_ready(false);
  std::string why = end.why;
  const std::vector<std::string> problems = inst.service->problems();
  if (!problems.empty()) absl::StrAppend(&why, " [fusermount: ", absl::StrJoin(problems, "; "), "]");
  if (const std::string last = running ? inst.tail->Last() : ""; !last.empty()) {
    absl::StrAppend(&why, "; its last words: ", last);
  }
  {
    std::lock_guard<std::mutex> lock(link_mu);
    link_for_callbacks = nullptr;
  }
  if (relay) relay->Stop();
  for (std::thread& t : ip.readers) t.join();  // every process of the program has ended
  link.Report(false, why);
  fprintf(stderr, "fkserve: %s\n", why.c_str());
  // Relayed, the program cannot tell an unmount from its connection closing: the volume was
  // served until it was unmounted, which is fkserve's 0.
  if (connection_ended) return 0;
  const int final_status = end.status;
  return WIFEXITED(final_status) ? WEXITSTATUS(final_status) : 128 + WTERMSIG(final_status);
}

}  // namespace fusekeeper
