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
#include <sys/xattr.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <future>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "agent/fkserve/handoff_client.h"
#include "agent/fuse/fuse_mount.h"
#include "agent/fuse/handoff_protocol.h"
#include "agent/fuse/passthrough_abi.h"
#include "tests/testing/with_deadline.h"
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
    StartAgent({"--metrics_address=127.0.0.1:0"});
    target_ = Pod("pod-p", "pt-1");
    ASSERT_RPC_OK(PublishInline("pt-1", "pod-p", target_));
    socket_ = PodSocket("pod-p");
  }
  std::vector<std::string> Passthrough() { return {"serve", "--root=" + export_, "--passthrough"}; }
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
  // The server killed under an app holding a passed-through file, an agent restart and a fresh
  // connection; opens pass through after each.
  void AcrossAServerKillAnAgentRestartAndAFreshConnection() {
    Subprocess* first = StartServer(socket_, Passthrough());
    const std::string want = "hello from the export\n";
    auto view = PodReader(target_, "hello.txt");
    ASSERT_TRUE(view->WaitForReadsOf(want)) << view->setup_error() << agent_->Stderr();
    // The app holds kept.txt open, in a process of its own (a test process holding a FUSE file would
    // flush it as it execs the next server, and wait for a server that cannot start). Commands:
    // 'r' reads "before", 'w' writes "during" after it, 'o' opens and holds during.txt.
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
        if (c == 'o') PodApp::Report(out, open((view_dir + "/during.txt").c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0644) >= 0 ? "=ok" : "=failed");
        if (c == 0) return;  // the test ended
      }
    });
    ASSERT_TRUE(app.WaitForStepsInAll(1)) << testing::PrintToString(app.errors());
    ASSERT_TRUE(AgentSaid("registered its first backing file")) << agent_->Stderr();
    // The server is gone: the open file's reads are the kernel's and its backing file's alone.
    first->Signal(SIGKILL);
    ASSERT_TRUE(first->Wait(std::chrono::milliseconds(20000)).has_value());
    EXPECT_TRUE(app.Ask('r')) << "a read of a passed-through file waited for a server";
    // A write asks the server first whether the file carries privileges to drop (the kernel's
    // file_remove_privs: a GETXATTR of security.capability): the next server's to answer.
    Subprocess* second = StartServer(socket_, Passthrough());
    EXPECT_TRUE(app.Ask('w')) << second->Stderr() << agent_->Stderr();
    EXPECT_EQ(ReadFile(export_ + "/kept.txt"), "beforeduring");
    ASSERT_TRUE(view->WaitForReadsOf(want)) << "adopted\n" << second->Stderr() << agent_->Stderr();
    auto opens_pass_through = [&](const std::string& name) {
      UniqueFd g(open((target_ + "/" + name).c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0644));
      return g && pwrite(g.get(), name.data(), name.size(), 0) == static_cast<ssize_t>(name.size()) &&
             ReadFile(export_ + "/" + name) == name;
    };
    EXPECT_TRUE(opens_pass_through("after-adoption"));
    // The app's file, opened through the first server, is opened again: the kernel takes one
    // backing file per inode, so the second server must name the first one's (the agent kept it,
    // and the table of them the first server deposited).
    auto reopens_kept = [&] {
      UniqueFd g(open((target_ + "/kept.txt").c_str(), O_RDWR | O_CLOEXEC));
      char buf[12] = {};
      return g && pread(g.get(), buf, sizeof(buf), 0) == 12 && std::string(buf, 12) == "beforeduring";
    };
    EXPECT_TRUE(reopens_kept()) << "a file a dead server passed through opens again: " << strerror(errno) << second->Stderr();
    // An agent restart: the open file reads on, the server re-deposits, opens pass through.
    agent_->Signal(SIGKILL);
    ASSERT_TRUE(agent_->Wait(std::chrono::milliseconds(20000)).has_value());
    EXPECT_TRUE(app.Ask('r'));
    // A file opened while there is no agent is served the ordinary way (cached), and held open:
    // later opens of it must not pass through (the kernel refuses passthrough beside a cached
    // open: EIO) until it is closed.
    EXPECT_TRUE(app.Ask('o')) << "an open with the agent gone";
    StartAgent();
    ASSERT_TRUE(AgentSaid("re-deposit")) << agent_->Stderr();
    EXPECT_TRUE(opens_pass_through("after-agent-restart"));
    EXPECT_TRUE(reopens_kept()) << "after the agent's restart: " << strerror(errno);
    EXPECT_TRUE(opens_pass_through("during.txt")) << "a file held open since the agent was gone opens again: "
                                                  << strerror(errno);
    EXPECT_TRUE(AgentSaid("registered its first backing file")) << "the restarted agent brokered it\n" << agent_->Stderr();
    // A fresh connection: its server negotiates passthrough again.
    struct stat st;
    ASSERT_EQ(stat(target_.c_str(), &st), 0);
    ASSERT_TRUE(AbortFuseConnectionBlocking(minor(st.st_dev)).ok());
    // The same server takes the fresh connection the agent mounts (it asks the socket for it).
    ASSERT_TRUE(second->WaitForStderr("asking the agent for the volume's next one", 1, kTestDeadline))
        << second->Stderr();
    ASSERT_TRUE(view->WaitForReadsOf(want)) << "fresh connection\n" << second->Stderr() << agent_->Stderr();
    EXPECT_TRUE(opens_pass_through("after-fresh-connection"));
    EXPECT_TRUE(AgentSaid("registered its first backing file", 2)) << agent_->Stderr();
    view->Stop();
    EXPECT_EQ(app.error_count(), 0u) << testing::PrintToString(app.errors());
  }
  std::string target_, socket_;
};

TEST_F(PassthroughE2ETest, ReadsWritesAndMapsGoToTheBackingFileAsTheServersUser) {
  Subprocess* server = StartServer(socket_, Passthrough());
  const std::string want = "hello from the export\n";
  auto view = PodReader(target_, "hello.txt");
  ASSERT_TRUE(view->WaitForReadsOf(want)) << view->setup_error() << server->Stderr() << agent_->Stderr();
  ASSERT_TRUE(AgentSaid("registered its first backing file")) << agent_->Stderr() << server->Stderr();
  // A write through the mount lands in the export, owned by the server's user, and reads back
  // through read(2) and through a mapping.
  std::string data(3 << 20, 'x');
  {
    UniqueFd w(open((target_ + "/new.bin").c_str(), O_CREAT | O_WRONLY | O_TRUNC | O_CLOEXEC, 0644));
    ASSERT_TRUE(w) << strerror(errno) << agent_->Stderr();
    ASSERT_EQ(write(w.get(), data.data(), data.size()), static_cast<ssize_t>(data.size()));
    ASSERT_EQ(fsync(w.get()), 0);
  }
  EXPECT_EQ(ReadFile(export_ + "/new.bin"), data) << "the bytes are in the backing file";
  // Opens of one file at once share its one backing file (the kernel refuses a second one).
  {
    UniqueFd a(open((target_ + "/new.bin").c_str(), O_RDONLY | O_CLOEXEC));
    UniqueFd b(open((target_ + "/new.bin").c_str(), O_RDWR | O_CLOEXEC));
    UniqueFd c(open((target_ + "/new.bin").c_str(), O_RDONLY | O_CLOEXEC));
    ASSERT_TRUE(a && b && c) << strerror(errno) << "\n" << server->Stderr();
    char x = 0;
    EXPECT_EQ(pread(a.get(), &x, 1, 0), 1);
    EXPECT_EQ(pwrite(b.get(), "y", 1, 0), 1);
    EXPECT_EQ(pread(c.get(), &x, 1, 0), 1);
    EXPECT_EQ(x, 'y');
  }
  data[0] = 'y';
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
  AcrossAServerKillAnAgentRestartAndAFreshConnection();
}

// The same with the agent as the DaemonSet runs it: in a mount namespace of its own, a new one at
// each restart (the kubelet dir shared with the node).
class PassthroughAgentInItsOwnNamespaceTest : public PassthroughE2ETest {
 protected:
  PassthroughAgentInItsOwnNamespaceTest() { agent_prefix_ = {"/usr/bin/unshare", "-m", "--propagation", "unchanged"}; }
};

TEST_F(PassthroughAgentInItsOwnNamespaceTest, PassesThroughAcrossAServerKillAnAgentRestartAndAFreshConnection) {
  AcrossAServerKillAnAgentRestartAndAFreshConnection();
}

// Passthrough turned off on a live connection (a successor started with --passthrough=false):
// a file its predecessor left open in passthrough is opened again with its backing file (the
// kernel allows no other way), and other files are served the ordinary way.
TEST_F(PassthroughE2ETest, TurnedOffOnALiveConnectionFilesLeftOpenStillOpen) {
  Subprocess* first = StartServer(socket_, Passthrough());
  const std::string want = "hello from the export\n";
  auto view = PodReader(target_, "hello.txt");
  ASSERT_TRUE(view->WaitForReadsOf(want)) << view->setup_error() << agent_->Stderr();
  fs::create_directories(root_.path() + "/views/app");
  PodApp app(target_, root_.path() + "/views/app", kServerUid, [](const std::string& view_dir, int out) {
    const int fd = open((view_dir + "/kept.txt").c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0644);
    if (fd < 0 || pwrite(fd, "kept", 4, 0) != 4) return PodApp::Report(out, PodApp::Err("open+write kept.txt"));
    PodApp::Report(out, "+");
    pollfd p{out, POLLIN, 0};
    while (poll(&p, 1, -1) != 1 || PodApp::NextCommand(out) != 0) {
    }
  });
  ASSERT_TRUE(app.WaitForStepsInAll(1)) << testing::PrintToString(app.errors());
  ASSERT_TRUE(AgentSaid("registered its first backing file")) << agent_->Stderr();
  first->Signal(SIGKILL);
  ASSERT_TRUE(first->Wait(std::chrono::milliseconds(20000)).has_value());
  Subprocess* second = StartServer(socket_, {"serve", "--root=" + export_, "--passthrough=false"});
  ASSERT_TRUE(view->WaitForReadsOf(want)) << second->Stderr() << agent_->Stderr();
  {
    UniqueFd again(open((target_ + "/kept.txt").c_str(), O_RDWR | O_CLOEXEC));
    ASSERT_TRUE(again) << "a file left open in passthrough opens again: " << strerror(errno) << second->Stderr();
    char buf[4];
    EXPECT_EQ(pread(again.get(), buf, sizeof(buf), 0), 4);
    EXPECT_EQ(std::string(buf, 4), "kept");
  }
  {
    UniqueFd other(open((target_ + "/other-new.txt").c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0644));
    ASSERT_TRUE(other) << strerror(errno);
    EXPECT_EQ(pwrite(other.get(), "x", 1, 0), 1);
  }
  EXPECT_TRUE(absl::StrContains(second->Stderr(), "passthrough off; files the last server left open"));
  EXPECT_EQ(agent_->CountInStderr("registered its first backing file"), 1) << "the second server registered nothing\n"
                                                                   << agent_->Stderr();
  view->Stop();
}

// The agent stopped (SIGSTOP: hung): opens of new files wait for its answer once, at most 2 s,
// then are served the ordinary way without asking again for a while; none hangs or fails.
TEST_F(PassthroughE2ETest, AHungAgentDelaysOpensOnceAndFailsNone) {
  Subprocess* server = StartServer(socket_, Passthrough());
  const std::string want = "hello from the export\n";
  auto view = PodReader(target_, "hello.txt");
  ASSERT_TRUE(view->WaitForReadsOf(want)) << view->setup_error() << agent_->Stderr();
  agent_->Signal(SIGSTOP);
  for (int i = 0; i < 5; ++i) {
    const std::string name = "while-hung-" + std::to_string(i);
    auto wrote = WithDeadline([&] {
      UniqueFd f(open((target_ + "/" + name).c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0644));
      return f && pwrite(f.get(), name.data(), name.size(), 0) == static_cast<ssize_t>(name.size());
    });
    ASSERT_TRUE(wrote.has_value()) << name << ": an open waited for the hung agent past the deadline";
    EXPECT_TRUE(*wrote) << name << ": " << strerror(errno);
    EXPECT_EQ(ReadFile(export_ + "/" + name), name);
  }
  agent_->Signal(SIGCONT);
  EXPECT_TRUE(absl::StrContains(server->Stderr(), "the agent did not answer in time")) << server->Stderr();
  view->Stop();
}

// A server of our own making (the test, as root) takes the volume, answers FUSE_INIT asking for
// passthrough, and then asks the agent for what a hostile server might: each is refused with a
// reason, a proper file gets an id it can close, and no fd the agent received stays open.
TEST_F(PassthroughE2ETest, HostileBackingRequestsAreRefusedWithAReasonAndLeakNothing) {
  auto sock = ConnectToAgentBlocking(socket_, 0, std::chrono::seconds(10), [](const std::string&) {});
  ASSERT_TRUE(sock.ok()) << sock.status();
  auto handoff = ReceiveHandoffBlocking(sock->get(), "test", [](const Handoff&) { return false; });
  ASSERT_TRUE(handoff.ok()) << handoff.status();
  // FUSE_INIT, answered by hand: FUSE_PASSTHROUGH with a stack depth of 1.
  std::string in(64 * 1024, '\0');
  const ssize_t n = read(handoff->fuse.get(), in.data(), in.size());
  ASSERT_GE(n, static_cast<ssize_t>(sizeof(fuse_in_header) + sizeof(fuse_init_in)));
  fuse_in_header h;
  fuse_init_in init;
  memcpy(&h, in.data(), sizeof(h));
  memcpy(&init, in.data() + sizeof(h), sizeof(init));
  ASSERT_EQ(h.opcode, FUSE_INIT);
  ASSERT_TRUE((init.flags & FUSE_INIT_EXT) && ((uint64_t{init.flags2} << 32) & kInitFusePassthrough))
      << "the kernel offers passthrough";
  struct {
    fuse_out_header h;
    fuse_init_out o;
  } reply{};
  reply.h = {sizeof(reply), 0, h.unique};
  reply.o.major = FUSE_KERNEL_VERSION;
  reply.o.minor = init.minor;
  reply.o.max_write = 128 * 1024;
  reply.o.flags = FUSE_INIT_EXT | FUSE_MAX_PAGES;
  reply.o.max_pages = 32;
  reply.o.flags2 = static_cast<uint32_t>(kInitFusePassthrough >> 32);
  const uint32_t depth = 1;
  memcpy(reinterpret_cast<char*>(&reply.o) + kInitOutMaxStackDepth, &depth, sizeof(depth));
  ASSERT_EQ(write(handoff->fuse.get(), &reply, sizeof(reply)), static_cast<ssize_t>(sizeof(reply))) << strerror(errno);
  ReplyToAgent(sock->get(), true, "", false, in.substr(0, static_cast<size_t>(n)));
  ASSERT_TRUE(AgentSaid("handed to server")) << agent_->Stderr();

  uint64_t next = 0;
  auto ask = [&](bool open, int fd, int32_t backing_id = 0) -> BackingReply {
    const uint64_t id = ++next;
    EXPECT_TRUE(SendHandoffMessage(sock->get(), EncodeBackingRequest(BackingRequest{id, open, backing_id}), fd).ok());
    pollfd p{sock->get(), POLLIN, 0};
    if (poll(&p, 1, 20000) != 1) return BackingReply{id, 0, "no answer"};
    char buf[4096];
    const ssize_t got = recv(sock->get(), buf, sizeof(buf), 0);
    auto r = DecodeBackingReply(absl::string_view(buf, got > 0 ? static_cast<size_t>(got) : 0));
    if (!r.ok() || !r->has_value()) return BackingReply{id, 0, "not a backing reply"};
    EXPECT_EQ((*r)->id, id);
    return **r;
  };
  const std::string agent_fds = "/proc/" + std::to_string(agent_->pid()) + "/fd";
  auto fd_count = [&] {
    int count = 0;
    for (const auto& e : fs::directory_iterator(agent_fds)) count += !e.path().empty();
    return count;
  };
  const int fds_before = fd_count();
  struct Hostile {
    const char* what;
    std::function<int()> open_fd;
    const char* says;
  };
  { std::ofstream(export_ + "/other.txt") << "not yours"; }
  ASSERT_EQ(chown((export_ + "/other.txt").c_str(), 12345, 12345), 0);
  ASSERT_EQ(chmod((export_ + "/other.txt").c_str(), 0600), 0);
  const std::vector<Hostile> hostile = {
      {"a directory", [&] { return open(export_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); }, "not a regular file"},
      {"a device", [] { return open("/dev/null", O_RDWR | O_CLOEXEC); }, "not a regular file"},
      {"an O_PATH fd", [&] { return open((export_ + "/hello.txt").c_str(), O_PATH | O_CLOEXEC); }, "O_PATH"},
      // (This server is root, but the agent opens as root without CAP_DAC_OVERRIDE: as the kernel will.)
      {"a file the server's user could not open", [&] { return open((export_ + "/other.txt").c_str(), O_RDONLY | O_CLOEXEC); },
       "the server could not open it itself"},
      {"no fd at all", [] { return -1; }, "exactly one file descriptor"},
  };
  for (const auto& k : hostile) {
    UniqueFd fd(k.open_fd());
    const BackingReply r = ask(true, fd.get());
    EXPECT_EQ(r.backing_id, 0) << k.what;
    EXPECT_TRUE(absl::StrContains(r.error, k.says)) << k.what << ": " << r.error;
  }
  // The first refusal is an Event on the volume's pods (once per server).
  EXPECT_TRUE(AgentSaid("PassthroughRefused")) << agent_->Stderr();
  EXPECT_EQ(agent_->CountInStderr("PassthroughRefused"), 1) << agent_->Stderr();
  // An id this server never registered (another connection's, or made up).
  EXPECT_TRUE(absl::StrContains(ask(false, -1, 7).error, "not one this volume's servers registered"));
  // A proper file: an id, which closes once and then is no longer ours.
  { std::ofstream(export_ + "/mine.txt") << "mine"; }
  UniqueFd mine(open((export_ + "/mine.txt").c_str(), O_RDWR | O_CLOEXEC));
  const BackingReply ok = ask(true, mine.get());
  EXPECT_TRUE(ok.error.empty()) << ok.error;
  EXPECT_GT(ok.backing_id, 0);
  EXPECT_TRUE(ask(false, -1, ok.backing_id).error.empty());
  EXPECT_TRUE(absl::StrContains(ask(false, -1, ok.backing_id).error, "not one this volume's servers registered"));
  // A flood: ids up to the limit, then a refusal saying so; closing one makes room again.
  std::vector<int32_t> ids;
  BackingReply flood;
  for (int i = 0; i < 5000 && (flood = ask(true, mine.get())).error.empty(); ++i) ids.push_back(flood.backing_id);
  EXPECT_EQ(ids.size(), 4096u);
  EXPECT_TRUE(absl::StrContains(flood.error, "holds 4096 backing files already")) << flood.error;
  EXPECT_TRUE(ask(false, -1, ids.back()).error.empty());
  ids.pop_back();
  EXPECT_TRUE(ask(true, mine.get()).error.empty()) << "room for one again";
  // The metrics say so: what the broker registered (4098), refused (the four files above) and
  // closed (2), and the 4096 ids the connection holds.
  {
    const std::string log = agent_->Stderr();
    const size_t at = log.find("(port ");
    ASSERT_NE(at, std::string::npos) << log;
    const std::string metrics = HttpGet(std::stoi(log.substr(at + 6)), "/metrics");
    for (const char* line : {"fusekeeper_passthrough_backing_files_total{outcome=\"registered\"} 4098",
                             "fusekeeper_passthrough_backing_files_total{outcome=\"refused\"} 4",
                             "fusekeeper_passthrough_backing_files_total{outcome=\"closed\"} 2",
                             "fusekeeper_passthrough_backing_files 4096"}) {
      EXPECT_TRUE(absl::StrContains(metrics, line)) << line << "\n" << metrics;
    }
  }
  // What is left registered when the server goes (4096 ids) with no table of them deposited: the
  // agent closes it.
  EXPECT_EQ(fd_count(), fds_before) << "every fd the agent received is closed";
  sock->Reset();
  EXPECT_TRUE(AgentSaid("closing the 4096 backing file(s) registered on its connection: its stopped server left them")) << agent_->Stderr();
  // The connection, which this server never served: aborted, so the mount's end waits for nothing.
  auto connection = FuseConnectionOfFd(handoff->fuse.get());
  ASSERT_TRUE(connection.ok() && connection->has_value());
  EXPECT_TRUE(AbortFuseConnectionBlocking(**connection).ok());
}

// With extended attributes, an unprivileged server tells the kernel it handles dropping
// privileges (FUSE_HANDLE_KILLPRIV_V2; the export's file system does it for each write it
// makes): a write through the mount drops a setuid bit, passed through or not, and once the
// kernel knows the file has no privileges to drop, a passthrough write asks the server nothing.
class KillPrivTest : public PassthroughE2ETest, public testing::WithParamInterface<bool> {};

TEST_P(KillPrivTest, AWriteDropsSetuidAndThenNeedsNoServer) {
  const bool passthrough = GetParam();
  Subprocess* server = StartServer(socket_, {"serve", "--root=" + export_, passthrough ? "--passthrough" : "--passthrough=false"});
  const std::string want = "hello from the export\n";
  auto view = PodReader(target_, "hello.txt");
  ASSERT_TRUE(view->WaitForReadsOf(want)) << view->setup_error() << server->Stderr() << agent_->Stderr();
  const std::string suid = export_ + "/suid.bin";
  { std::ofstream(suid) << "#!/bin/true\n"; }
  ASSERT_EQ(chown(suid.c_str(), kServerUid, kServerUid), 0);
  ASSERT_EQ(chmod(suid.c_str(), 04777), 0);
  fs::create_directories(root_.path() + "/views/app");
  // A pod's user that is not the file's owner.
  PodApp app(target_, root_.path() + "/views/app", 4242, [](const std::string& view_dir, int out) {
    const int fd = open((view_dir + "/suid.bin").c_str(), O_WRONLY | O_CLOEXEC);
    if (fd < 0) return PodApp::Report(out, PodApp::Err("open suid.bin"));
    PodApp::Report(out, "+");
    for (off_t at = 0;; at += 1) {
      pollfd p{out, POLLIN, 0};
      if (poll(&p, 1, -1) < 0) continue;
      const char c = PodApp::NextCommand(out);
      if (c == 'w') PodApp::Report(out, pwrite(fd, "x", 1, at) == 1 ? "=ok" : "=failed");
      if (c == 0) return;
    }
  });
  ASSERT_TRUE(app.WaitForStepsInAll(1)) << testing::PrintToString(app.errors());
  ASSERT_TRUE(app.Ask('w')) << server->Stderr();
  struct stat st;
  ASSERT_EQ(stat(suid.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0777u) << "the setuid bit was dropped by the write";
  ASSERT_TRUE(app.Ask('w')) << server->Stderr();  // the kernel learns there is nothing to drop
  if (passthrough) {
    server->Signal(SIGSTOP);
    const bool wrote = app.Ask('w', std::chrono::seconds(10));
    server->Signal(SIGCONT);
    EXPECT_TRUE(wrote) << "a passthrough write waited for the stopped server";
    EXPECT_EQ(ReadFile(suid).substr(0, 3), "xxx");
  }
  // Extended attributes still work.
  ASSERT_EQ(setxattr((target_ + "/hello.txt").c_str(), "user.k", "v", 1, 0), 0) << strerror(errno);
  char value[4] = {};
  EXPECT_EQ(getxattr((target_ + "/hello.txt").c_str(), "user.k", value, sizeof(value)), 1);
  view->Stop();
}

INSTANTIATE_TEST_SUITE_P(PassedThroughOrNot, KillPrivTest, testing::Bool(),
                         [](const testing::TestParamInfo<bool>& i) { return i.param ? "passthrough" : "plain"; });

// `fkserve serve --xattrs=false`: no extended attributes (the kernel is told ENOSYS once and asks
// no more), so a passthrough write needs no server at all; with them, getxattr works.
TEST_F(PassthroughE2ETest, WithoutXattrsAWriteNeedsNoServer) {
  Subprocess* server = StartServer(socket_, {"serve", "--root=" + export_, "--passthrough", "--xattrs=false"});
  const std::string want = "hello from the export\n";
  auto view = PodReader(target_, "hello.txt");
  ASSERT_TRUE(view->WaitForReadsOf(want)) << view->setup_error() << server->Stderr() << agent_->Stderr();
  char value[16];
  EXPECT_EQ(getxattr((target_ + "/hello.txt").c_str(), "user.x", value, sizeof(value)), -1);
  EXPECT_EQ(errno, EOPNOTSUPP) << "the kernel remembers the server has none";
  fs::create_directories(root_.path() + "/views/app");
  PodApp app(target_, root_.path() + "/views/app", kServerUid, [](const std::string& view_dir, int out) {
    const int fd = open((view_dir + "/nx.txt").c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0644);
    if (fd < 0) return PodApp::Report(out, PodApp::Err("open nx.txt"));
    PodApp::Report(out, "+");
    while (true) {
      pollfd p{out, POLLIN, 0};
      if (poll(&p, 1, -1) < 0) continue;
      const char c = PodApp::NextCommand(out);
      if (c == 'w') PodApp::Report(out, pwrite(fd, "written", 7, 0) == 7 ? "=ok" : "=failed");
      if (c == 0) return;
    }
  });
  ASSERT_TRUE(app.WaitForStepsInAll(1)) << testing::PrintToString(app.errors());
  server->Signal(SIGSTOP);
  const bool wrote = app.Ask('w', std::chrono::seconds(10));
  server->Signal(SIGCONT);
  EXPECT_TRUE(wrote) << "a passthrough write waited for the stopped server";
  EXPECT_EQ(ReadFile(export_ + "/nx.txt"), "written");
  view->Stop();
}

}  // namespace
}  // namespace fusekeeper
