// The real fusekeeper binary as a process: start-up checks, readiness, and orderly shutdown.
#include <grpcpp/grpcpp.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>

#include <fstream>

#include "agent/version.h"
#include "gtest/gtest.h"
#include "proto/csi.grpc.pb.h"
#include "tests/testing/csi_client.h"
#include "tests/testing/loop_thread.h"
#include "tests/testing/subprocess.h"

namespace fusekeeper {
namespace {

using std::chrono::milliseconds;
constexpr milliseconds kExitDeadline{20000};

std::string Agent() { return RunfilePath("agent/fusekeeper"); }

// The agent with a kubelet dir and state dir inside `dir`, plus `flags`.
std::vector<std::string> AgentCmd(const ShortTempDir& dir, std::vector<std::string> flags) {
  mkdir((dir.path() + "/kubelet").c_str(), 0755);
  std::vector<std::string> cmd = {Agent(), "--kubelet_dir=" + dir.path() + "/kubelet",
                                  "--state_dir=" + dir.path() + "/state"};
  cmd.insert(cmd.end(), flags.begin(), flags.end());
  return cmd;
}

std::shared_ptr<grpc::Channel> Dial(const std::string& socket) { return DialUnixSocket(socket); }

bool WaitReady(const std::shared_ptr<grpc::Channel>& ch) {
  return ch->WaitForConnected(std::chrono::system_clock::now() + kTestDeadline);
}

int ExitCode(std::optional<int> status) {
  EXPECT_TRUE(status.has_value()) << "process did not exit in time";
  if (!status) return -1;
  EXPECT_TRUE(WIFEXITED(*status)) << "status " << *status;
  return WEXITSTATUS(*status);
}

TEST(AgentProcessTest, ServesThenShutsDownCleanlyOnSigterm) {
  ShortTempDir dir;
  const std::string sock = dir.path() + "/csi.sock";
  Subprocess agent(AgentCmd(dir, {"--endpoint=unix://" + sock}), {"NODE_NAME=node-from-env"});
  auto ch = Dial(sock);
  ASSERT_TRUE(WaitReady(ch)) << agent.Stderr();
  auto identity = csi::v1::Identity::NewStub(ch);
  auto node = csi::v1::Node::NewStub(ch);

  csi::v1::GetPluginInfoResponse info;
  grpc::ClientContext c1;
  ASSERT_TRUE(identity->GetPluginInfo(&c1, {}, &info).ok());
  EXPECT_EQ(info.name(), "fusekeeper.csi");
  EXPECT_EQ(info.vendor_version(), kVersion);

  csi::v1::ProbeResponse probe;
  grpc::ClientContext c2;
  ASSERT_TRUE(identity->Probe(&c2, {}, &probe).ok());
  EXPECT_TRUE(probe.ready().value());

  csi::v1::NodeGetInfoResponse node_info;
  grpc::ClientContext c3;
  ASSERT_TRUE(node->NodeGetInfo(&c3, {}, &node_info).ok());
  EXPECT_EQ(node_info.node_id(), "node-from-env");  // NODE_NAME when --node_id is absent

  struct stat st;
  ASSERT_EQ(lstat(sock.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0660u);

  agent.Signal(SIGTERM);
  EXPECT_EQ(ExitCode(agent.Wait(kExitDeadline)), 0) << agent.Stderr();
  EXPECT_NE(access(sock.c_str(), F_OK), 0) << "socket left behind";
  EXPECT_NE(agent.Stderr().find("shutting down"), std::string::npos);
}

TEST(AgentProcessTest, NodeIdFlagWinsOverEnvironment) {
  ShortTempDir dir;
  const std::string sock = dir.path() + "/csi.sock";
  Subprocess agent(AgentCmd(dir, {"--endpoint=unix://" + sock, "--node_id=flag-node"}),
                   {"NODE_NAME=env-node"});
  auto ch = Dial(sock);
  ASSERT_TRUE(WaitReady(ch)) << agent.Stderr();
  csi::v1::NodeGetInfoResponse node_info;
  grpc::ClientContext c;
  ASSERT_TRUE(csi::v1::Node::NewStub(ch)->NodeGetInfo(&c, {}, &node_info).ok());
  EXPECT_EQ(node_info.node_id(), "flag-node");
  agent.Signal(SIGINT);
  EXPECT_EQ(ExitCode(agent.Wait(kExitDeadline)), 0);
}

TEST(AgentProcessTest, EndpointFromCsiEndpointEnvironment) {
  ShortTempDir dir;
  const std::string sock = dir.path() + "/env.sock";
  Subprocess agent(AgentCmd(dir, {"--node_id=n"}), {"CSI_ENDPOINT=unix://" + sock});
  ASSERT_TRUE(WaitReady(Dial(sock))) << agent.Stderr();
  agent.Signal(SIGTERM);
  EXPECT_EQ(ExitCode(agent.Wait(kExitDeadline)), 0);
}

// An agent that was serving on `sock` with state in `dir`, killed with SIGKILL.
void CrashAnAgent(const ShortTempDir& dir, const std::string& sock) {
  Subprocess crashed(AgentCmd(dir, {"--endpoint=unix://" + sock, "--node_id=n"}));
  ASSERT_TRUE(WaitReady(Dial(sock))) << crashed.Stderr();
  crashed.Signal(SIGKILL);
  ASSERT_TRUE(crashed.Wait(kExitDeadline).has_value());
}

TEST(AgentProcessTest, ReplacesAStaleSocketFromACrashedAgent) {
  ShortTempDir dir;
  const std::string sock = dir.path() + "/csi.sock";
  ASSERT_NO_FATAL_FAILURE(CrashAnAgent(dir, sock));
  ASSERT_EQ(access(sock.c_str(), F_OK), 0) << "kill -9 should leave the socket file behind";
  Subprocess agent(AgentCmd(dir, {"--endpoint=unix://" + sock, "--node_id=n"}));
  auto ch = Dial(sock);
  ASSERT_TRUE(WaitReady(ch)) << agent.Stderr();
  csi::v1::ProbeResponse probe;
  grpc::ClientContext c;
  EXPECT_TRUE(csi::v1::Identity::NewStub(ch)->Probe(&c, {}, &probe).ok());
}

TEST(AgentProcessTest, RefusesToStartWhileAnotherAgentServes) {
  ShortTempDir dir, other;
  const std::string sock = dir.path() + "/csi.sock";
  Subprocess first(AgentCmd(dir, {"--endpoint=unix://" + sock, "--node_id=n"}));
  ASSERT_TRUE(WaitReady(Dial(sock))) << first.Stderr();
  // Another state dir, the same socket: the socket says someone serves.
  Subprocess second(AgentCmd(other, {"--endpoint=unix://" + sock, "--node_id=n"}));
  EXPECT_EQ(ExitCode(second.Wait(kExitDeadline)), 4);
  EXPECT_NE(second.Stderr().find("another process is serving"), std::string::npos)
      << second.Stderr();
  // The same state dir: its lock says so before anything is touched, not even the first
  // agent's temp files (a write-then-rename in flight).
  const std::string in_flight = dir.path() + "/state/volumes/x.state.tmp.1.0";
  { std::ofstream(in_flight) << "being written"; }
  Subprocess third(AgentCmd(dir, {"--endpoint=unix://" + dir.path() + "/other.sock", "--node_id=n",
                                  "--state_lock_wait_ms=0"}));
  EXPECT_EQ(ExitCode(third.Wait(kExitDeadline)), 4);
  EXPECT_NE(third.Stderr().find("another fusekeeper agent (pid " + std::to_string(first.pid()) + " in its own pid namespace) holds"),
            std::string::npos)
      << third.Stderr();
  EXPECT_EQ(access(in_flight.c_str(), F_OK), 0) << "the refused agent removed the running one's temp file";
  EXPECT_NE(access((dir.path() + "/other.sock").c_str(), F_OK), 0);
  // The first one is unharmed.
  auto ch = Dial(sock);
  csi::v1::ProbeResponse probe;
  grpc::ClientContext c;
  EXPECT_TRUE(csi::v1::Identity::NewStub(ch)->Probe(&c, {}, &probe).ok());
}

// Two agents started at the same instant on a stale socket: exactly one runs, every time.
TEST(AgentProcessTest, TwoAgentsStartedTogetherNeverBothRun) {
  for (int round = 0; round < 10; ++round) {
    ShortTempDir dir;
    const std::string sock = dir.path() + "/csi.sock";
    ASSERT_NO_FATAL_FAILURE(CrashAnAgent(dir, sock));
    const std::vector<std::string> flags = {"--endpoint=unix://" + sock, "--node_id=n", "--state_lock_wait_ms=0"};
    Subprocess a(AgentCmd(dir, flags)), b(AgentCmd(dir, flags));
    ASSERT_TRUE(WaitReady(Dial(sock)));
    // One of them exits 4; the other keeps serving.
    std::optional<int> exited_a = a.Wait(milliseconds(0)), exited_b;
    for (auto deadline = std::chrono::steady_clock::now() + kTestDeadline;
         !exited_a && !exited_b && std::chrono::steady_clock::now() < deadline;) {
      exited_b = b.Wait(milliseconds(50));
      if (!exited_b) exited_a = a.Wait(milliseconds(50));
    }
    ASSERT_TRUE(exited_a.has_value() != exited_b.has_value()) << "round " << round << "\n" << a.Stderr() << b.Stderr();
    EXPECT_EQ(ExitCode(exited_a ? exited_a : exited_b), 4);
    csi::v1::ProbeResponse probe;
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + kTestDeadline);
    EXPECT_TRUE(csi::v1::Identity::NewStub(Dial(sock))->Probe(&c, {}, &probe).ok()) << "round " << round;
  }
}

TEST(AgentProcessTest, RefusesANonSocketFileAtTheEndpoint) {
  ShortTempDir dir;
  const std::string path = dir.path() + "/csi.sock";
  { std::ofstream(path) << "precious data"; }
  Subprocess agent(AgentCmd(dir, {"--endpoint=unix://" + path, "--node_id=n"}));
  EXPECT_NE(ExitCode(agent.Wait(kExitDeadline)), 0);
  EXPECT_NE(agent.Stderr().find("not a socket"), std::string::npos) << agent.Stderr();
  std::ifstream in(path);
  std::string content((std::istreambuf_iterator<char>(in)), {});
  EXPECT_EQ(content, "precious data");
}

TEST(AgentProcessTest, RefusesAnEndpointTooLongForSunPath) {
  ShortTempDir dir;
  std::string long_path = "/tmp/" + std::string(120, 'x') + "/csi.sock";
  Subprocess agent(AgentCmd(dir, {"--endpoint=unix://" + long_path, "--node_id=n"}));
  EXPECT_NE(ExitCode(agent.Wait(kExitDeadline)), 0);
  EXPECT_NE(agent.Stderr().find("at most 107 bytes"), std::string::npos) << agent.Stderr();
}

TEST(AgentProcessTest, RefusesAnInvalidDriverName) {
  ShortTempDir dir;
  Subprocess agent(AgentCmd(dir, {"--endpoint=unix://" + dir.path() + "/csi.sock", "--node_id=n",
                    "--driver_name=-bad name-"}));
  EXPECT_NE(ExitCode(agent.Wait(kExitDeadline)), 0);
  EXPECT_NE(agent.Stderr().find("not a valid CSI driver name"), std::string::npos)
      << agent.Stderr();
}

// Makes io_uring_setup fail with EPERM, as a container runtime's default seccomp profile does.
void DenyIoUringBySeccomp() {
  static sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  static sock_fprog prog = {sizeof(filter) / sizeof(filter[0]), filter};
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) _exit(126);
  if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0) _exit(126);
}

TEST(AgentProcessTest, SaysClearlyWhenIoUringIsBlocked) {
  ShortTempDir dir;
  const std::string sock = dir.path() + "/csi.sock";
  Subprocess agent(AgentCmd(dir, {"--endpoint=unix://" + sock, "--node_id=n"}), {},
                   DenyIoUringBySeccomp);
  int code = ExitCode(agent.Wait(kExitDeadline));
  ASSERT_NE(code, 126) << "could not install the seccomp filter";
  EXPECT_NE(code, 0);
  const std::string err = agent.Stderr();
  EXPECT_NE(err.find("io_uring unavailable"), std::string::npos) << err;
  EXPECT_NE(err.find("seccomp"), std::string::npos) << err;
  EXPECT_NE(access(sock.c_str(), F_OK), 0) << "no socket may be created when start-up fails";
}

}  // namespace
}  // namespace fusekeeper
