// Issue 30 part 1: FUSE passthrough brokered by the agent, end to end: the real agent, `fkserve
// serve` as the unprivileged server, real connections in a private mount namespace. The server
// asks the agent to register each file it opens; the kernel then reads, writes and maps the file
// itself, as the server's user. Checked through a pod view and from the node: the bytes, the
// backing files' owner, and that an open file keeps working while its server is dead, across an
// adoption, an agent restart and a fresh-connection repair.
#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <future>
#include <string>

#include "absl/strings/match.h"
#include "agent/fuse/fuse_mount.h"
#include "tests/volume/fuse_fixture.h"
#include "tests/volume/pod_app.h"
#include "tests/volume/pod_reader.h"

namespace fusekeeper {
namespace {

class PassthroughE2ETest : public FuseE2ETest {
 protected:
  void SetUp() override {
    FuseE2ETest::SetUp();
    if (IsSkipped()) return;
    StartAgent();
    target_ = Pod("pod-p", "pt-1");
    ASSERT_RPC_OK(PublishInline("pt-1", "pod-p", target_));
    socket_ = PodSocket("pod-p");
  }
  bool AgentSaid(const std::string& what, int n = 1) {
    return agent_->WaitForStderr(what, n, std::chrono::duration_cast<std::chrono::milliseconds>(kTestDeadline));
  }
  // What the file holds, read with read(2) through the mount.
  static std::string ReadAll(int fd) {
    std::string out;
    char buf[65536];
    ssize_t n;
    for (off_t off = 0; (n = pread(fd, buf, sizeof(buf), off)) > 0; off += n) out.append(buf, static_cast<size_t>(n));
    return out;
  }
  std::string target_, socket_;
};

TEST_F(PassthroughE2ETest, ReadsWritesAndMapsGoToTheBackingFileAsTheServersUser) {
  Subprocess* server = StartServer(socket_);
  const std::string want = "hello from the export\n";
  auto view = PodReader(target_, "hello.txt");
  ASSERT_TRUE(view->WaitForReadsOf(want)) << view->setup_error() << server->Stderr() << agent_->Stderr();
  ASSERT_TRUE(AgentSaid("registered its first backing file")) << agent_->Stderr() << server->Stderr();
  // A write through the mount lands in the export, owned by the server's user, and reads back
  // through read(2) and through a mapping.
  const std::string data(3 << 20, 'x');
  {
    UniqueFd w(open((target_ + "/new.bin").c_str(), O_CREAT | O_WRONLY | O_TRUNC | O_CLOEXEC, 0644));
    ASSERT_TRUE(w) << strerror(errno) << agent_->Stderr();
    ASSERT_EQ(write(w.get(), data.data(), data.size()), static_cast<ssize_t>(data.size()));
    ASSERT_EQ(fsync(w.get()), 0);
  }
  EXPECT_EQ(ReadFile(export_ + "/new.bin"), data) << "the bytes are in the backing file";
  struct stat st;
  ASSERT_EQ(stat((export_ + "/new.bin").c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, kServerUid) << "created as the server's user, not the agent's root";
  UniqueFd r(open((target_ + "/new.bin").c_str(), O_RDONLY | O_CLOEXEC));
  ASSERT_TRUE(r);
  EXPECT_EQ(ReadAll(r.get()), data);
  void* map = mmap(nullptr, data.size(), PROT_READ, MAP_SHARED, r.get(), 0);
  ASSERT_NE(map, MAP_FAILED) << strerror(errno);
  EXPECT_EQ(std::string(static_cast<const char*>(map), data.size()), data) << "mapped reads";
  munmap(map, data.size());
  // Passed through: with the server stopped, files opened by OPEN and by CREATE still read.
  {
    UniqueFd c(open((target_ + "/created.bin").c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0644));
    ASSERT_TRUE(c);
    ASSERT_EQ(pwrite(c.get(), "abc", 3, 0), 3);
    server->Signal(SIGSTOP);
    auto a = std::async(std::launch::async, [fd = r.get()] { char b[4]; return pread(fd, b, 4, 0); });
    auto b = std::async(std::launch::async, [fd = c.get()] { char b[3]; return pread(fd, b, 3, 0); });
    const bool opened_ok = a.wait_for(std::chrono::seconds(3)) == std::future_status::ready;
    const bool created_ok = b.wait_for(std::chrono::seconds(3)) == std::future_status::ready;
    server->Signal(SIGCONT);
    EXPECT_TRUE(opened_ok) << "a file opened by OPEN read through the server";
    EXPECT_TRUE(created_ok) << "a file opened by CREATE read through the server";
  }
  view->Stop();
  EXPECT_EQ(view->errors(), 0);
}

// An open file passed through keeps reading while its server is dead (the kernel reads its backing
// file itself; a write and fsync still ask the server something first, and wait for the next one), and opens after an adoption, an agent restart and a fresh-connection
// repair pass through again.
TEST_F(PassthroughE2ETest, PassesThroughAcrossAServerKillAnAgentRestartAndAFreshConnection) {
  Subprocess* first = StartServer(socket_);
  const std::string want = "hello from the export\n";
  auto view = PodReader(target_, "hello.txt");
  ASSERT_TRUE(view->WaitForReadsOf(want)) << view->setup_error() << agent_->Stderr();
  // The app holds kept.txt open, in a process of its own (a test process holding a FUSE file would
  // flush it as it execs the next server, and wait for a server that cannot start). Commands:
  // 'r' reads "before", 'w' writes "during" after it.
  fs::create_directories(root_.path() + "/views/app");
  PodApp app(target_, root_.path() + "/views/app", kServerUid, [](const std::string& view_dir, int out) {
    const int fd = open((view_dir + "/kept.txt").c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0644);
    if (fd < 0 || pwrite(fd, "before", 6, 0) != 6) return PodApp::Report(out, PodApp::Err("open+write kept.txt"));
    PodApp::Report(out, "+");
    while (true) {
      pollfd p{out, POLLIN, 0};
      if (poll(&p, 1, -1) < 0) continue;
      const char c = PodApp::NextCommand(out);
      char buf[6] = {};
      if (c == 'r') PodApp::Report(out, pread(fd, buf, 6, 0) == 6 && std::string(buf, 6) == "before" ? "=ok" : "=failed");
      if (c == 'w') PodApp::Report(out, pwrite(fd, "during", 6, 6) == 6 ? "=ok" : "=failed");
      if (c == 0) return;  // the test ended
    }
  });
  ASSERT_TRUE(app.WaitForSteps(1)) << testing::PrintToString(app.errors());
  ASSERT_TRUE(AgentSaid("registered its first backing file")) << agent_->Stderr();
  // The server is gone: the open file's reads are the kernel's and its backing file's alone.
  first->Signal(SIGKILL);
  ASSERT_TRUE(first->Wait(std::chrono::milliseconds(20000)).has_value());
  EXPECT_TRUE(app.Ask('r')) << "a read of a passed-through file waited for a server";
  // A write asks the server first whether the file carries privileges to drop (the kernel's
  // file_remove_privs: a GETXATTR of security.capability): the next server's to answer.
  Subprocess* second = StartServer(socket_);
  EXPECT_TRUE(app.Ask('w')) << second->Stderr() << agent_->Stderr();
  EXPECT_EQ(ReadFile(export_ + "/kept.txt"), "beforeduring");
  ASSERT_TRUE(view->WaitForReadsOf(want)) << "adopted\n" << second->Stderr() << agent_->Stderr();
  auto opens_pass_through = [&](const std::string& name) {
    UniqueFd g(open((target_ + "/" + name).c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0644));
    return g && pwrite(g.get(), name.data(), name.size(), 0) == static_cast<ssize_t>(name.size()) &&
           ReadFile(export_ + "/" + name) == name;
  };
  EXPECT_TRUE(opens_pass_through("after-adoption"));
  // An agent restart: the open file reads on, the server re-deposits, opens pass through.
  agent_->Signal(SIGKILL);
  ASSERT_TRUE(agent_->Wait(std::chrono::milliseconds(20000)).has_value());
  EXPECT_TRUE(app.Ask('r'));
  StartAgent();
  ASSERT_TRUE(AgentSaid("re-deposit")) << agent_->Stderr();
  EXPECT_TRUE(opens_pass_through("after-agent-restart"));
  EXPECT_TRUE(AgentSaid("registered its first backing file")) << "the restarted agent brokered it\n" << agent_->Stderr();
  // A fresh connection: its server negotiates passthrough again.
  struct stat st;
  ASSERT_EQ(stat(target_.c_str(), &st), 0);
  ASSERT_TRUE(AbortFuseConnectionBlocking(minor(st.st_dev)).ok());
  ASSERT_TRUE(second->Wait(std::chrono::milliseconds(20000)).has_value());
  Subprocess* third = StartServer(socket_);
  ASSERT_TRUE(view->WaitForReadsOf(want)) << "fresh connection\n" << third->Stderr() << agent_->Stderr();
  EXPECT_TRUE(opens_pass_through("after-fresh-connection"));
  EXPECT_TRUE(AgentSaid("registered its first backing file", 2)) << agent_->Stderr();
  view->Stop();
  EXPECT_EQ(app.error_count(), 0u) << testing::PrintToString(app.errors());
}

}  // namespace
}  // namespace fusekeeper
