// Recovery end to end: real agent, real reference server (unprivileged), real kernel FUSE
// connections in a private mount namespace. Servers are killed with SIGKILL under continuous
// reads from two pod targets and restarted; the pods never act.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <atomic>
#include <thread>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

#include "agent/fuse/fuse_mount.h"
#include "agent/fuse/fuse_tuning.h"
#include "tests/testing/hello_fuse_server.h"
#include "tests/testing/fake_kube.h"
#include "tests/volume/fuse_fixture.h"
#include "tests/volume/pod_reader.h"

namespace fusekeeper {
namespace {


class RecoveryE2ETest : public FuseE2ETest {
 protected:
  // Stages volume `id` and publishes it to two pods; returns the two targets.
  std::pair<std::string, std::string> StageAndPublishTwo(const std::string& id) {
    staging_ = StagingPath(id);
    grpc::Status s = StageFuse(id, staging_);
    EXPECT_TRUE(s.ok()) << s.error_message();
    socket_ = StagedSocket(id);
    std::pair<std::string, std::string> targets{Pod("pod-a", id), Pod("pod-b", id)};
    for (grpc::Status ps : {PublishStaged(id, staging_, targets.first, "a", "pod-a"),
                            PublishStaged(id, staging_, targets.second, "b", "pod-b")}) {
      EXPECT_TRUE(ps.ok()) << ps.error_message();
    }
    return targets;
  }
  int AgentLogCount(const std::string& what) { return agent_->CountInStderr(what); }
  bool WaitForAgentLog(const std::string& what, int count = 1) {
    return agent_->WaitForStderr(what, count, std::chrono::duration_cast<std::chrono::milliseconds>(kTestDeadline));
  }
  Subprocess* StartLaunchedHello(const std::string& content) {
    const std::string hello = root_.path() + "/hello_fuse";
    if (!fs::exists(hello)) {
      fs::copy_file(RunfilePath("tests/testing/hello_fuse"), hello);
      chmod(hello.c_str(), 0755);
    }
    return StartServer(socket_, {"launch", "--", hello, "/dev/fd/{fd}", content});
  }

  // A privileged FUSE pod (as Fluid's runtimes do) mounts a connection of its own on the
  // global path and serves `content` as "hello".
  std::unique_ptr<HelloFuseServer> MountOtherServerOnStaging(const std::string& content) {
    auto dev = OpenFuseDeviceBlocking();
    EXPECT_TRUE(dev.ok());
    if (!dev.ok()) return nullptr;
    UniqueFd dir(open(staging_.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
    FuseMountOptions mo;
    mo.subtype = "otherfs";
    EXPECT_TRUE(MountFuseBlocking(dev->get(), dir.get(), staging_, mo).ok());
    return std::make_unique<HelloFuseServer>(dev->Release(), content);
  }
  // Ends that connection so its server thread finishes.
  void EndOtherServer(std::unique_ptr<HelloFuseServer> server) {
    struct stat st;
    ASSERT_EQ(stat(staging_.c_str(), &st), 0);
    AbortFuseConnectionBlocking(minor(st.st_dev));
    server.reset();
  }

  std::string staging_, socket_;
};

TEST_F(RecoveryE2ETest, ServerKilledUnderReadsAdoptsTheLiveConnectionAndReadsNeverFail) {
  // The API server double receives the Events, over HTTPS verified with its CA.
  FakeKube& kube = StartKube();
  // A server back within the grace is no Warning (see AServerBackWithinTheGraceIsNoWarning); a
  // long grace keeps that so on a loaded machine.
  StartAgent({"--kube_secrets_dir=" + secrets_, "--metrics_address=127.0.0.1:0", "--server_gone_grace_ms=60000"});
  auto [t1, t2] = StageAndPublishTwo("adopt-1");
  Subprocess* first = StartServer(socket_);
  Reader r1(t1 + "/hello.txt");
  auto r2 = PodReader(t2, "hello.txt");  // the second pod reads from its container's view
  const std::string want = "hello from the export\n";
  ASSERT_TRUE(r1.WaitForReadsOf(want)) << first->Stderr() << agent_->Stderr();
  ASSERT_TRUE(r2->WaitForReadsOf(want)) << r2->setup_error();
  for (int round = 0; round < 3; ++round) {
    Subprocess* dying = servers_.back().get();
    dying->Signal(SIGKILL);
    ASSERT_TRUE(dying->Wait(std::chrono::milliseconds(20000)).has_value());
    Subprocess* next = StartServer(socket_);
    ASSERT_TRUE(r1.WaitForReadsOf(want)) << "round " << round << " server status "
                                         << next->Wait(std::chrono::milliseconds(2000)).value_or(-1) << "\n"
                                         << next->Stderr() << agent_->Stderr();
    ASSERT_TRUE(r2->WaitForReadsOf(want)) << "round " << round;
  }
  r1.Stop();
  r2->Stop();
  EXPECT_EQ(r1.errors() + r2->errors(), 0) << "with the kept connection, reads wait instead of failing";
  EXPECT_GT(r1.reads(), 0);
  EXPECT_EQ(MountCountAt(t1), 1);
  EXPECT_EQ(MountCountAt(t2), 1);
  EXPECT_EQ(MountCountAt(staging_), 1) << "no remount was needed";
  ASSERT_TRUE(WaitForAgentLog("MountRecovered", 3)) << agent_->Stderr();  // one per round
  EXPECT_GE(AgentLogCount("FuseServerRestarted"), 3);
  EXPECT_EQ(AgentLogCount("MountRecoveryFailed"), 0);
  // Events on both pods: 3 rounds x 2 reasons x 2 pods, the repeats as count updates.
  ASSERT_TRUE(kube.WaitForRequestsWith(" /api/v1/namespaces/default/events", 12))
      << kube.Diagnostics() << agent_->Stderr();
  int posts = 0, patches = 0;
  std::map<std::string, int> reasons;
  for (const auto& line : kube.Log()) {
    posts += absl::StrContains(line, "\"verb\": \"POST\"");
    patches += absl::StrContains(line, "\"verb\": \"PATCH\"");
    for (const char* r : {"FuseServerNotConnected", "FuseServerRestarted", "MountRecovered"}) {
      if (absl::StrContains(line, absl::StrCat("\\\"reason\\\":\\\"", r))) ++reasons[r];
    }
    EXPECT_TRUE(absl::StrContains(line, "Bearer agent-token")) << line;
  }
  EXPECT_EQ(posts, 4) << "one event per reason and pod";
  EXPECT_EQ(patches, 8) << "later rounds update counts";
  EXPECT_EQ(reasons["FuseServerNotConnected"], 0) << "every server was back within the grace";
  EXPECT_EQ(reasons["FuseServerRestarted"], 2);
  EXPECT_EQ(reasons["MountRecovered"], 2);
  // Metrics and health.
  const std::string log = agent_->Stderr();
  const size_t at = log.find("(port ");
  ASSERT_NE(at, std::string::npos);
  const int port = std::stoi(log.substr(at + 6));
  const std::string metrics = HttpGet(port, "/metrics");
  EXPECT_TRUE(absl::StrContains(metrics, "HTTP/1.1 200")) << metrics;
  EXPECT_TRUE(absl::StrContains(
      metrics, "fusekeeper_recoveries_total{how=\"server restart (connection adopted)\",outcome=\"recovered\"} 3"))
      << metrics;
  EXPECT_TRUE(absl::StrContains(metrics, "fusekeeper_volumes{kind=\"fuse\",state=\"serving\"} 1")) << metrics;
  EXPECT_TRUE(absl::StrContains(metrics, "fusekeeper_rpc_duration_seconds_count{method=\"NodePublishVolume\",code=\"OK\"} 2"))
      << metrics;
  EXPECT_TRUE(absl::StrContains(HttpGet(port, "/healthz"), "200 OK"));
  EXPECT_TRUE(absl::StrContains(HttpGet(port, "/nope"), "404"));
}

TEST_F(RecoveryE2ETest, ServerThatCannotAdoptGetsAFreshConnectionThatRunningContainersSee) {
  StartAgent();
  auto [t1, t2] = StageAndPublishTwo("fresh-1");
  Subprocess* first = StartServer(socket_);
  // Containers started before the crash: they hold copies of the targets' mounts.
  auto p1 = PodReader(t1, "hello.txt");
  auto p2 = PodReader(t2, "hello");
  ASSERT_TRUE(p1->WaitForReadsOf("hello from the export\n")) << p1->setup_error() << first->Stderr();
  first->Signal(SIGKILL);
  ASSERT_TRUE(first->Wait(std::chrono::milliseconds(20000)).has_value());
  // A launched libfuse program cannot adopt a live connection: fkserve asks for a fresh one.
  Subprocess* second = StartLaunchedHello("relaunched\n");
  ASSERT_TRUE(p2->WaitForReadsOf("relaunched\n"))
      << "pod view: reads " << p2->reads() << " errors " << p2->errors() << " host: '" << ReadFile(t2 + "/hello")
      << "' second server: " << second->Wait(std::chrono::milliseconds(1)).value_or(-1) << " " << second->Stderr()
      << agent_->Stderr();
  auto p1b = PodReader(t1, "hello");
  ASSERT_TRUE(p1b->WaitForReadsOf("relaunched\n")) << "the first pod's container sees the fresh connection too";
  EXPECT_EQ(ReadFile(t1 + "/hello"), "relaunched\n") << "and so does the host";
  EXPECT_EQ(MountCountAt(staging_), 2) << "the fresh connection is stacked on the global mount";
  EXPECT_EQ(MountCountAt(t1), 2) << "the live layer on the target's base, which containers follow";
  EXPECT_EQ(MountCountAt(t2), 2);
  ASSERT_TRUE(WaitForAgentLog("MountRecovered")) << agent_->Stderr();
  EXPECT_NE(second->Stderr().find("asking for a fresh one"), std::string::npos);
  // Issue 18 item 4: replacing the dead connection is the agent's own act, not a Warning.
  EXPECT_EQ(AgentLogCount("its FUSE connection was aborted"), 0) << agent_->Stderr();
  // Unpublish and unstage still work on the repaired volume, and remove every layer.
  p1->Stop();
  p1b->Stop();
  p2->Stop();
  ASSERT_RPC_OK(Unpublish("fresh-1", t1));
  ASSERT_RPC_OK(Unpublish("fresh-1", t2));
  ASSERT_RPC_OK(Unstage("fresh-1", staging_));
  EXPECT_EQ(MountCountAt(staging_), 0);
  EXPECT_EQ(MountCountAt(t1), 0);
  EXPECT_EQ(MountCountAt(t2), 0);
}

TEST_F(RecoveryE2ETest, AbortedConnectionIsRemountedAndTheNextServerServesEveryPodView) {
  StartAgent();
  auto [t1, t2] = StageAndPublishTwo("abort-1");
  Subprocess* first = StartServer(socket_);
  const std::string want = "hello from the export\n";
  auto p1 = PodReader(t1, "hello.txt");
  auto p2 = PodReader(t2, "hello.txt");
  Reader h1(t1 + "/hello.txt");
  ASSERT_TRUE(p1->WaitForReadsOf(want)) << p1->setup_error() << first->Stderr();
  ASSERT_TRUE(p2->WaitForReadsOf(want));
  // Three rounds: each repair removes the dead layer before stacking the next, so a path never
  // holds more than its base and one live layer. A third pod is published after the first
  // repair: its base is a bind of that repair's layer, which later repairs of the global mount
  // do not propagate to, so the agent stacks the live connection on it itself.
  std::string t3;
  std::unique_ptr<Reader> p3;
  for (int round = 0; round < 3; ++round) {
    if (round == 1) {
      t3 = Pod("pod-c", "abort-1");
      ASSERT_RPC_OK(PublishStaged("abort-1", staging_, t3, "c", "pod-c"));
      p3 = PodReader(t3, "hello.txt");
      ASSERT_TRUE(p3->WaitForReadsOf(want)) << p3->setup_error();
      EXPECT_EQ(MountCountAt(t3), 1);
    }
    struct stat st;
    ASSERT_EQ(stat(staging_.c_str(), &st), 0);
    ASSERT_TRUE(AbortFuseConnectionBlocking(minor(st.st_dev)).ok());
    // The server sees its connection end and asks the socket for the next one: the fresh
    // connection the agent mounts.
    ASSERT_TRUE(first->WaitForStderr("serving volume abort-1", round + 2, kTestDeadline))
        << "round " << round << ": " << first->Stderr() << agent_->Stderr();
    ASSERT_TRUE(p1->WaitForReadsOf(want)) << "round " << round << ": " << first->Stderr() << agent_->Stderr();
    ASSERT_TRUE(p2->WaitForReadsOf(want)) << "round " << round;
    ASSERT_TRUE(h1.WaitForReadsOf(want)) << "round " << round;
    EXPECT_EQ(MountCountAt(staging_), 2) << "round " << round;
    EXPECT_EQ(MountCountAt(t1), 2) << "round " << round;
    EXPECT_EQ(MountCountAt(t2), 2) << "round " << round;
    if (p3) {
      ASSERT_TRUE(p3->WaitForReadsOf(want)) << "round " << round << agent_->Stderr();
      EXPECT_EQ(MountCountAt(t3), 2) << "round " << round;
    }
    // The agent's own check through the repaired mount may come after the pods' reads: the next
    // abort waits for it (one that came first would make this repair part of the next one).
    ASSERT_TRUE(WaitForAgentLog("MountRecovered", round + 1)) << "round " << round << agent_->Stderr();
  }
  // The first pod goes away: removing its layers must not take the live connection from the
  // global mount or from the other pod (umount propagates to a mount's peers).
  p1->Stop();
  h1.Stop();
  ASSERT_RPC_OK(Unpublish("abort-1", t1));
  EXPECT_EQ(MountCountAt(t1), 0);
  EXPECT_EQ(MountCountAt(staging_), 2);
  EXPECT_EQ(MountCountAt(t2), 2);
  ASSERT_TRUE(p2->WaitForReadsOf(want)) << "the other pod still reads";
  EXPECT_EQ(ReadFile(staging_ + "/hello.txt"), want);
}

TEST_F(RecoveryE2ETest, InlineVolumeWhoseConnectionIsAbortedHealsInsideTheRunningContainer) {
  StartAgent();
  const std::string target = Pod("pod-i", "inline-1");
  ASSERT_RPC_OK(PublishInline("inline-1", "pod-i", target));
  socket_ = PodSocket("pod-i");
  Subprocess* first = StartServer(socket_);
  const std::string want = "hello from the export\n";
  auto view = PodReader(target, "hello.txt");
  ASSERT_TRUE(view->WaitForReadsOf(want)) << view->setup_error() << first->Stderr() << agent_->Stderr();
  // The sidecar is not restarted (kubelet would after a growing back-off, while the container's
  // reads wait): the same server asks for the fresh connection and serves it.
  for (int round = 0; round < 2; ++round) {
    struct stat st;
    ASSERT_EQ(stat(target.c_str(), &st), 0);
    ASSERT_TRUE(AbortFuseConnectionBlocking(minor(st.st_dev)).ok());
    ASSERT_TRUE(first->WaitForStderr("serving volume inline-1", round + 2, kTestDeadline))
        << "round " << round << ": the server serves the fresh connection itself\n" << first->Stderr()
        << agent_->Stderr();
    ASSERT_TRUE(view->WaitForReadsOf(want)) << "round " << round << ": the container reads through the fresh "
                                            << "connection; last '" << view->last() << "' errors " << view->errors()
                                            << "\n" << first->Stderr() << agent_->Stderr();
    EXPECT_FALSE(first->Wait(std::chrono::milliseconds(0)).has_value()) << first->Stderr();
    EXPECT_EQ(MountCountAt(target), 2) << "base + live layer, round " << round;
  }
  NodeGetVolumeStatsResponse stats = Stats("inline-1", target);
  EXPECT_FALSE(stats.volume_condition().abnormal()) << stats.volume_condition().message();
  view->Stop();
  ASSERT_RPC_OK(Unpublish("inline-1", target));
  EXPECT_EQ(MountCountAt(target), 0) << "unpublish removes every layer";
  EXPECT_FALSE(fs::exists(target));
}

// Issue 30 part 2: the volume's FUSE tuning is written to its connection once the server has
// answered FUSE_INIT (whose reply would undo it otherwise), and again on the fresh connection a
// repair mounts; an inline volume here, read through a pod view throughout.
// A launched program, relayed or direct, loses its connection to an abort: the launcher (the
// sidecar's process, which the kubelet would restart only after a back-off) starts it anew on
// the fresh connection the agent mounts.
TEST_F(RecoveryE2ETest, ALaunchedProgramWhoseConnectionIsAbortedIsStartedAnewByTheSameLauncher) {
  StartAgent();
  int n = 0;
  for (const bool direct : {false, true}) {
    SCOPED_TRACE(direct ? "direct" : "relayed");
    const std::string id = absl::StrCat("launched-", n), pod = absl::StrCat("pod-l", n++);
    const std::string target = Pod(pod, id);
    ASSERT_RPC_OK(PublishInline(id, pod, target));
    socket_ = PodSocket(pod);
    const std::string hello = root_.path() + "/hello_fuse";
    if (!fs::exists(hello)) {
      fs::copy_file(RunfilePath("tests/testing/hello_fuse"), hello);
      chmod(hello.c_str(), 0755);
    }
    std::vector<std::string> args = {"launch", "--", hello, "/dev/fd/{fd}", "launched\n"};
    if (direct) args.insert(args.begin(), "--direct");
    Subprocess* launcher = StartServer(socket_, args);
    auto view = PodReader(target, "hello");
    ASSERT_TRUE(view->WaitForReadsOf("launched\n")) << view->setup_error() << launcher->Stderr() << agent_->Stderr();
    for (int round = 0; round < 2; ++round) {
      struct stat st;
      ASSERT_EQ(stat(target.c_str(), &st), 0);
      ASSERT_TRUE(AbortFuseConnectionBlocking(minor(st.st_dev)).ok());
      ASSERT_TRUE(launcher->WaitForStderr("serving volume " + id, round + 2, kTestDeadline))
          << "round " << round << ": " << launcher->Stderr() << agent_->Stderr();
      ASSERT_TRUE(view->WaitForReadsOf("launched\n")) << "round " << round << ": last '" << view->last() << "'\n"
                                                      << launcher->Stderr() << agent_->Stderr();
      EXPECT_FALSE(launcher->Wait(std::chrono::milliseconds(0)).has_value()) << launcher->Stderr();
    }
    view->Stop();
    ASSERT_RPC_OK(Unpublish(id, target));
    auto status = launcher->Wait(std::chrono::milliseconds(20000));
    ASSERT_TRUE(status.has_value()) << "the socket is gone with the volume: the launcher is done\n" << launcher->Stderr();
    EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << *status << launcher->Stderr();
  }
}

TEST_F(RecoveryE2ETest, PerVolumeFuseTuningHoldsOnceServedAndOnEveryFreshConnection) {
  extra_context_ = {{"readAheadKb", "1536"}, {"maxBackground", "37"}, {"congestionThreshold", "29"}};
  StartAgent({"--metrics_address=127.0.0.1:0"});
  const std::string target = Pod("pod-t", "tuned-1");
  ASSERT_RPC_OK(PublishInline("tuned-1", "pod-t", target));
  socket_ = PodSocket("pod-t");
  StartServer(socket_);
  const std::string want = "hello from the export\n";
  auto view = PodReader(target, "hello.txt");
  ASSERT_TRUE(view->WaitForReadsOf(want)) << view->setup_error() << agent_->Stderr();
  const std::string tuned = "tuned: readAheadKb=1536 maxBackground=37 congestionThreshold=29";
  uint32_t previous = 0;
  for (int round = 0; round < 2; ++round) {
    ASSERT_TRUE(WaitForAgentLog(tuned, round + 1)) << "round " << round << "\n" << agent_->Stderr();
    struct stat st;
    ASSERT_EQ(stat(target.c_str(), &st), 0);
    const uint32_t connection = minor(st.st_dev);
    EXPECT_NE(connection, previous) << "round " << round << ": a fresh connection";
    const FuseTuningNow now = ReadFuseTuningBlocking(connection);
    EXPECT_EQ(now.read_ahead_kb, 1536) << "round " << round;
    EXPECT_EQ(now.max_background, 37) << "round " << round;
    EXPECT_EQ(now.congestion_threshold, 29) << "round " << round;
    if (round == 1) break;
    previous = connection;
    ASSERT_TRUE(AbortFuseConnectionBlocking(connection).ok());
    // The same server asks for the fresh connection and serves it.
    ASSERT_TRUE(servers_.back()->WaitForStderr("asking the agent for the volume's next one", 1, kTestDeadline))
        << servers_.back()->Stderr();
    ASSERT_TRUE(view->WaitForReadsOf(want)) << "the container reads through the fresh connection\n" << agent_->Stderr();
  }
  EXPECT_EQ(AgentLogCount("FuseTuningFailed"), 0) << agent_->Stderr();
  const std::string log = agent_->Stderr();
  const size_t at = log.find("(port ");
  ASSERT_NE(at, std::string::npos) << log;
  const std::string metrics = HttpGet(std::stoi(log.substr(at + 6)), "/metrics");
  EXPECT_TRUE(absl::StrContains(metrics, "fusekeeper_fuse_tuning_total{outcome=\"applied\"} 2")) << metrics;
  view->Stop();
  ASSERT_RPC_OK(Unpublish("tuned-1", target));
}

// Issue 18 item 1. The agent as the DaemonSet runs it: in a mount namespace of its own (the
// kubelet dir shared with the node), a new one at each restart, so every mount it sees gets a new
// id each time. Repairs after a restart must still keep the base the running container follows,
// stats must not call a healthy volume "a different mount", and the pod view made before the
// first restart must read through every repair.
TEST_F(RecoveryE2ETest, RepairsAfterAgentRestartsInNewMountNamespacesReachTheRunningContainer) {
  agent_prefix_ = {"/usr/bin/unshare", "-m", "--propagation", "unchanged"};
  StartAgent();
  const std::string target = Pod("pod-ns", "ns-1");
  ASSERT_RPC_OK(PublishInline("ns-1", "pod-ns", target));
  socket_ = PodSocket("pod-ns");
  const std::string staging = StagingPath("ns-2");
  ASSERT_RPC_OK(StageFuse("ns-2", staging));
  const std::string staged_target = Pod("pod-ns2", "ns-2");
  ASSERT_RPC_OK(PublishStaged("ns-2", staging, staged_target, "web", "pod-ns2"));
  Subprocess* inline_server = StartServer(socket_);
  Subprocess* staged_server = StartServer(StagedSocket("ns-2"));
  const std::string want = "hello from the export\n";
  auto view = PodReader(target, "hello.txt");
  auto staged_view = PodReader(staged_target, "hello.txt");
  ASSERT_TRUE(view->WaitForReadsOf(want)) << view->setup_error() << agent_->Stderr();
  ASSERT_TRUE(staged_view->WaitForReadsOf(want)) << staged_view->setup_error() << agent_->Stderr();
  auto restart_agent = [&] {
    agent_->Signal(SIGKILL);
    ASSERT_TRUE(agent_->Wait(std::chrono::milliseconds(20000)).has_value());
    StartAgent();
  };
  // Aborts the connection the path is served by now; the next server is given a fresh one.
  auto abort_and_serve_again = [&](const std::string& path, const std::string& socket, Reader* reader,
                                   Subprocess*& serving, const std::string& round) {
    struct stat st;
    ASSERT_EQ(stat(path.c_str(), &st), 0);
    const int asked = serving->CountInStderr("asking the agent for the volume's next one");
    ASSERT_TRUE(AbortFuseConnectionBlocking(minor(st.st_dev)).ok());
    // The server of the aborted connection asks for the fresh one and serves it.
    ASSERT_TRUE(serving->WaitForStderr("asking the agent for the volume's next one", asked + 1, kTestDeadline))
        << round << ": " << serving->Stderr() << agent_->Stderr();
    Subprocess* next = serving;
    ASSERT_TRUE(reader->WaitForReadsOf(want)) << round << ": the container reads through the fresh connection; last '"
                                              << reader->last() << "' errors " << reader->errors() << "\n"
                                              << next->Stderr() << agent_->Stderr();
  };
  for (int round = 0; round < 2; ++round) {
    const std::string name = "round " + std::to_string(round);
    restart_agent();
    ASSERT_TRUE(view->WaitForReadsOf(want)) << name;
    for (const auto& [id, path] : {std::pair<std::string, std::string>{"ns-1", target}, {"ns-2", staged_target}}) {
      NodeGetVolumeStatsResponse stats = Stats(id, path);
      EXPECT_FALSE(stats.volume_condition().abnormal()) << name << ": " << stats.volume_condition().message();
    }
    abort_and_serve_again(target, socket_, view.get(), inline_server, name + " inline");
    abort_and_serve_again(staging, StagedSocket("ns-2"), staged_view.get(), staged_server, name + " staged");
    EXPECT_EQ(MountCountAt(target), 2) << name << ": base + live layer";
    EXPECT_EQ(MountCountAt(staging), 2) << name << ": base + live layer";
    EXPECT_EQ(MountCountAt(staged_target), 2) << name << ": base + live layer";
  }
  EXPECT_EQ(AgentLogCount("MountRecoveryFailed"), 0) << agent_->Stderr();
  view->Stop();
  staged_view->Stop();
  ASSERT_RPC_OK(Unpublish("ns-1", target));
  ASSERT_RPC_OK(Unpublish("ns-2", staged_target));
  ASSERT_RPC_OK(Unstage("ns-2", staging));
  EXPECT_EQ(MountCountAt(target), 0);
  EXPECT_EQ(MountCountAt(staging), 0);
  EXPECT_EQ(MountCountAt(staged_target), 0);
}

TEST_F(RecoveryE2ETest, GlobalPathRemountedBySomeoneElseReachesEveryPodView) {
  // The kubelet is down (nothing listens): its polls fail with clear errors, and recovery by
  // mount-table events works regardless.
  StartAgent({"--kubelet_url=https://127.0.0.1:1/pods", "--kubelet_poll_period_ms=20"});
  auto [t1, t2] = StageAndPublishTwo("fluid-1");
  { std::ofstream(export_ + "/hello") << "export hello\n"; }
  Subprocess* first = StartServer(socket_);
  auto p1 = PodReader(t1, "hello");
  auto p2 = PodReader(t2, "hello");
  ASSERT_TRUE(p1->WaitForReadsOf("export hello\n")) << p1->setup_error() << first->Stderr();
  ASSERT_TRUE(p2->WaitForReadsOf("export hello\n"));
  // A privileged FUSE pod (as Fluid's runtimes do) mounts its own connection on the global path.
  auto server = MountOtherServerOnStaging("served by the other pod\n");
  ASSERT_NE(server, nullptr);
  Reader r1(t1 + "/hello");
  ASSERT_TRUE(r1.WaitForReadsOf("served by the other pod\n")) << agent_->Stderr();
  ASSERT_TRUE(p1->WaitForReadsOf("served by the other pod\n"));
  ASSERT_TRUE(p2->WaitForReadsOf("served by the other pod\n"));
  EXPECT_EQ(MountCountAt(t1), 2) << "stacked on the base";
  EXPECT_EQ(MountCountAt(t2), 2);
  ASSERT_TRUE(WaitForAgentLog("was replaced (fuse.otherfs)")) << agent_->Stderr();
  ASSERT_TRUE(WaitForAgentLog("polling the kubelet at https://127.0.0.1:1/pods: ")) << agent_->Stderr();
  EXPECT_TRUE(WaitForAgentLog("recovery still works from mount-table and FUSE connection events"));
  p1->Stop();
  p2->Stop();
  r1.Stop();
  EndOtherServer(std::move(server));
}

TEST_F(RecoveryE2ETest, AgentRestartKeepsServedVolumesHealthyAndAdoptable) {
  StartAgent();
  auto [t1, t2] = StageAndPublishTwo("restart-1");
  Subprocess* staged_server = StartServer(socket_);
  const std::string ti = Pod("pod-i", "restart-2");
  ASSERT_RPC_OK(PublishInline("restart-2", "pod-i", ti));
  Subprocess* inline_server = StartServer(PodSocket("pod-i"));
  const std::string want = "hello from the export\n";
  auto p1 = PodReader(t1, "hello.txt");
  auto pi = PodReader(ti, "hello.txt");
  ASSERT_TRUE(p1->WaitForReadsOf(want)) << p1->setup_error() << staged_server->Stderr();
  ASSERT_TRUE(pi->WaitForReadsOf(want)) << inline_server->Stderr();
  // A DaemonSet rollout, the hard way.
  agent_->Signal(SIGKILL);
  ASSERT_TRUE(agent_->Wait(std::chrono::milliseconds(20000)).has_value());
  StartAgent({"--metrics_address=127.0.0.1:0"});
  // Both servers notice and hand their connections back to the new agent.
  ASSERT_TRUE(WaitForAgentLog("re-deposited its live FUSE connection", 2))
      << agent_->Stderr() << staged_server->Stderr() << inline_server->Stderr();
  for (const auto& [id, path] : {std::pair<std::string, std::string>{"restart-1", t1}, {"restart-2", ti}}) {
    NodeGetVolumeStatsResponse stats = Stats(id, path);
    EXPECT_FALSE(stats.volume_condition().abnormal()) << id << ": " << stats.volume_condition().message();
  }
  const std::string log = agent_->Stderr();
  const size_t at = log.find("(port ");
  ASSERT_NE(at, std::string::npos);
  const std::string metrics = HttpGet(std::stoi(log.substr(at + 6)), "/metrics");
  EXPECT_TRUE(absl::StrContains(metrics, "fusekeeper_volumes{kind=\"fuse\",state=\"serving\"} 2")) << metrics;
  // The next crash of each server is adopted in place: not one read fails in either pod.
  for (Subprocess* dying : {staged_server, inline_server}) {
    dying->Signal(SIGKILL);
    ASSERT_TRUE(dying->Wait(std::chrono::milliseconds(20000)).has_value());
  }
  StartServer(socket_);
  StartServer(PodSocket("pod-i"));
  ASSERT_TRUE(p1->WaitForReadsOf(want)) << agent_->Stderr();
  ASSERT_TRUE(pi->WaitForReadsOf(want)) << agent_->Stderr();
  ASSERT_TRUE(WaitForAgentLog("FuseServerRestarted", 2)) << agent_->Stderr();
  p1->Stop();
  pi->Stop();
  EXPECT_EQ(p1->errors() + pi->errors(), 0) << "kept connections survived the agent restart";
  EXPECT_EQ(AgentLogCount("mounting a fresh connection"), 0) << agent_->Stderr();
  EXPECT_EQ(MountCountAt(t1), 1);
  EXPECT_EQ(MountCountAt(ti), 1);
}

TEST_F(RecoveryE2ETest, AgentRestartWithAServerThatCannotRedepositSaysSoAndStillRecovers) {
  StartAgent();
  auto [t1, t2] = StageAndPublishTwo("restart-3");
  { std::ofstream(export_ + "/hello") << "first\n"; }
  // Its server dies while the agent is down: nothing is left to re-deposit the connection,
  // which died with its last fd.
  Subprocess* first = StartServer(socket_);
  auto p1 = PodReader(t1, "hello");
  ASSERT_TRUE(p1->WaitForReadsOf("first\n")) << p1->setup_error() << first->Stderr();
  agent_->Signal(SIGKILL);
  ASSERT_TRUE(agent_->Wait(std::chrono::milliseconds(20000)).has_value());
  first->Signal(SIGKILL);
  ASSERT_TRUE(first->Wait(std::chrono::milliseconds(20000)).has_value());
  StartAgent();
  // Stats say what is known.
  NodeGetVolumeStatsResponse stats = Stats("restart-3", t1);
  EXPECT_TRUE(stats.volume_condition().abnormal());
  EXPECT_TRUE(absl::StrContains(stats.volume_condition().message(), "re-deposited")) << stats.volume_condition().message();
  // The next server waits for its config, is given a fresh connection, and the pod sees it.
  StartLaunchedHello("second\n");
  ASSERT_TRUE(p1->WaitForReadsOf("second\n")) << agent_->Stderr();
}

TEST_F(RecoveryE2ETest, ASidecarStoppedForPodDeletionIsNoWarningButACrashIs) {
  StartAgent({"--server_gone_grace_ms=3000"});
  // Pod deletion as kubelet does it: the server sidecar is stopped, then the volume unpublished.
  const std::string gone = Pod("pod-gone", "grace-1");
  ASSERT_RPC_OK(PublishInline("grace-1", "pod-gone", gone));
  Subprocess* sidecar = StartServer(PodSocket("pod-gone"));
  ASSERT_TRUE(WithDeadline([&] { return ReadFile(gone + "/hello.txt"); }).has_value());
  sidecar->Signal(SIGTERM);
  ASSERT_TRUE(sidecar->Wait(std::chrono::milliseconds(20000)).has_value());
  // It says it stopped serving (its connection closes with it).
  ASSERT_TRUE(WaitForAgentLog("volume grace-1: the FUSE server stopped serving")) << sidecar->Stderr() << agent_->Stderr();
  ASSERT_RPC_OK(Unpublish("grace-1", gone));
  ASSERT_TRUE(WaitForAgentLog("(a pod going away): no Warning")) << agent_->Stderr();
  // A server that really dies is still a Warning, once the grace has passed.
  const std::string live = Pod("pod-live", "grace-2");
  ASSERT_RPC_OK(PublishInline("grace-2", "pod-live", live));
  Subprocess* crashing = StartServer(PodSocket("pod-live"));
  ASSERT_TRUE(WithDeadline([&] { return ReadFile(live + "/hello.txt"); }).has_value());
  crashing->Signal(SIGKILL);
  ASSERT_TRUE(WaitForAgentLog("FuseServerNotConnected: the FUSE server of volume grace-2 stopped")) << agent_->Stderr();
  EXPECT_EQ(AgentLogCount("the FUSE server of volume grace-1 stopped"), 0) << agent_->Stderr();
  StartServer(PodSocket("pod-live"));
  ASSERT_TRUE(WithDeadline([&] { return ReadFile(live + "/hello.txt"); }).has_value());
}

// Issue 18 item 3: a server that dies and is back (serving) before the grace ends is no Warning;
// the old code posted FuseServerNotConnected ~2 s after the volume had already recovered.
TEST_F(RecoveryE2ETest, AServerBackWithinTheGraceIsNoWarning) {
  StartAgent({"--server_gone_grace_ms=1000"});
  const std::string target = Pod("pod-back", "back-1");
  ASSERT_RPC_OK(PublishInline("back-1", "pod-back", target));
  Subprocess* first = StartServer(PodSocket("pod-back"));
  auto reader = PodReader(target, "hello.txt");
  const std::string want = "hello from the export\n";
  ASSERT_TRUE(reader->WaitForReadsOf(want)) << reader->setup_error() << first->Stderr();
  first->Signal(SIGKILL);
  ASSERT_TRUE(first->Wait(std::chrono::milliseconds(20000)).has_value());
  ASSERT_TRUE(WaitForAgentLog("volume back-1: the FUSE server")) << agent_->Stderr();
  Subprocess* second = StartServer(PodSocket("pod-back"));
  ASSERT_TRUE(reader->WaitForReadsOf(want)) << second->Stderr() << agent_->Stderr();
  ASSERT_TRUE(WaitForAgentLog("volume back-1: its FUSE server is back within")) << agent_->Stderr();
  EXPECT_EQ(AgentLogCount("FuseServerNotConnected"), 0) << agent_->Stderr();
  reader->Stop();
  ASSERT_RPC_OK(Unpublish("back-1", target));
}

// Issue 19 item 3: a launched program that takes the connection and dies before it answers
// FUSE_INIT left the pod's reads waiting forever. Now the volume is given up on within
// --handoff_timeout_ms as if no server had come (ENOTCONN, a Warning quoting the program's last
// words), and heals when a working server comes.
TEST_F(RecoveryE2ETest, AProgramThatDiesBeforeServingFailsFastAndHealsLater) {
  StartAgent({"--handoff_timeout_ms=1000"});
  const std::string target = Pod("pod-die", "die-1");
  ASSERT_RPC_OK(PublishInline("die-1", "pod-die", target));
  const std::string socket = PodSocket("pod-die");
  Subprocess* broken = StartServer(socket, {"launch", "--", "/bin/sh", "-c", "echo cannot reach the bucket >&2; exit 3"});
  ASSERT_TRUE(broken->Wait(std::chrono::milliseconds(20000)).has_value());
  ASSERT_TRUE(WaitForAgentLog("FuseServerNotServing")) << agent_->Stderr();
  const std::string log = agent_->Stderr();
  EXPECT_TRUE(absl::StrContains(log, "sh exited with status 3")) << log;
  EXPECT_TRUE(absl::StrContains(log, "its last words: cannot reach the bucket")) << log;
  // Reads fail fast now instead of waiting forever.
  auto failed = WithDeadline([&] {
    int fd = open((target + "/hello.txt").c_str(), O_RDONLY | O_CLOEXEC);
    const int err = fd < 0 ? errno : 0;
    if (fd >= 0) close(fd);
    return err;
  });
  ASSERT_TRUE(failed.has_value()) << "the read still hangs";
  EXPECT_EQ(*failed, ENOTCONN);
  // A working server heals it.
  auto view = PodReader(target, "hello.txt");
  Subprocess* good = StartServer(socket);
  ASSERT_TRUE(view->WaitForReadsOf("hello from the export\n")) << good->Stderr() << agent_->Stderr();
  view->Stop();
  ASSERT_RPC_OK(Unpublish("die-1", target));
}

TEST_F(RecoveryE2ETest, PodsWhoseContainersRecoveryCannotReachAreNamed) {
  FakeKube& kube = StartKube();
  // Pod "web" mounts an inline volume of ours and a claim bound to a PV of ours; container
  // "app" without propagation, "good" with it. The claim is answered by the API server double.
  kube.SetPods(R"({"kind":"PodList","items":[
    {"metadata":{"namespace":"default","name":"web","uid":"pod-w"},
     "spec":{"volumes":[{"name":"data","csi":{"driver":"fusekeeper.csi"}},
                        {"name":"claimed","persistentVolumeClaim":{"claimName":"my-claim"}}],
             "containers":[{"name":"app","volumeMounts":[{"name":"data","mountPath":"/d"},{"name":"claimed","mountPath":"/c"}]},
                           {"name":"good","volumeMounts":[{"name":"data","mountPath":"/d","mountPropagation":"HostToContainer"}]}]}}]})");
  kube.SetPvcs({{"default/my-claim", "pv-9"}});
  StartAgent({"--kube_secrets_dir=" + secrets_, "--metrics_address=127.0.0.1:0", "--kubelet_url=" + kube.url() + "/pods",
              "--kubelet_ca_file=" + kube.ca_file(), "--kubelet_poll_period_ms=50"});
  ASSERT_RPC_OK(PublishInline("inline-w", "pod-w", Pod("pod-w", "data")));
  const std::string staging = StagingPath("vol-9");
  ASSERT_RPC_OK(StageFuse("vol-9", staging));
  ASSERT_RPC_OK(PublishStaged("vol-9", staging, Pod("pod-w", "pv-9"), "web", "pod-w"));
  ASSERT_TRUE(WaitForAgentLog("RecoveryCannotReachContainer")) << agent_->Stderr() << kube.Diagnostics();
  const std::string log = agent_->Stderr();
  EXPECT_TRUE(absl::StrContains(log, "container app mounts volume data with mountPropagation None")) << log;
  EXPECT_TRUE(absl::StrContains(log, "container app mounts volume claimed with mountPropagation None")) << log;
  EXPECT_FALSE(absl::StrContains(log, "container good mounts")) << log;
  // One Warning for the pod, on the API server, however many polls see it.
  std::vector<std::string> posts;
  const auto deadline = std::chrono::steady_clock::now() + kTestDeadline;
  while (posts.empty() && std::chrono::steady_clock::now() < deadline) {
    ASSERT_TRUE(kube.WaitForRequests(kube.requests() + 1));
    for (const auto& line : kube.Log()) {
      if (absl::StrContains(line, "RecoveryCannotReachContainer") && absl::StrContains(line, "\"verb\": \"POST\"")) {
        posts.push_back(line);
      }
    }
  }
  ASSERT_EQ(posts.size(), 1u);
  EXPECT_TRUE(absl::StrContains(posts[0], "\\\"name\\\":\\\"web\\\"")) << posts[0];
  EXPECT_TRUE(absl::StrContains(posts[0], "\\\"type\\\":\\\"Warning\\\"")) << posts[0];
  ASSERT_TRUE(kube.WaitForRequests(kube.requests() + 3));  // later polls post nothing more
  EXPECT_EQ(AgentLogCount("RecoveryCannotReachContainer"), 1);
  const size_t at = log.find("(port ");
  ASSERT_NE(at, std::string::npos);
  EXPECT_TRUE(absl::StrContains(HttpGet(std::stoi(log.substr(at + 6)), "/metrics"),
                                "fusekeeper_pods_unreachable_by_recovery 1"));
}

TEST_F(RecoveryE2ETest, AgentKilledRightAfterStackingAFreshConnectionHealsAfterRestart) {
  agent_env_ = {"FUSEKEEPER_CRASH_AT=recovery-fresh-mounted"};
  StartAgent();
  auto [t1, t2] = StageAndPublishTwo("crash-2");
  Subprocess* first = StartServer(socket_);
  const std::string want = "hello from the export\n";
  auto p1 = PodReader(t1, "hello.txt");
  auto p2 = PodReader(t2, "hello.txt");
  ASSERT_TRUE(p1->WaitForReadsOf(want)) << p1->setup_error() << first->Stderr();
  ASSERT_TRUE(p2->WaitForReadsOf(want));
  // The connection is aborted; the agent stacks a fresh one on the global mount and is killed
  // before it records it (the fresh connection dies with it: nothing else holds its fd).
  struct stat st;
  ASSERT_EQ(stat(staging_.c_str(), &st), 0);
  ASSERT_TRUE(AbortFuseConnectionBlocking(minor(st.st_dev)).ok());
  ASSERT_TRUE(agent_->Wait(std::chrono::milliseconds(20000)).has_value()) << agent_->Stderr();
  agent_env_.clear();
  StartAgent({"--redeposit_wait_ms=100"});
  // The server, asking for the volume's next connection since the abort, gets a fresh one from
  // the restarted agent: both running pods read through it.
  ASSERT_TRUE(first->WaitForStderr("serving volume crash-2", 2, kTestDeadline)) << first->Stderr() << agent_->Stderr();
  ASSERT_TRUE(p1->WaitForReadsOf(want)) << first->Stderr() << agent_->Stderr();
  ASSERT_TRUE(p2->WaitForReadsOf(want));
  EXPECT_EQ(MountCountAt(staging_), 2) << "the dead layer was removed: base + live";
  EXPECT_EQ(MountCountAt(t1), 2);
  EXPECT_EQ(MountCountAt(t2), 2);
  p1->Stop();
  p2->Stop();
  ASSERT_RPC_OK(Unpublish("crash-2", t1));
  ASSERT_RPC_OK(Unpublish("crash-2", t2));
  ASSERT_RPC_OK(Unstage("crash-2", staging_));
  EXPECT_EQ(MountCountAt(staging_), 0);
  EXPECT_EQ(MountCountAt(t1), 0);
}

// The kubelet stops a deleted pod's sidecar seconds after the deletion, often before the agent's
// next poll of the kubelet: the pod list the agent last read still shows the pod running. A
// server that stops is looked at again with a fresh pod list before it is called a failure.
TEST_F(RecoveryE2ETest, ASidecarStoppedLongBeforeItsUnpublishIsNoWarningWhenItsPodIsBeingDeleted) {
  FakeKube& kube = StartKube();
  kube.SetPods(R"({"kind":"PodList","items":[{"metadata":{"namespace":"default","name":"del","uid":"pod-del"}}]})");
  StartAgent({"--kubelet_url=" + kube.url() + "/pods", "--kubelet_ca_file=" + kube.ca_file(),
              "--kubelet_poll_period_ms=3600000", "--server_gone_grace_ms=100"});
  const std::string target = Pod("pod-del", "del-1");
  ASSERT_RPC_OK(PublishInline("del-1", "pod-del", target));
  Subprocess* sidecar = StartServer(PodSocket("pod-del"));
  ASSERT_TRUE(WithDeadline([&] { return ReadFile(target + "/hello.txt"); }).has_value());
  ASSERT_TRUE(kube.WaitForRequestsWith("req GET /pods", 1)) << "the agent has read the pod list";
  // The deletion: the kubelet lists the pod as terminating, then stops its sidecar.
  kube.SetPods(R"({"kind":"PodList","items":[
    {"metadata":{"namespace":"default","name":"del","uid":"pod-del","deletionTimestamp":"2026-11-29T00:00:00Z"}}]})");
  sidecar->Signal(SIGTERM);
  ASSERT_TRUE(sidecar->Wait(std::chrono::milliseconds(20000)).has_value());
  ASSERT_TRUE(WaitForAgentLog("stopped while its pod is terminating: no Warning")) << agent_->Stderr();
  EXPECT_EQ(AgentLogCount("FuseServerNotConnected"), 0) << agent_->Stderr();
  ASSERT_RPC_OK(Unpublish("del-1", target));
  // A crash of a pod that is not being deleted is still a Warning, after the same fresh look.
  kube.SetPods(R"({"kind":"PodList","items":[{"metadata":{"namespace":"default","name":"live","uid":"pod-live"}}]})");
  const std::string live = Pod("pod-live", "del-2");
  ASSERT_RPC_OK(PublishInline("del-2", "pod-live", live));
  Subprocess* crashing = StartServer(PodSocket("pod-live"));
  ASSERT_TRUE(WithDeadline([&] { return ReadFile(live + "/hello.txt"); }).has_value());
  crashing->Signal(SIGKILL);
  ASSERT_TRUE(WaitForAgentLog("FuseServerNotConnected: the FUSE server of volume del-2 stopped")) << agent_->Stderr();
  StartServer(PodSocket("pod-live"));
  ASSERT_TRUE(WithDeadline([&] { return ReadFile(live + "/hello.txt"); }).has_value());
}

TEST_F(RecoveryE2ETest, AServerOfATerminatingPodStoppingIsNoWarning) {
  FakeKube& kube = StartKube();
  // The kubelet lists the pod as being deleted.
  kube.SetPods(R"({"kind":"PodList","items":[
    {"metadata":{"namespace":"default","name":"bye","uid":"pod-bye","deletionTimestamp":"2026-11-23T00:00:00Z"}}]})");
  StartAgent({"--kubelet_url=" + kube.url() + "/pods", "--kubelet_ca_file=" + kube.ca_file(),
              "--kubelet_poll_period_ms=20", "--server_gone_grace_ms=100"});
  const std::string target = Pod("pod-bye", "term-1");
  ASSERT_RPC_OK(PublishInline("term-1", "pod-bye", target));
  Subprocess* sidecar = StartServer(PodSocket("pod-bye"));
  ASSERT_TRUE(WithDeadline([&] { return ReadFile(target + "/hello.txt"); }).has_value());
  ASSERT_TRUE(kube.WaitForRequestsWith("req GET /pods", 2)) << "the agent has read the pod list";
  sidecar->Signal(SIGTERM);
  ASSERT_TRUE(WaitForAgentLog("stopped while its pod is terminating: no Warning")) << agent_->Stderr();
  EXPECT_EQ(AgentLogCount("FuseServerNotConnected"), 0) << agent_->Stderr();
  ASSERT_RPC_OK(Unpublish("term-1", target));
}

// After a reboot FUSE connection numbers are reused: a volume's saved number may now belong to
// another program's file system, which the agent's start-up repair must not abort.
TEST_F(RecoveryE2ETest, AfterARebootARepairNeverAbortsAConnectionThatIsNotAtTheVolumesPath) {
  StartAgent();
  auto [t1, t2] = StageAndPublishTwo("reboot-1");
  Subprocess* first = StartServer(socket_);
  ASSERT_TRUE(WithDeadline([&] { return ReadFile(t1 + "/hello.txt"); }).has_value()) << first->Stderr();
  // "Reboot": the agent and the server die, and the volume's mounts are gone.
  agent_->Signal(SIGKILL);
  ASSERT_TRUE(agent_->Wait(std::chrono::milliseconds(20000)).has_value());
  first->Signal(SIGKILL);
  ASSERT_TRUE(first->Wait(std::chrono::milliseconds(20000)).has_value());
  for (const std::string& p : {t1, t2, staging_}) {
    while (MountCountAt(p) > 0) ASSERT_EQ(umount2(p.c_str(), MNT_DETACH), 0) << p;
  }
  // Another program's FUSE file system, whose connection number the saved state now names.
  const std::string other_dir = root_.path() + "/other";
  fs::create_directories(other_dir);
  auto dev = OpenFuseDeviceBlocking();
  ASSERT_TRUE(dev.ok());
  UniqueFd dir(open(other_dir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  FuseMountOptions mo;
  mo.subtype = "otherfs";
  ASSERT_TRUE(MountFuseBlocking(dev->get(), dir.get(), other_dir, mo).ok());
  auto other = std::make_unique<HelloFuseServer>(dev->Release(), "someone else's data\n");
  struct stat st;
  ASSERT_EQ(stat(other_dir.c_str(), &st), 0);
  // However the test ends, that server's connection ends first (its thread is joined).
  struct EndOther {
    std::unique_ptr<HelloFuseServer>& server;
    uint32_t minor;
    ~EndOther() {
      AbortFuseConnectionBlocking(minor);
      server.reset();
    }
  } end_other{other, minor(st.st_dev)};
  {
    auto store = StateStore::Open(state_);
    ASSERT_TRUE(store.ok()) << store.status();
    std::vector<std::string> problems;
    auto volumes = store->LoadAllBlocking(&problems);
    ASSERT_TRUE(volumes.ok() && volumes->size() == 1u);
    state::Volume v = (*volumes)[0];
    v.mutable_staging_mount()->set_dev_minor(minor(st.st_dev));
    for (auto& t : *v.mutable_targets()) t.mutable_mount()->set_dev_minor(minor(st.st_dev));
    ASSERT_TRUE(store->SaveBlocking(v).ok());
  }
  StartAgent();
  // The start-up audit finds the global mount gone and mounts a fresh connection...
  ASSERT_TRUE(WaitForAgentLog("fresh FUSE connection mounted at")) << agent_->Stderr();
  EXPECT_TRUE(WaitForAgentLog("not aborting FUSE connection " + std::to_string(minor(st.st_dev)))) << agent_->Stderr();
  // ... and the other file system still answers.
  auto read = WithDeadline([&] { return ReadFile(other_dir + "/hello"); });
  ASSERT_TRUE(read.has_value());
  EXPECT_EQ(*read, "someone else's data\n");
  // The volume works again once a server connects; unpublish/unstage abort only their own.
  StartServer(socket_);
  ASSERT_TRUE(WithDeadline([&] { return ReadFile(staging_ + "/hello.txt"); }).has_value());
  ASSERT_RPC_OK(Unpublish("reboot-1", t1));
  ASSERT_RPC_OK(Unpublish("reboot-1", t2));
  ASSERT_RPC_OK(Unstage("reboot-1", staging_));
  read = WithDeadline([&] { return ReadFile(other_dir + "/hello"); });
  ASSERT_TRUE(read.has_value());
  EXPECT_EQ(*read, "someone else's data\n");
}

TEST_F(RecoveryE2ETest, AgentKilledDuringARecoveryFinishesItAfterRestart) {
  agent_env_ = {"FUSEKEEPER_CRASH_AT=recovery-rebound-one"};
  StartAgent();
  auto [t1, t2] = StageAndPublishTwo("crash-1");
  { std::ofstream(export_ + "/hello") << "export hello\n"; }
  Subprocess* first = StartServer(socket_);
  auto p1 = PodReader(t1, "hello");
  auto p2 = PodReader(t2, "hello");
  ASSERT_TRUE(p1->WaitForReadsOf("export hello\n")) << p1->setup_error() << first->Stderr();
  ASSERT_TRUE(p2->WaitForReadsOf("export hello\n"));
  // Someone else mounts a new connection on the global path; the agent starts re-binding and
  // is killed (SIGKILL) right after the first target.
  auto server = MountOtherServerOnStaging("served by the other pod\n");
  ASSERT_NE(server, nullptr);
  ASSERT_TRUE(agent_->Wait(std::chrono::milliseconds(20000)).has_value()) << agent_->Stderr();
  // Restarted (as the DaemonSet would), the agent finishes the recovery by itself.
  agent_env_.clear();
  StartAgent();
  ASSERT_TRUE(p1->WaitForReadsOf("served by the other pod\n")) << agent_->Stderr();
  ASSERT_TRUE(p2->WaitForReadsOf("served by the other pod\n")) << agent_->Stderr();
  EXPECT_EQ(MountCountAt(t1), 2);
  EXPECT_EQ(MountCountAt(t2), 2);
  p1->Stop();
  p2->Stop();
  // Both targets are still known: kubelet's unpublish works and leaves nothing behind.
  ASSERT_RPC_OK(Unpublish("crash-1", t1));
  ASSERT_RPC_OK(Unpublish("crash-1", t2));
  EXPECT_EQ(MountCountAt(t1), 0);
  EXPECT_EQ(MountCountAt(t2), 0);
  EndOtherServer(std::move(server));
}

// Issue 27 part 3: a server that takes the connection and never answers FUSE_INIT left every
// access to the mount (a container's, kubelet's stat) waiting forever. With --init_timeout_ms
// the agent aborts that connection at the deadline: stat and statfs of the target return
// ENOTCONN, stats say why, a Warning names the server, and the next working server heals the
// same pod view.
struct SilentServer {
  const char* name;
  std::vector<std::string> mode;  // fkserve's arguments after --socket
  bool inline_volume;             // a sidecar's inline volume (else staged, a node-level server)
};

class SilentServerTest : public RecoveryE2ETest, public ::testing::WithParamInterface<SilentServer> {};

TEST_P(SilentServerTest, IsAbortedAtTheInitDeadlineReportedAndHealedByTheNextServer) {
  const SilentServer& param = GetParam();
  FakeKube& kube = StartKube();
  StartAgent({"--kube_secrets_dir=" + secrets_, "--metrics_address=127.0.0.1:0", "--init_timeout_ms=1500"});
  const std::string id = std::string("silent-") + param.name;
  const std::string target = Pod("pod-s", id);
  std::string socket;
  if (param.inline_volume) {
    ASSERT_RPC_OK(PublishInline(id, "pod-s", target));
    socket = PodSocket("pod-s");
  } else {
    staging_ = StagingPath(id);
    ASSERT_RPC_OK(StageFuse(id, staging_));
    ASSERT_RPC_OK(PublishStaged(id, staging_, target, "web", "pod-s"));
    socket = StagedSocket(id);
  }
  Subprocess* silent = StartServer(socket, param.mode);
  ASSERT_TRUE(WaitForAgentLog("volume " + id + " handed to")) << silent->Stderr() << agent_->Stderr();
  // A container's view made while the silent server holds the connection: the one healed below.
  auto view = PodReader(target, "hello.txt");
  // What kubelet and containers do first: stat and statfs of the target. They wait for the
  // deadline, then fail fast, instead of hanging.
  const std::string stat_view = root_.path() + "/views/stat";
  fs::create_directories(stat_view);
  auto st = Reader::StatInPod(target, stat_view, std::chrono::seconds(15));
  ASSERT_TRUE(st.has_value()) << "stat/statfs of the target still hang\n" << silent->Stderr() << agent_->Stderr();
  EXPECT_EQ(st->first, ENOTCONN) << strerror(st->first);
  EXPECT_EQ(st->second, ENOTCONN) << strerror(st->second);
  // Stats say why.
  const NodeGetVolumeStatsResponse stats = Stats(id, target);
  EXPECT_TRUE(stats.volume_condition().abnormal());
  EXPECT_TRUE(absl::StrContains(stats.volume_condition().message(), "did not answer the kernel's first requests"))
      << stats.volume_condition().message();
  EXPECT_TRUE(absl::StrContains(stats.volume_condition().message(), "fkserve")) << "names the server: "
                                                                                << stats.volume_condition().message();
  // A Warning: on the API server for a pod the volume records by name (staged), in the log for
  // every volume.
  ASSERT_TRUE(WaitForAgentLog("FuseServerNotAnswering: its FUSE server (fkserve")) << agent_->Stderr();
  if (!param.inline_volume) {
    EXPECT_TRUE(kube.WaitUntil([&] {
      for (const auto& line : kube.Log()) {
        if (absl::StrContains(line, "\\\"reason\\\":\\\"FuseServerNotAnswering") &&
            absl::StrContains(line, "\\\"type\\\":\\\"Warning")) {
          return true;
        }
      }
      return false;
    })) << kube.Diagnostics() << agent_->Stderr();
  }
  const std::string log = agent_->Stderr();
  const size_t at = log.find("(port ");
  ASSERT_NE(at, std::string::npos);
  EXPECT_TRUE(absl::StrContains(HttpGet(std::stoi(log.substr(at + 6)), "/metrics"),
                                "fusekeeper_fuse_servers_not_answering_total 1"));
  // A server that answers heals the mount, in the view made before.
  Subprocess* good = StartServer(socket);
  ASSERT_TRUE(view->WaitForReadsOf("hello from the export\n")) << view->setup_error() << good->Stderr()
                                                               << agent_->Stderr();
  view->Stop();
  auto healed = Reader::StatInPod(target, stat_view, std::chrono::seconds(15));
  ASSERT_TRUE(healed.has_value());
  EXPECT_EQ(healed->first, 0) << strerror(healed->first);
  EXPECT_EQ(healed->second, 0) << strerror(healed->second);
  EXPECT_FALSE(Stats(id, target).volume_condition().abnormal()) << Stats(id, target).volume_condition().message();
  ASSERT_RPC_OK(Unpublish(id, target));
  if (!param.inline_volume) ASSERT_RPC_OK(Unstage(id, staging_));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, SilentServerTest,
    ::testing::Values(
        // Relayed: the launcher relays the connection to a program that never reads it.
        SilentServer{"relayed", {"launch", "--", "/bin/sh", "-c", "exec sleep 3600", "/dev/fd/{fd}"}, false},
        // Direct: the program holds the connection itself (as an inline volume's sidecar).
        SilentServer{"direct", {"--direct", "launch", "--", "/bin/sh", "-c", "exec sleep 3600", "/dev/fd/{fd}"}, true},
        // A program given a directory that never mounts it (never asks fkserve's fusermount).
        SilentServer{"never_mounts", {"launch", "--", "/bin/sh", "-c", "exec sleep 3600", "{mountpoint}"}, false}),
    [](const ::testing::TestParamInfo<SilentServer>& info) { return std::string(info.param.name); });

// The deadline's other side: a server that answers late but within it is left alone, and a
// volume unstaged while its server has not answered yet is simply gone (nothing fires later).
// Volume "barrier", whose silent server connects last, is aborted at its deadline: by then the
// others' deadlines have passed too.
TEST_F(RecoveryE2ETest, TheInitDeadlineSparesALateAnswerAndAVolumeUnstagedBeforeIt) {
  StartAgent({"--metrics_address=127.0.0.1:0", "--init_timeout_ms=4000"});
  const std::string hello = root_.path() + "/hello_fuse";
  fs::copy_file(RunfilePath("tests/testing/hello_fuse"), hello);
  chmod(hello.c_str(), 0755);
  auto stage = [&](const std::string& id) {
    const std::string staging = StagingPath(id);
    EXPECT_TRUE(StageFuse(id, staging).ok());
    return staging;
  };
  const std::string late = stage("late"), gone = stage("gone"), barrier = stage("barrier");
  // Answers FUSE_INIT a second after it took the connection.
  StartServer(StagedSocket("late"), {"launch", "--", "/bin/sh", "-c", "sleep 1; exec " + hello + " \"$0\" late", "/dev/fd/{fd}"});
  StartServer(StagedSocket("gone"), {"launch", "--", "/bin/sh", "-c", "exec sleep 3600", "/dev/fd/{fd}"});
  ASSERT_TRUE(WaitForAgentLog("volume gone handed to")) << agent_->Stderr();
  ASSERT_RPC_OK(Unstage("gone", gone));
  EXPECT_TRUE(absl::StrContains(agent_->Stderr(), "no longer waiting for " + gone)) << agent_->Stderr();
  ASSERT_TRUE(WaitForAgentLog("volume late handed to")) << agent_->Stderr();
  StartServer(StagedSocket("barrier"), {"launch", "--", "/bin/sh", "-c", "exec sleep 3600", "/dev/fd/{fd}"});
  ASSERT_TRUE(WaitForAgentLog("volume late: its FUSE server (fkserve")) << agent_->Stderr();
  ASSERT_TRUE(WaitForAgentLog("FuseServerNotAnswering")) << agent_->Stderr();
  const std::string log = agent_->Stderr();
  EXPECT_TRUE(absl::StrContains(log, "FuseServerNotAnswering: its FUSE server (fkserve")) << log;
  EXPECT_TRUE(absl::StrContains(log, "took the connection of volume barrier")) << log;
  EXPECT_EQ(AgentLogCount("FuseServerNotAnswering"), 1) << log;
  EXPECT_TRUE(absl::StrContains(log, "volume late: its FUSE server (fkserve")) << log;
  EXPECT_TRUE(absl::StrContains(log, "answered the kernel's first requests")) << log;
  auto read = WithDeadline([&] { return ReadFile(late + "/hello"); });
  ASSERT_TRUE(read.has_value());
  EXPECT_EQ(*read, "late");
  EXPECT_FALSE(Stats("late", late).volume_condition().abnormal());
  const size_t at = log.find("(port ");
  ASSERT_NE(at, std::string::npos);
  EXPECT_TRUE(absl::StrContains(HttpGet(std::stoi(log.substr(at + 6)), "/metrics"),
                                "fusekeeper_fuse_servers_not_answering_total 1"));
  ASSERT_RPC_OK(Unstage("late", late));
  ASSERT_RPC_OK(Unstage("barrier", barrier));
}

}  // namespace
}  // namespace fusekeeper
