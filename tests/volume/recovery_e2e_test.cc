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

#include "glog/logging.h"

#include "agent/fuse/fuse_mount.h"
#include "tests/testing/hello_fuse_server.h"
#include "tests/testing/fake_kube.h"
#include "tests/volume/fuse_fixture.h"

namespace fusekeeper {
namespace {

// Reads `path` over and over (open, read, close) in a process of its own, as a pod would, and
// counts what happened. A process, not a thread: the test process forks servers, and a fork
// child inherits open FUSE files, whose close-on-exec sends FUSE_FLUSH to the very server being
// started (a deadlock no real pod has).
class Reader {
 public:
  explicit Reader(std::string path) : state_(std::make_shared<State>()) {
    state_->path = std::move(path);
    int sv[2];
    PCHECK(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) == 0);
    pid_ = fork();
    PCHECK(pid_ >= 0);
    if (pid_ == 0) {
      close(sv[0]);
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      ReadForever(state_->path.c_str(), sv[1]);
    }
    close(sv[1]);
    thread_ = std::thread([s = state_, fd = sv[0]] { Collect(*s, fd); });
  }
  ~Reader() { Stop(); }
  void Stop() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);  // a read stuck on a dead mount is killable
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
    thread_.join();
  }
  int64_t reads() const { return state_->reads; }
  int64_t errors() const { return state_->errors; }
  // Waits until `n` more successful reads of `want` in a row have happened.
  bool WaitForReadsOf(const std::string& want, int n = 5) {
    std::unique_lock<std::mutex> lock(state_->mu);
    const int64_t start = state_->last == want ? state_->matching : 0;
    return state_->cv.wait_for(lock, kTestDeadline,
                               [&] { return state_->last == want && state_->matching >= start + n; });
  }

 private:
  struct State {
    std::string path;
    std::mutex mu;
    std::condition_variable cv;
    std::atomic<int64_t> reads{0}, errors{0};
    int64_t matching = 0;
    std::string last;
  };
  // Child: one message per read: "+content" or "-errno".
  [[noreturn]] static void ReadForever(const char* path, int out) {
    char msg[512];
    while (true) {
      size_t len = 1;
      msg[0] = '+';
      int fd = open(path, O_RDONLY | O_CLOEXEC);
      ssize_t n = fd < 0 ? -1 : 0;
      while (fd >= 0 && (n = read(fd, msg + len, sizeof(msg) - len)) > 0) len += static_cast<size_t>(n);
      const int err = errno;
      if (fd >= 0) close(fd);
      if (n < 0) len = static_cast<size_t>(snprintf(msg, sizeof(msg), "-%d", err));
      if (send(out, msg, len, MSG_NOSIGNAL) < 0) _exit(0);
    }
  }
  static void Collect(State& s, int fd) {
    char msg[512];
    ssize_t n;
    while ((n = recv(fd, msg, sizeof(msg), 0)) > 0) {
      std::lock_guard<std::mutex> lock(s.mu);
      if (msg[0] == '+') {
        std::string got(msg + 1, static_cast<size_t>(n) - 1);
        ++s.reads;
        s.matching = got == s.last ? s.matching + 1 : 1;
        s.last = std::move(got);
      } else {
        ++s.errors;
        s.matching = 0;
        s.last.clear();
      }
      s.cv.notify_all();
    }
    close(fd);
  }

  std::shared_ptr<State> state_;
  pid_t pid_ = -1;
  std::thread thread_;
};

// GET http://127.0.0.1:<port><path> with a plain socket; the whole response.
std::string HttpGet(int port, const std::string& path) {
  UniqueFd s(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) return "connect failed";
  const std::string req = "GET " + path + " HTTP/1.1\r\nHost: x\r\n\r\n";
  if (write(s.get(), req.data(), req.size()) < 0) return "write failed";
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = read(s.get(), buf, sizeof(buf))) > 0) out.append(buf, static_cast<size_t>(n));
  return out;
}

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
  const std::string kube_dir = root_.path() + "/kube";
  fs::create_directories(kube_dir);
  FakeKube kube(kube_dir);
  ASSERT_TRUE(kube.ok()) << kube.Diagnostics();
  const std::string secrets = root_.path() + "/secrets";
  fs::create_directories(secrets);
  fs::copy_file(kube.ca_file(), secrets + "/ca.crt");
  { std::ofstream(secrets + "/token") << "agent-token"; }
  agent_env_ = {"KUBERNETES_SERVICE_HOST=127.0.0.1", "KUBERNETES_SERVICE_PORT=" + std::to_string(kube.port())};
  StartAgent({"--kube_secrets_dir=" + secrets, "--metrics_address=127.0.0.1:0"});
  auto [t1, t2] = StageAndPublishTwo("adopt-1");
  Subprocess* first = StartServer(socket_);
  Reader r1(t1 + "/hello.txt"), r2(t2 + "/hello.txt");
  const std::string want = "hello from the export\n";
  ASSERT_TRUE(r1.WaitForReadsOf(want)) << first->Stderr() << agent_->Stderr();
  ASSERT_TRUE(r2.WaitForReadsOf(want));
  for (int round = 0; round < 3; ++round) {
    Subprocess* dying = servers_.back().get();
    dying->Signal(SIGKILL);
    ASSERT_TRUE(dying->Wait(std::chrono::milliseconds(20000)).has_value());
    Subprocess* next = StartServer(socket_);
    ASSERT_TRUE(r1.WaitForReadsOf(want)) << "round " << round << " server status "
                                         << next->Wait(std::chrono::milliseconds(2000)).value_or(-1) << "\n"
                                         << next->Stderr() << agent_->Stderr();
    ASSERT_TRUE(r2.WaitForReadsOf(want)) << "round " << round;
  }
  r1.Stop();
  r2.Stop();
  EXPECT_EQ(r1.errors() + r2.errors(), 0) << "with the kept connection, reads wait instead of failing";
  EXPECT_GT(r1.reads(), 0);
  EXPECT_EQ(MountCountAt(t1), 1);
  EXPECT_EQ(MountCountAt(t2), 1);
  EXPECT_EQ(MountCountAt(staging_), 1) << "no remount was needed";
  ASSERT_TRUE(WaitForAgentLog("MountRecovered", 3)) << agent_->Stderr();  // one per round
  EXPECT_GE(AgentLogCount("FuseServerRestarted"), 3);
  EXPECT_EQ(AgentLogCount("MountRecoveryFailed"), 0);
  // Events on both pods: 3 rounds x 3 reasons x 2 pods, the repeats as count updates.
  ASSERT_TRUE(kube.WaitForRequests(18)) << kube.Diagnostics() << agent_->Stderr();
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
  EXPECT_EQ(posts, 6) << "one event per reason and pod";
  EXPECT_EQ(patches, 12) << "later rounds update counts";
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

TEST_F(RecoveryE2ETest, ServerThatCannotAdoptGetsAFreshConnectionAndBothTargetsAreReBound) {
  StartAgent();
  auto [t1, t2] = StageAndPublishTwo("fresh-1");
  Subprocess* first = StartServer(socket_);
  Reader r1(t1 + "/hello.txt"), r2(t2 + "/hello");
  ASSERT_TRUE(r1.WaitForReadsOf("hello from the export\n")) << first->Stderr();
  first->Signal(SIGKILL);
  ASSERT_TRUE(first->Wait(std::chrono::milliseconds(20000)).has_value());
  // A launched libfuse program cannot adopt a live connection: fkserve asks for a fresh one.
  Subprocess* second = StartLaunchedHello("relaunched\n");
  ASSERT_TRUE(r2.WaitForReadsOf("relaunched\n"))
      << "reads " << r2.reads() << " errors " << r2.errors() << " now: '" << ReadFile(t2 + "/hello") << "' errno "
      << errno << " second server: " << second->Wait(std::chrono::milliseconds(1)).value_or(-1) << " " << second->Stderr()
      << agent_->Stderr();
  r1.Stop();
  EXPECT_EQ(ReadFile(t1 + "/hello"), "relaunched\n") << "both pod targets were re-bound";
  EXPECT_EQ(MountCountAt(t1), 1) << "the stale bind was replaced, not stacked";
  EXPECT_EQ(MountCountAt(t2), 1);
  EXPECT_EQ(MountCountAt(staging_), 1) << "the old connection's mount is gone";
  ASSERT_TRUE(WaitForAgentLog("MountRecovered")) << agent_->Stderr();
  EXPECT_NE(second->Stderr().find("asking for a fresh one"), std::string::npos);
  // Unpublish and unstage still work on the repaired volume.
  r2.Stop();
  ASSERT_RPC_OK(Unpublish("fresh-1", t1));
  ASSERT_RPC_OK(Unpublish("fresh-1", t2));
  ASSERT_RPC_OK(Unstage("fresh-1", staging_));
  EXPECT_EQ(MountCountAt(staging_), 0);
}

TEST_F(RecoveryE2ETest, AbortedConnectionIsRemountedAndTheNextServerServesIt) {
  StartAgent();
  auto [t1, t2] = StageAndPublishTwo("abort-1");
  Subprocess* first = StartServer(socket_);
  Reader r1(t1 + "/hello.txt");
  ASSERT_TRUE(r1.WaitForReadsOf("hello from the export\n")) << first->Stderr();
  struct stat st;
  ASSERT_EQ(stat(staging_.c_str(), &st), 0);
  ASSERT_TRUE(AbortFuseConnectionBlocking(minor(st.st_dev)).ok());
  // The first server sees its connection end and exits; the agent mounts a fresh connection.
  ASSERT_TRUE(first->Wait(std::chrono::milliseconds(20000)).has_value());
  Subprocess* second = StartServer(socket_);
  ASSERT_TRUE(r1.WaitForReadsOf("hello from the export\n")) << second->Stderr() << agent_->Stderr();
  EXPECT_EQ(ReadFile(t2 + "/hello.txt"), "hello from the export\n");
  EXPECT_EQ(MountCountAt(staging_), 1);
  EXPECT_EQ(MountCountAt(t1), 1);
  ASSERT_TRUE(WaitForAgentLog("MountRecovered")) << agent_->Stderr();
}

TEST_F(RecoveryE2ETest, GlobalPathRemountedBySomeoneElseAllTargetsAreReBound) {
  // The kubelet is down (nothing listens): its polls fail with clear errors, and recovery by
  // mount-table events works regardless.
  StartAgent({"--kubelet_url=https://127.0.0.1:1/pods", "--kubelet_poll_period_ms=20"});
  auto [t1, t2] = StageAndPublishTwo("fluid-1");
  Subprocess* first = StartServer(socket_);
  ASSERT_TRUE(WithDeadline([&] { return ReadFile(t1 + "/hello.txt"); }).has_value()) << first->Stderr();
  // A privileged FUSE pod (as Fluid's runtimes do) mounts its own connection on the global path.
  auto server = MountOtherServerOnStaging("served by the other pod\n");
  ASSERT_NE(server, nullptr);
  Reader r1(t1 + "/hello"), r2(t2 + "/hello");
  ASSERT_TRUE(r1.WaitForReadsOf("served by the other pod\n")) << agent_->Stderr();
  ASSERT_TRUE(r2.WaitForReadsOf("served by the other pod\n"));
  EXPECT_EQ(MountCountAt(t1), 1) << "re-bound, not stacked";
  EXPECT_EQ(MountCountAt(t2), 1);
  ASSERT_TRUE(WaitForAgentLog("MountRecovered")) << agent_->Stderr();
  EXPECT_NE(agent_->Stderr().find("was replaced (fuse.otherfs)"), std::string::npos);
  ASSERT_TRUE(WaitForAgentLog("polling the kubelet at https://127.0.0.1:1/pods: ")) << agent_->Stderr();
  EXPECT_TRUE(WaitForAgentLog("recovery still works from mount-table and FUSE connection events"));
  r1.Stop();
  r2.Stop();
  EndOtherServer(std::move(server));
}

TEST_F(RecoveryE2ETest, AgentKilledDuringARecoveryFinishesItAfterRestart) {
  agent_env_ = {"FUSEKEEPER_CRASH_AT=recovery-rebound-one"};
  StartAgent();
  auto [t1, t2] = StageAndPublishTwo("crash-1");
  Subprocess* first = StartServer(socket_);
  ASSERT_TRUE(WithDeadline([&] { return ReadFile(t1 + "/hello.txt"); }).has_value()) << first->Stderr();
  // Someone else mounts a new connection on the global path; the agent starts re-binding and
  // is killed (SIGKILL) right after the first target.
  auto server = MountOtherServerOnStaging("served by the other pod\n");
  ASSERT_NE(server, nullptr);
  ASSERT_TRUE(agent_->Wait(std::chrono::milliseconds(20000)).has_value()) << agent_->Stderr();
  // Restarted (as the DaemonSet would), the agent finishes the recovery by itself.
  agent_env_.clear();
  StartAgent();
  Reader r1(t1 + "/hello"), r2(t2 + "/hello");
  ASSERT_TRUE(r1.WaitForReadsOf("served by the other pod\n")) << agent_->Stderr();
  ASSERT_TRUE(r2.WaitForReadsOf("served by the other pod\n")) << agent_->Stderr();
  EXPECT_EQ(MountCountAt(t1), 1);
  EXPECT_EQ(MountCountAt(t2), 1);
  r1.Stop();
  r2.Stop();
  // Both targets are still known: kubelet's unpublish works and leaves nothing behind.
  ASSERT_RPC_OK(Unpublish("crash-1", t1));
  ASSERT_RPC_OK(Unpublish("crash-1", t2));
  EXPECT_EQ(MountCountAt(t1), 0);
  EXPECT_EQ(MountCountAt(t2), 0);
  EndOtherServer(std::move(server));
}

}  // namespace
}  // namespace fusekeeper
