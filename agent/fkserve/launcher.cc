#include "agent/fkserve/launcher.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "agent/fkserve/program_work.h"
#include "agent/fkserve/agent_link.h"
#include "agent/fkserve/fusermount_protocol.h"
#include "agent/fkserve/program_instance.h"
#include "agent/fkserve/relay/in_program.h"
#include "agent/fkserve/relay/relay.h"
#include "agent/fkserve/stop_signals.h"
#include "agent/fuse/handoff_protocol.h"
#include "agent/loop/loop.h"
#include "agent/loop/signals.h"
#include "agent/loop/timer.h"

namespace fusekeeper {

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

// Bounded backoff between restarts: the first at once (a crash costs no more than a start), then
// 100 ms doubling to 5 s while the program keeps dying young.
std::chrono::milliseconds RestartDelay(int young_deaths) {
  if (young_deaths <= 1) return std::chrono::milliseconds(0);
  return std::min(std::chrono::milliseconds(100) * (1 << std::min(young_deaths - 2, 6)),
                  std::chrono::milliseconds(5000));
}

// The launcher on its loop: every event (a signal, a process's end, the program's stderr, a
// claim, the agent's connection, the relay's) is a method here, on one thread.
class Launcher {
 public:
  Launcher(Loop& loop, const LaunchOptions& o, UniqueFd sock, UniqueFd fuse_fd)
      : loop_(loop),
        o_(o),
        name_(o.program[0]),
        sock_(std::move(sock)),
        fuse_fd_(std::move(fuse_fd)),
        restart_timer_(loop),
        grace_timer_(loop),
        work_timer_(loop) {}

  // Sets up the relay (carrying on from `relay_state` if valid) and the first instance; then the
  // loop runs until the launcher is done. Returns fkserve's exit status.
  int Run(UniqueFd relay_state);
  // After Run: the kernel's connection ended under the program (not a stop that ended it).
  bool connection_ended() const { return connection_ended_ && !stop_requested_; }

 private:
  int Fail(int code, const std::string& why) {
    ReplyToAgent(sock_.get(), false, why);
    fprintf(stderr, "fkserve: %s\n", why.c_str());
    return code;
  }
  absl::Status StartRelay(UniqueFd relay_state);
  relay::RelayCallbacks RelayCallbacks();
  // The socket (or, direct, the connection) for the next instance; -1 if the relay has none.
  int ConnectionForInstance();
  bool Spawn(std::string* error);
  void OnExec(const std::string& error);
  void OnSignal(int sig);
  // Passes a stop signal on to every process of the program; with none running, ends now.
  void Stop(int sig);
  void OnClaim(int conn, const std::string& inode);
  void OnReport(const std::string& text, std::chrono::steady_clock::time_point started);
  void NoticeRestart(std::chrono::nanoseconds took, uint64_t resent, uint64_t resolved, uint64_t reopened,
                     uint64_t failures);
  void OnProgramUnresponsive(const std::string& why, bool initialized);
  // Every `tick`: whether the program's processes did work since the last look (program_work.h),
  // for the relay's stall watch (RelayCallbacks::last_work).
  void WatchWork(std::chrono::milliseconds tick);
  // A look now: the relay asks before it calls a program hung, so that a loop that woke late
  // (a loaded node) decides on what the program did meanwhile, whichever timer fires first.
  void SampleWorkNow();
  // The instance has ended (or could not start): restart it, or end.
  void InstanceEnded();
  void Restart();
  // Ends the launcher with `why` as its report (after the loop has returned).
  void Finish();

  Loop& loop_;
  const LaunchOptions& o_;
  const std::string name_;
  UniqueFd sock_;  // the handoff connection, until the link takes it
  UniqueFd fuse_fd_;
  PrivateDir dir_;
  std::unique_ptr<relay::Relay> relay_;
  std::unique_ptr<AgentLink> link_;
  std::unique_ptr<SignalWatcher> signals_;
  std::unique_ptr<ProgramInstance> inst_;  // none while a restart waits, or could not start
  UniqueFd instance_socket_;               // relayed: the current instance's end (until it starts)
  std::string adopted_;  // relayed, carrying on from a dead launcher: what was restored (else "")
  std::string last_death_, killed_because_;
  bool stop_requested_ = false, connection_ended_ = false, finished_ = false;
  int restarts_ = 0, young_deaths_ = 0, silent_deaths_ = 0;
  std::chrono::steady_clock::time_point last_start_;
  Timer restart_timer_, grace_timer_, work_timer_;
  WorkSample work_;
  std::chrono::steady_clock::time_point work_at_, last_work_;
  // How the last instance ended (or why a restart could not start one).
  std::string end_why_;
  int end_status_ = 0;
  // The relay's core in the program (relay/in_program.h): the current instance's socket, whether
  // its preload library claimed the kernel's connection, and whether it has served since.
  ino_t socket_ino_ = 0;
  bool claimed_ = false, served_ = false;
  int exit_code_ = 0;
  std::string final_why_;
};

absl::Status Launcher::StartRelay(UniqueFd relay_state) {
  const bool adopting = relay_state.valid();
  // When the program makes a change durable decides what its death may cost (durability.h).
  const relay::Durability durability = ResolveDurability(o_);
  fprintf(stderr, "fkserve: %s stores changes at %s%s\n", name_.c_str(), relay::DurabilityName(durability),
          o_.durability.empty() || o_.durability == "auto" ? " (assumed from the program's name)" : "");
  auto r = relay::Relay::Start(fuse_fd_.get(), RelayCallbacks(), std::move(relay_state), durability, &loop_);
  if (!r.ok() && adopting) {
    // The state the dead launcher left cannot be carried on from: a fresh connection (the
    // agent mounts one and re-binds every pod target; open files are lost, as with --direct).
    fprintf(stderr, "fkserve: cannot carry on from the previous launcher's relay state (%s); asking for a fresh "
            "connection\n", std::string(r.status().message()).c_str());
    ReplyToAgent(sock_.get(), false, absl::StrCat("cannot carry on from the relay state: ", r.status().message()),
                 /*fresh=*/true);
    auto msg = ReceiveHandoffMessage(sock_.get());
    if (!msg.ok()) return absl::UnavailableError(absl::StrCat("receiving a fresh connection: ", msg.status().message()));
    auto config = DecodeMountConfig(msg->payload);
    if (!config.ok() || config->live || !msg->fd.valid()) {
      return absl::UnavailableError("the agent did not send a fresh connection after one was asked for");
    }
    fuse_fd_ = std::move(msg->fd);
    r = relay::Relay::Start(fuse_fd_.get(), RelayCallbacks(), UniqueFd(), durability, &loop_);
  } else if (r.ok() && adopting) {
    adopted_ = absl::StrCat("the launcher before this one ended, carrying on from its relay state (",
                            (*r)->restored_nodes(), " node(s), ", (*r)->restored_handles(), " open handle(s))");
    fprintf(stderr, "fkserve: %s\n", adopted_.c_str());
  }
  if (!r.ok()) return absl::InternalError(absl::StrCat("cannot relay the connection: ", r.status().message()));
  relay_ = std::move(*r);
  // An instance that never answers FUSE_INIT, or stops answering, is killed
  // (OnProgramUnresponsive).
  relay_->WatchPrograms({.init_timeout = o_.init_timeout, .stall = o_.program_stall});
  if (o_.program_stall.count() > 0) {
    work_at_ = last_work_ = std::chrono::steady_clock::now();
    WatchWork(std::clamp(o_.program_stall / 8, std::chrono::milliseconds(10), std::chrono::milliseconds(1000)));
  }
  return absl::OkStatus();
}

relay::RelayCallbacks Launcher::RelayCallbacks() {
  relay::RelayCallbacks cb;
  cb.log = [](const std::string& line) { fprintf(stderr, "fkserve: %s\n", line.c_str()); };
  cb.connection_ended = [this] {
    // The program's socket is closed (it reads end-of-file, as from an unmounted device); one
    // that does not stop by itself is asked to after a grace.
    connection_ended_ = true;
    if (grace_timer_.armed()) return;
    grace_timer_.Arm(std::chrono::seconds(2), [] {
      for (pid_t pid : Children()) kill(pid, SIGTERM);
    });
  };
  cb.first_answer = [this](std::chrono::nanoseconds took, const relay::RelayStats& st) {
    NoticeRestart(took, st.resent, st.resolved, st.reopened, st.restore_failures);
  };
  cb.program_unresponsive = [this](const std::string& why, bool initialized) { OnProgramUnresponsive(why, initialized); };
  cb.last_work = [this] {
    SampleWorkNow();
    return last_work_;
  };
  return cb;
}

int Launcher::Run(UniqueFd relay_state) {
  std::string error;
  if (!MakePrivateDir(o_, &dir_, &error)) return Fail(5, error);
  // Orphans the program leaves (a daemonizing program's real server) become our children.
  if (prctl(PR_SET_CHILD_SUBREAPER, 1) != 0) {
    fprintf(stderr, "fkserve: cannot become a child subreaper (%s): a daemonizing program is not followed\n",
            strerror(errno));
  }
  auto watcher = SignalWatcher::Create(loop_, {SIGCHLD, SIGTERM, SIGINT, SIGHUP}, [this](int sig) { OnSignal(sig); });
  if (!watcher.ok()) return Fail(5, std::string(watcher.status().message()));
  signals_ = std::move(*watcher);
  // Relayed (the default), the launcher keeps the kernel's connection and each instance of the
  // program gets a socket of its own; direct, the program gets the connection itself.
  if (o_.relay) {
    if (absl::Status s = StartRelay(std::move(relay_state)); !s.ok()) {
      return Fail(absl::IsUnavailable(s) ? 4 : 5, std::string(s.message()));
    }
  }
  if (!Spawn(&error)) return Fail(5, error.empty() ? "the relay could not make a socket for the program" : error);
  loop_.Run();
  // Every callback of the loop has run: nothing is in flight.
  if (relay_) relay_->Stop();
  if (o_.mark_ready && link_) o_.mark_ready(false);
  if (link_) {
    link_->Report(false, final_why_);
    fprintf(stderr, "fkserve: %s\n", final_why_.c_str());
  }
  return exit_code_;
}

int Launcher::ConnectionForInstance() {
  if (!relay_) return fuse_fd_.get();
  auto theirs = relay_->NewInstanceSocket();
  if (!theirs.ok()) return -1;
  instance_socket_ = std::move(*theirs);
  struct stat st{};
  fstat(instance_socket_.get(), &st);
  socket_ino_ = st.st_ino;
  claimed_ = served_ = false;
  return instance_socket_.get();
}

bool Launcher::Spawn(std::string* error) {
  error->clear();
  const int conn = ConnectionForInstance();
  if (conn < 0) return false;
  ProgramInstance::Spec spec;
  spec.options = &o_;
  spec.dir = &dir_;
  spec.conn = conn;
  spec.relayed = relay_ != nullptr;
  if (relay_ && o_.in_program) {
    spec.claim = [this](int c, const std::string& inode, const std::string&) { OnClaim(c, inode); };
  }
  // What fkserve's fusermount refused or did not apply reaches the volume's Events now.
  spec.on_problem = [this](const std::string& p) {
    if (link_) link_->Notice(absl::StrCat(name_, ": fusermount ", p));
  };
  spec.on_exec = [this](const std::string& e) { OnExec(e); };
  spec.on_end = [this] { loop_.Post([this] { InstanceEnded(); }); };
  last_start_ = std::chrono::steady_clock::now();
  inst_ = ProgramInstance::Start(loop_, std::move(spec), error);
  instance_socket_.Reset();  // the program has its own copy
  return inst_ != nullptr;
}

void Launcher::OnExec(const std::string& error) {
  if (link_ || finished_) return;  // a restart: its end says how it went
  // The first instance: the agent hears whether serving has begun.
  if (!error.empty()) {
    exit_code_ = Fail(127, error);
    finished_ = true;
    loop_.Stop();
    return;
  }
  ReplyToAgent(sock_.get(), true, "", false, "", /*relayed=*/relay_ != nullptr, relay_ ? relay_->state_fd() : -1);
  if (o_.mark_ready) o_.mark_ready(true);
  // The connection stays open while the program serves (and is re-deposited with a restarted
  // agent); its end is reported to the agent. A launched program's FUSE_INIT is its own, so
  // there is none to re-deposit: its successors get a fresh connection.
  UniqueFd keep(fcntl(fuse_fd_.get(), F_DUPFD_CLOEXEC, 3));
  if (!relay_) fuse_fd_.Reset();
  link_ = std::make_unique<AgentLink>(loop_, std::move(sock_), std::move(keep), "", o_.socket_path, o_.agent_uid);
  link_->set_relayed(relay_ != nullptr);
  link_->set_drain_ms(o_.drain_ms);
  link_->set_on_stop([this](const std::string&) { Stop(SIGTERM); });
  if (relay_) link_->set_relay_state(UniqueFd(fcntl(relay_->state_fd(), F_DUPFD_CLOEXEC, 3)));
  link_->Start();
}

void Launcher::OnSignal(int sig) {
  if (sig == SIGCHLD) {
    if (inst_) inst_->Reap();
    else while (waitpid(-1, nullptr, WNOHANG) > 0) {}
    return;
  }
  // A server pod's launcher drains first: the link calls Stop when the successor waits.
  if (sig == SIGTERM && link_ && link_->HoldStop()) return;
  Stop(sig);
}

void Launcher::Stop(int sig) {
  // A stop signal passed on to the program: its end is not a crash to restart from.
  stop_requested_ = true;
  if (inst_) {
    for (pid_t pid : Children()) kill(pid, sig);
    return;
  }
  // Between instances (a restart waits): nothing to stop but the launcher.
  restart_timer_.Cancel();
  Finish();
}

void Launcher::OnClaim(int conn, const std::string& inode) {
  if (relay_ == nullptr || inst_ == nullptr || inode != std::to_string(socket_ino_) || claimed_) {
    SendWithFd(conn, "refused: not the current instance's connection", -1);
    return;
  }
  UniqueFd pulse;
  if (!relay_->HandOver(&pulse)) {
    SendWithFd(conn, "refused: the instance has talked to the relay already", -1);
    return;
  }
  claimed_ = true;
  SendWithFd(conn, absl::StrCat("ok\n", relay::DurabilityName(relay_->durability())), fuse_fd_.get());
  SendWithFd(conn, "journal", relay_->state_fd());
  SendWithFd(conn, "pulse", pulse.get());
  fprintf(stderr, "fkserve: %s reads the kernel's connection itself, the relay's core in it\n", name_.c_str());
  inst_->AddReports(UniqueFd(fcntl(conn, F_DUPFD_CLOEXEC, 3)),
                    [this, started = inst_->started()](const std::string& text) { OnReport(text, started); });
}

void Launcher::OnReport(const std::string& text, std::chrono::steady_clock::time_point started) {
  if (absl::StartsWith(text, relay::kLogReport)) {
    fprintf(stderr, "fkserve: (in the program) %s\n", text.c_str() + strlen(relay::kLogReport));
    return;
  }
  unsigned long long resent = 0, resolved = 0, reopened = 0, failures = 0;
  if (!absl::StartsWith(text, relay::kServedReport) ||
      sscanf(text.c_str() + strlen(relay::kServedReport), "%llu %llu %llu %llu", &resent, &resolved, &reopened,
             &failures) != 4) {
    return;
  }
  served_ = true;
  NoticeRestart(std::chrono::steady_clock::now() - started, resent, resolved, reopened, failures);
}

// A new instance serves: the agent hears it (an Event, and the recovery's metrics).
void Launcher::NoticeRestart(std::chrono::nanoseconds took, uint64_t resent, uint64_t resolved, uint64_t reopened,
                             uint64_t failures) {
  if (restarts_ == 0 && adopted_.empty()) return;
  const std::string text = absl::StrCat(
      "relay: ", name_, " restarted (", restarts_ + (adopted_.empty() ? 0 : 1), " restart(s) so far) after ",
      restarts_ == 0 ? adopted_ : absl::StrCat("it ", last_death_), "; serving again ",
      std::chrono::duration_cast<std::chrono::milliseconds>(took).count(),
      " ms after its start, with the connection kept: ", resent, " request(s) resent, ", resolved,
      " node(s) looked up again, ", reopened, " handle(s) reopened, ", failures,
      " request(s) that could not be restored so far");
  fprintf(stderr, "fkserve: %s\n", text.c_str());
  if (link_) link_->Notice(text, std::chrono::duration_cast<std::chrono::milliseconds>(took).count());
}

void Launcher::OnProgramUnresponsive(const std::string& why, bool initialized) {
  // Every process of this instance (the launcher is a subreaper: what it left running too).
  // The next instance is started only once they have all ended, so these are its.
  const std::set<pid_t> processes = Children();
  killed_because_ = why;
  const std::string text =
      absl::StrCat("relay: ", name_, " ", why, "; killing it (", processes.size(), " process(es))");
  fprintf(stderr, "fkserve: %s\n", text.c_str());
  for (pid_t pid : processes) kill(pid, SIGKILL);
  // One that had served is restarted: the agent hears why now (an Event). One that never served
  // ends the launcher, whose report says why.
  if (link_ && initialized) {
    link_->Notice(absl::StrCat(text, ": the relay restarts it and resends what it had not answered"));
  }
}

void Launcher::WatchWork(std::chrono::milliseconds tick) {
  SampleWorkNow();
  work_timer_.Arm(tick, [this, tick] { WatchWork(tick); });
}

void Launcher::SampleWorkNow() {
  const auto now = std::chrono::steady_clock::now();
  const WorkSample sample = SampleWork(Children());
  if (Progressed(work_, sample, now - work_at_)) last_work_ = now;
  work_ = sample;
  work_at_ = now;
}

void Launcher::InstanceEnded() {
  if (finished_) return;
  std::string last_words;
  if (inst_) {
    inst_->StopProblems();
    if (inst_->exec_failed()) {
      // No instance ran: this attempt is the next death (young, and silent).
      end_why_ = absl::StrCat("restarting ", name_, ": ", inst_->exec_error());
      end_status_ = 127 << 8;  // as a wait status: exited 127, could not be started
      fprintf(stderr, "fkserve: %s\n", end_why_.c_str());
    } else {
      end_why_ = inst_->why();
      end_status_ = inst_->status();
      last_words = inst_->LastWords();
    }
  }
  // Killed for not answering: said so, rather than only the signal.
  std::string killed;
  killed.swap(killed_because_);
  if (!killed.empty()) end_why_ = absl::StrCat(name_, " ", killed, "; fkserve killed it (", end_why_, ")");
  // An instance that served with the relay's core in it: the relay carries on from what that
  // core journaled, as after a launcher's death.
  const bool in_program = claimed_, in_program_served = served_;
  claimed_ = served_ = false;
  if (relay_ && in_program) {
    if (absl::Status taken = relay_->TakeBack(); !taken.ok()) {
      // The connection ended (unmounted), which is why the program stopped.
      if (absl::IsUnavailable(taken)) {
        connection_ended_ = true;
      } else {
        end_why_ = absl::StrCat(end_why_, "; the relay cannot carry on from its state: ", taken.message());
        return Finish();
      }
    }
  }
  // Direct, the program read the kernel's connection itself: whether that ended under it
  // (unmounted, aborted) shows on the link's dup of it.
  if (!relay_ && link_ && !ConnectionAlive(link_->fuse_fd())) connection_ended_ = true;
  if (!relay_ || stop_requested_ || connection_ended_) return Finish();
  // A program that never served (wrong arguments, a bucket it cannot reach) is not restarted:
  // its end is reported at once, as for a direct one.
  const relay::RelayStats st = relay_->Snapshot();
  if (!st.served) return Finish();
  // Relayed: the kernel's connection is kept, requests wait, and the program starts again. One
  // that keeps dying young is restarted after a growing delay; one that keeps dying before it
  // answers anything is given up on (a request that kills every instance it reaches is the
  // relay's to refuse, after three).
  if (std::chrono::steady_clock::now() - last_start_ >= o_.stable_after) young_deaths_ = 0;
  ++young_deaths_;
  const bool answered = in_program ? in_program_served : st.program_answers_since_start > 0;
  silent_deaths_ = answered ? 0 : silent_deaths_ + 1;
  if (silent_deaths_ > o_.max_restarts) {
    end_why_ = absl::StrCat(end_why_, "; gave up after ", o_.max_restarts,
                            " restarts in a row that each died before answering a request");
    return Finish();
  }
  const auto delay = RestartDelay(young_deaths_);
  const std::string how =
      killed.empty() ? Describe(end_status_) : absl::StrCat(killed, ", so fkserve killed it");
  last_death_ = last_words.empty() ? how : absl::StrCat(how, " (its last words: ", last_words, ")");
  fprintf(stderr, "fkserve: %s; the relay keeps the connection: restarting it%s\n", end_why_.c_str(),
          delay.count() > 0 ? absl::StrCat(" in ", delay.count(), " ms").c_str() : "");
  if (delay.count() == 0) return Restart();
  inst_.reset();
  restart_timer_.Arm(delay, [this] { Restart(); });
}

void Launcher::Restart() {
  ++restarts_;
  inst_.reset();
  std::string error;
  if (!Spawn(&error)) {
    // No instance to wait for: this attempt is the next death (young, and silent).
    end_why_ = absl::StrCat("restarting ", name_, ": ",
                            error.empty() ? "the relay could not make a socket" : error);
    end_status_ = 127 << 8;
    fprintf(stderr, "fkserve: %s\n", end_why_.c_str());
    last_start_ = std::chrono::steady_clock::now();
    loop_.Post([this] { InstanceEnded(); });
  }
}

void Launcher::Finish() {
  if (finished_) return;
  finished_ = true;
  std::string why = end_why_;
  if (inst_) {
    const std::vector<std::string>& problems = inst_->problems();
    if (!problems.empty()) absl::StrAppend(&why, " [fusermount: ", absl::StrJoin(problems, "; "), "]");
    if (const std::string last = inst_->exec_failed() ? "" : inst_->LastWords(); !last.empty()) {
      absl::StrAppend(&why, "; its last words: ", last);
    }
  }
  final_why_ = why;
  // Relayed, the program cannot tell an unmount from its connection closing: the volume was
  // served until it was unmounted, which is fkserve's 0.
  exit_code_ = connection_ended_ ? 0
               : WIFEXITED(end_status_) ? WEXITSTATUS(end_status_)
                                        : 128 + WTERMSIG(end_status_);
  loop_.Stop();
}

}  // namespace

Served Launch(UniqueFd sock, UniqueFd fuse_fd, UniqueFd relay_state, const LaunchOptions& o) {
  if (o.program.empty()) {
    ReplyToAgent(sock.get(), false, "launch: no program given (fkserve launch -- <program> [args])");
    fprintf(stderr, "fkserve: launch: no program given (fkserve launch -- <program> [args])\n");
    return {2};
  }
  // Signals come from a signalfd on the loop: blocked before any thread starts (the relay's
  // notifier), so that none takes them the classic way. The program gets a clean mask.
  BlockSignals({SIGCHLD, SIGTERM, SIGINT, SIGHUP});
  // epoll, never the ring: a ring's polls would hold the agent's socket (and the program's) open
  // after a kill -9 until the kernel's teardown of the ring, so the agent would learn late that
  // this launcher is gone, and refuse its successor meanwhile. Nothing here needs the ring: the
  // hop measured the same with epoll (README), and io_uring is refused in most containers.
  auto loop = Loop::Create({.epoll_only = "fkserve's loop, so that a killed launcher's sockets close at once"});
  if (!loop.ok()) {
    ReplyToAgent(sock.get(), false, absl::StrCat("cannot make an event loop: ", loop.status().message()));
    return {5};
  }
  Launcher launcher(**loop, o, std::move(sock), std::move(fuse_fd));
  const int code = launcher.Run(std::move(relay_state));
  return {code, launcher.connection_ended()};
}

}  // namespace fusekeeper
