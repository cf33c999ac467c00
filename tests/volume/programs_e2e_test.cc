// Other people's FUSE programs, unmodified (issue 19), served on the agent's connection through
// `fkserve launch` and its fusermount: each is given an ordinary directory ({mountpoint}) and
// mounts it the normal way. For each, from a container-like pod view made before anything goes
// wrong: the file it serves reads; a write goes through where the program is writable; kill -9 of
// the program (all its processes: daemonizing ones leave their server behind) costs the pod no
// failed read (issue 20: the launcher relays the connection and starts the program again);
// unpublish leaves nothing mounted and no process.
// The Debian packages come from scripts/setup.sh; a program that is not installed is skipped
// with the reason printed.
#include <dirent.h>

#include <cstdlib>
#include <functional>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "tests/volume/fuse_fixture.h"
#include "tests/volume/pod_workload.h"
#include "tests/volume/programs_fixture.h"

namespace fusekeeper {
namespace {

TEST_P(ProgramsE2ETest, ServesAPodViewIsRecoveredAfterKillAndLeavesNothing) {
  const Program& prog = GetParam();
  std::vector<std::string> launch;
  const std::string skip = Prepare(prog, &launch);
  if (!skip.empty()) GTEST_SKIP() << skip;
  if (HasFatalFailure()) return;
  const std::string w = root_.path() + "/work";
  const std::string want = std::string("hello from ") + prog.name + "\n";
  StartAgent();
  const std::string target = Pod("pod-p", "prog");
  ASSERT_RPC_OK(PublishInline("prog", "pod-p", target));
  const std::string socket = PodSocket("pod-p");
  Subprocess* launcher = StartServer(socket, launch);
  if (prog.starts_empty) {
    ASSERT_EQ(WriteAsServerUid(target + "/hello.txt", want), want) << launcher->Stderr() << agent_->Stderr();
  }
  // An app in a pod: it opens and reads the file every 20 ms, from its container's view.
  const std::string view_dir = root_.path() + "/views/program";
  fs::create_directories(view_dir);
  auto view = Reader::InPod(target, "hello.txt", view_dir, /*pace_ms=*/20);
  ASSERT_TRUE(view->WaitForReadsOf(want)) << prog.name << ": " << view->setup_error() << " last '" << view->last()
                                          << "'\n" << launcher->Stderr() << agent_->Stderr();
  if (prog.notice[0] != '\0') ASSERT_TRUE(WaitForAgentLog(prog.notice)) << agent_->Stderr();
  if (prog.writable) {
    const std::string wrote = WriteAsServerUid(target + "/written.txt", "written through the volume\n");
    EXPECT_EQ(wrote, "written through the volume\n") << launcher->Stderr();
  }
  // kill -9 of every process of the program (a daemonized one runs on without its parent): the
  // launcher keeps the kernel's connection (relayed, its default) and starts the program again;
  // the app in the pod sees slower reads, never a failed one.
  view->Mark(want);
  ASSERT_TRUE(KillProgramAndWaitForRestart(launcher, 1)) << prog.name << ": " << launcher->Stderr();
  ASSERT_TRUE(view->WaitForReadsOf(want)) << prog.name << " after kill -9: last '" << view->last() << "' errors "
                                          << view->errors() << "\n" << launcher->Stderr() << agent_->Stderr();
  EXPECT_EQ(view->errors_after_mark(), 0) << prog.name << ": the pod saw errors across the restart\n"
                                          << launcher->Stderr();
  EXPECT_FALSE(launcher->Wait(std::chrono::milliseconds(1)).has_value()) << "the launcher lives on";
  // The figures for the README's table: the relay's own account of the restart.
  const std::string log = launcher->Stderr();
  const size_t at = log.find("serving again ");
  std::cout << "RESULT " << prog.name << ": " << view->errors_after_mark() << " failed reads (one every 20 ms) across "
            << "kill -9; " << (at == std::string::npos ? "?" : log.substr(at, log.find(" after its start", at) - at))
            << " after the restart\n";
  view->Stop();
  {
    grpc::Status s = Unpublish("prog", target);
    ASSERT_TRUE(s.ok()) << s.error_code() << " " << s.error_message() << "\n" << agent_->Stderr();
  }
  EXPECT_EQ(MountCountAt(target), 0);
  ASSERT_TRUE(launcher->Wait(std::chrono::milliseconds(20000)).has_value()) << "the program ends with its volume\n"
                                                                            << launcher->Stderr();
}

INSTANTIATE_TEST_SUITE_P(Programs, ProgramsE2ETest, ::testing::ValuesIn(kPrograms), ProgramName);

// Issue 20's bar: an app in a pod holding files open on the volume (pod_workload.h: a sequential
// reader, an mmap, a listing in progress, its cwd inside, an O_APPEND log and a rewritten block,
// each fsynced) while the program is killed (kill -9 of every process) again and again: no
// operation fails, and what was written reads back byte for byte. FUSEKEEPER_RELAY_KILLS kills
// (default 20; the README's figures are from 100).
class RelayWorkloadTest : public ProgramsE2ETest {
 protected:
  // Prepare, with the workload's files in the program's source (a program that starts empty gets
  // them through the volume, in StartWorkload).
  std::string PrepareWorkload(const Program& prog, std::vector<std::string>* launch) {
    return Prepare(prog, launch, [&](const std::string& src) {
      if (!prog.starts_empty) PodWorkload::CreateFiles(src);
    });
  }
  // The agent, the volume published for `pod`, its launcher, and the app working on it from a pod
  // view (its first steps done). Callers check HasFatalFailure().
  void StartWorkload(const Program& prog, const std::vector<std::string>& launch, const std::string& pod) {
    StartAgent();
    target_ = Pod(pod, "prog");
    ASSERT_RPC_OK(PublishInline("prog", pod, target_));
    launcher_ = StartServer(PodSocket(pod), launch);
    if (prog.starts_empty) {
      Subprocess maker({"/bin/true"}, {}, [&] {
        if (setresgid(kServerUid, kServerUid, kServerUid) != 0 || setresuid(kServerUid, kServerUid, kServerUid) != 0) {
          _exit(99);
        }
        PodWorkload::CreateFiles(target_);
      });
      ASSERT_EQ(maker.Wait(std::chrono::milliseconds(60000)).value_or(-1), 0) << launcher_->Stderr();
    }
    const std::string view_dir = root_.path() + "/views/" + pod;
    fs::create_directories(view_dir);
    // rclone streams a file open for writing to a partial object that exists only once closed: a
    // file held open for writing cannot outlive the rclone that had it (rclone's semantics, in the
    // README's limits); its workload only reads.
    const bool writes = prog.writable && std::string(prog.name) != "rclone-mount2";
    app_ = std::make_unique<PodWorkload>(target_, view_dir, writes, kServerUid);
    ASSERT_TRUE(app_->WaitForSteps(3)) << prog.name << ": " << absl::StrJoin(app_->errors(), "; ") << "\n"
                                       << launcher_->Stderr();
  }

  std::string target_;
  Subprocess* launcher_ = nullptr;
  std::unique_ptr<PodWorkload> app_;
};

TEST_P(RelayWorkloadTest, OpenFilesSurviveRepeatedKills) {
  const Program& prog = GetParam();
  std::vector<std::string> launch = {"--restart_window_ms=0"};  // the kills here are not a crash loop
  const std::string skip = PrepareWorkload(prog, &launch);
  if (!skip.empty()) GTEST_SKIP() << skip;
  if (HasFatalFailure()) return;
  const char* env = getenv("FUSEKEEPER_RELAY_KILLS");
  const int kills = env != nullptr ? atoi(env) : 20;
  StartWorkload(prog, launch, "pod-w");
  if (HasFatalFailure()) return;
  Subprocess* launcher = launcher_;
  PodWorkload& app = *app_;
  const std::string& target = target_;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 1; i <= kills; ++i) {
    ASSERT_TRUE(KillProgramAndWaitForRestart(launcher, i)) << prog.name << " kill " << i << ": " << launcher->Stderr();
    // The app gets on with its work before the next kill (so no request is in flight at two).
    ASSERT_TRUE(app.WaitForSteps(2)) << prog.name << " kill " << i << ": " << absl::StrJoin(app.errors(), "; ")
                                     << "\n" << launcher->Stderr();
  }
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_TRUE(app.Finish()) << prog.name << ": " << absl::StrJoin(app.errors(), "; ");
  EXPECT_EQ(app.errors().size(), 0u) << prog.name << ": " << absl::StrJoin(app.errors(), "; ");
  EXPECT_EQ(launcher->CountInStderr(") failed with "), 0) << launcher->Stderr();
  // Each instance of a libc program runs the relay's core itself; Go programs take the hop.
  EXPECT_EQ(launcher->CountInStderr(kInProgramLine), CoreRunsInProgram(prog.name) ? kills + 1 : 0)
      << launcher->Stderr();
  // The launcher's resident memory (the relay with its tables and buffers), for the README.
  std::string rss = "?";
  {
    std::ifstream status("/proc/" + std::to_string(launcher->pid()) + "/status");
    for (std::string line; std::getline(status, line);) {
      if (line.rfind("VmRSS:", 0) == 0) rss = line.substr(6);
    }
  }
  std::cout << "RESULT workload " << prog.name << ": " << kills << " kill -9, " << app.steps() << " steps, "
            << app.errors().size() << " errors, "
            << std::chrono::duration_cast<std::chrono::milliseconds>(took).count() / std::max(kills, 1)
            << " ms per kill cycle, launcher RSS" << rss << (CoreRunsInProgram(prog.name) ? ", in the program" : ", hop")
            << "\n";
  {
    grpc::Status s = Unpublish("prog", target);
    ASSERT_TRUE(s.ok()) << s.error_code() << " " << s.error_message() << "\n" << agent_->Stderr();
  }
  EXPECT_EQ(MountCountAt(target), 0);
  ASSERT_TRUE(launcher->Wait(std::chrono::milliseconds(20000)).has_value()) << launcher->Stderr();
}

// The agent killed (its connection to the launcher gone, as in a DaemonSet rollout) while the
// program is killed and restarted, then started again: the relay needs nothing from the agent to
// restart the program, re-deposits the connection with the new agent, and the app holding files
// open sees no error throughout; unpublish through the new agent still ends everything.
TEST_F(RelayWorkloadTest, TheAgentKilledWhileTheProgramRestartsCostsNoError) {
  const Program* bindfs = nullptr;
  for (const Program& p : kPrograms) {
    if (std::string(p.name) == "bindfs-foreground") bindfs = &p;
  }
  ASSERT_NE(bindfs, nullptr);
  std::vector<std::string> launch = {"--restart_window_ms=0"};
  const std::string skip = PrepareWorkload(*bindfs, &launch);
  if (!skip.empty()) GTEST_SKIP() << skip;
  const std::vector<std::string> metrics_flags = {"--metrics_address=127.0.0.1:0"};
  StartAgent(metrics_flags);
  const std::string target = Pod("pod-a", "prog");
  ASSERT_RPC_OK(PublishInline("prog", "pod-a", target));
  Subprocess* launcher = StartServer(PodSocket("pod-a"), launch);
  const std::string view_dir = root_.path() + "/views/agent-kill";
  fs::create_directories(view_dir);
  PodWorkload app(target, view_dir, /*writable=*/true, kServerUid);
  ASSERT_TRUE(app.WaitForSteps(3)) << absl::StrJoin(app.errors(), "; ") << launcher->Stderr();
  agent_->Signal(SIGKILL);
  ASSERT_TRUE(agent_->Wait(std::chrono::milliseconds(20000)).has_value());
  ASSERT_TRUE(KillProgramAndWaitForRestart(launcher, 1)) << launcher->Stderr();
  ASSERT_TRUE(app.WaitForSteps(3)) << "with no agent at all: " << absl::StrJoin(app.errors(), "; ");
  StartAgent(metrics_flags);
  ASSERT_TRUE(agent_->WaitForStderr("re-deposited its live FUSE connection", 1, std::chrono::milliseconds(20000))) << agent_->Stderr();
  ASSERT_TRUE(KillProgramAndWaitForRestart(launcher, 2)) << launcher->Stderr();
  ASSERT_TRUE(app.WaitForSteps(3)) << absl::StrJoin(app.errors(), "; ");
  // The new agent knows the volume is relayed (the re-deposit says so) and counts the restart
  // its server reported to it.
  {
    const std::string log = agent_->Stderr();
    const size_t at = log.find("(port ");
    ASSERT_NE(at, std::string::npos) << log;
    const int port = std::stoi(log.substr(at + 6));
    ASSERT_TRUE(WithDeadline([&] {
                  return absl::StrContains(HttpGet(port, "/metrics"),
                                           "fusekeeper_recoveries_total{how=\"program restart (relayed)\","
                                           "outcome=\"recovered\"} 1");
                }).value_or(false))
        << HttpGet(port, "/metrics");
    EXPECT_TRUE(absl::StrContains(HttpGet(port, "/metrics"), "fusekeeper_volumes_relayed 1"));
  }
  // The new agent got the relay state with the re-deposit: a launcher killed now is succeeded by
  // one that carries on from it.
  {
    launcher = KillLauncherAndStartAnother(launcher, PodSocket("pod-a"), launch);
    ASSERT_NE(launcher, nullptr);
    ASSERT_TRUE(app.WaitForSteps(3)) << absl::StrJoin(app.errors(), "; ");
  }
  EXPECT_TRUE(app.Finish()) << absl::StrJoin(app.errors(), "; ");
  EXPECT_EQ(app.errors().size(), 0u) << absl::StrJoin(app.errors(), "; ");
  {
    grpc::Status s = Unpublish("prog", target);
    ASSERT_TRUE(s.ok()) << s.error_code() << " " << s.error_message() << "\n" << agent_->Stderr();
  }
  EXPECT_EQ(MountCountAt(target), 0);
  ASSERT_TRUE(launcher->Wait(std::chrono::milliseconds(20000)).has_value()) << launcher->Stderr();
}

// Issue 20, item 5: the launcher itself killed (its container restarted, its image upgraded:
// kill -9 of the launcher and every process of its program at once, as a container's end is) while
// the app in the pod holds files open and works on them; a new launcher (what kubelet starts next)
// gets the kept connection and the relay state the dead one deposited with the agent, carries on
// from it, and the app sees no error. FUSEKEEPER_LAUNCHER_KILLS kills (default 5).
TEST_P(RelayWorkloadTest, TheLauncherKilledAndStartedAgainCostsNoError) {
  const Program& prog = GetParam();
  std::vector<std::string> launch = {"--restart_window_ms=0"};
  const std::string skip = PrepareWorkload(prog, &launch);
  if (!skip.empty()) GTEST_SKIP() << skip;
  if (HasFatalFailure()) return;
  const char* env = getenv("FUSEKEEPER_LAUNCHER_KILLS");
  const int kills = env != nullptr ? atoi(env) : 5;
  StartWorkload(prog, launch, "pod-l");
  if (HasFatalFailure()) return;
  Subprocess* launcher = launcher_;
  PodWorkload& app = *app_;
  const std::string& target = target_;
  const std::string socket = PodSocket("pod-l");
  const std::string gone = "the FUSE server closed its connection";
  std::string dead_launchers;  // what every launcher before the current one said
  for (int i = 1; i <= kills; ++i) {
    const int gone_before = agent_->CountInStderr(gone);
    if (i % 2 == 0) {
      // Every other time, while it restarts its program: the program killed, the launcher as soon
      // as it starts the next instance (INIT replayed, requests queued or resent).
      const int restarts = launcher->CountInStderr("the relay keeps the connection: restarting it");
      for (pid_t p : ProgramProcesses(launcher->pid())) kill(p, SIGKILL);
      ASSERT_TRUE(launcher->WaitForStderr("the relay keeps the connection: restarting it", restarts + 1,
                                          std::chrono::milliseconds(20000)))
          << launcher->Stderr();
    }
    std::set<pid_t> procs = ProgramProcesses(launcher->pid());
    launcher->Signal(SIGKILL);
    for (pid_t p : procs) kill(p, SIGKILL);
    ASSERT_TRUE(launcher->Wait(std::chrono::milliseconds(20000)).has_value());
    // The agent sees its server go (as kubelet would restart the container only after it ended).
    ASSERT_TRUE(agent_->WaitForStderr(gone, gone_before + 1, std::chrono::milliseconds(20000))) << agent_->Stderr();
    const std::string before = launcher->Stderr();
    dead_launchers += before;
    launcher = StartServer(socket, launch);
    ASSERT_TRUE(launcher->WaitForStderr("carrying on from its relay state", 1, std::chrono::milliseconds(20000)))
        << prog.name << " launcher " << i << ":\n" << launcher->Stderr() << "\nthe one before:\n" << before
        << agent_->Stderr();
    ASSERT_TRUE(app.WaitForSteps(2)) << prog.name << " launcher kill " << i << ": "
                                     << absl::StrJoin(app.errors(), "; ") << "\n" << launcher->Stderr();
  }
  EXPECT_TRUE(app.Finish()) << prog.name << ": " << absl::StrJoin(app.errors(), "; ");
  EXPECT_EQ(app.errors().size(), 0u) << prog.name << ": " << absl::StrJoin(app.errors(), "; ") << "\n"
                                     << launcher->Stderr();
  // No request failed in any launcher (the relay's own EIO or ESTALE would be logged so).
  std::string failed;
  for (absl::string_view line : absl::StrSplit(dead_launchers + launcher->Stderr(), '\n')) {
    if (absl::StrContains(line, ") failed with ")) absl::StrAppend(&failed, line, "\n");
  }
  EXPECT_EQ(failed, "");
  const std::string log = launcher->Stderr();
  const size_t at = log.find("serving again ");
  std::cout << "RESULT launcher " << prog.name << ": " << kills << " kill -9 of the launcher, " << app.steps()
            << " steps, " << app.errors().size() << " errors; last: "
            << (at == std::string::npos ? "?" : log.substr(at, log.find(" after its start", at) - at)) << "\n";
  {
    grpc::Status s = Unpublish("prog", target);
    ASSERT_TRUE(s.ok()) << s.error_code() << " " << s.error_message() << "\n" << agent_->Stderr();
  }
  EXPECT_EQ(MountCountAt(target), 0);
  ASSERT_TRUE(launcher->Wait(std::chrono::milliseconds(20000)).has_value()) << launcher->Stderr();
}

// Issue 28, item 3: where the container runtime's default seccomp profile refuses io_uring
// (containerd 2.0+, Docker 25+, CRI-O), the launcher's relay waits with epoll. A program whose
// core runs in it (bindfs) and one that takes the launcher's hop (gocryptfs, Go), under such a
// filter: killed again and again, then their launcher killed and started again; no operation
// fails and what was written reads back.
class NoIoUringTest : public RelayWorkloadTest {};

TEST_P(NoIoUringTest, KillsOfTheProgramAndOfTheLauncherCostNoError) {
  const Program& prog = GetParam();
  servers_refuse_io_uring_ = true;
  std::vector<std::string> launch = {"--restart_window_ms=0"};
  const std::string skip = PrepareWorkload(prog, &launch);
  if (!skip.empty()) GTEST_SKIP() << skip;
  if (HasFatalFailure()) return;
  StartWorkload(prog, launch, "pod-n");
  if (HasFatalFailure()) return;
  Subprocess* launcher = launcher_;
  PodWorkload& app = *app_;
  EXPECT_EQ(launcher->CountInStderr("waiting with epoll"), 1) << launcher->Stderr();
  constexpr int kKills = 5;
  for (int i = 1; i <= kKills; ++i) {
    ASSERT_TRUE(KillProgramAndWaitForRestart(launcher, i)) << prog.name << " kill " << i << ": " << launcher->Stderr();
    ASSERT_TRUE(app.WaitForSteps(2)) << prog.name << " kill " << i << ": " << absl::StrJoin(app.errors(), "; ")
                                     << "\n" << launcher->Stderr();
  }
  EXPECT_EQ(launcher->CountInStderr(kInProgramLine), CoreRunsInProgram(prog.name) ? kKills + 1 : 0)
      << launcher->Stderr();
  Subprocess* next = KillLauncherAndStartAnother(launcher, PodSocket("pod-n"), launch);
  ASSERT_NE(next, nullptr);
  EXPECT_EQ(next->CountInStderr("waiting with epoll"), 1) << next->Stderr();
  ASSERT_TRUE(app.WaitForSteps(3)) << prog.name << ": " << absl::StrJoin(app.errors(), "; ") << "\n" << next->Stderr();
  EXPECT_TRUE(app.Finish()) << prog.name << ": " << absl::StrJoin(app.errors(), "; ");
  EXPECT_EQ(app.errors().size(), 0u) << prog.name << ": " << absl::StrJoin(app.errors(), "; ");
  EXPECT_EQ(launcher->CountInStderr(") failed with ") + next->CountInStderr(") failed with "), 0)
      << launcher->Stderr() << next->Stderr();
  std::cout << "RESULT no io_uring " << prog.name << ": " << kKills << " program kill -9 and a launcher kill -9, "
            << app.steps() << " steps, " << app.errors().size() << " errors\n";
  {
    grpc::Status s = Unpublish("prog", target_);
    ASSERT_TRUE(s.ok()) << s.error_code() << " " << s.error_message() << "\n" << agent_->Stderr();
  }
  EXPECT_EQ(MountCountAt(target_), 0);
  ASSERT_TRUE(next->Wait(std::chrono::milliseconds(20000)).has_value()) << next->Stderr();
}

std::vector<Program> NoIoUringPrograms() {
  std::vector<Program> out;
  for (const Program& p : kPrograms) {
    if (std::string(p.name) == "bindfs-foreground" || std::string(p.name) == "gocryptfs") out.push_back(p);
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Programs, NoIoUringTest, ::testing::ValuesIn(NoIoUringPrograms()), ProgramName);

std::vector<Program> WorkloadPrograms() {
  std::vector<Program> out;
  for (const Program& p : kPrograms) {
    for (const char* name : {"squashfuse_ll", "fuse-overlayfs", "sshfs-foreground", "gocryptfs", "rclone-mount2",
                             "bindfs", "s3fs-foreground"}) {
      if (std::string(p.name) == name) out.push_back(p);
    }
  }
  return out;
}
INSTANTIATE_TEST_SUITE_P(Programs, RelayWorkloadTest, ::testing::ValuesIn(WorkloadPrograms()), ProgramName);

}  // namespace
}  // namespace fusekeeper
